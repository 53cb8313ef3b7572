"""Where an exported graph spends its time in onnxruntime: a prompt through the KV-cache graph of one model
kind at issue 9's shape, timed per operator type by onnxruntime's own profiler.

    .venv/bin/python -m benchmarks.profile_onnx --kind bam-shared-kv [--runs 3] [--threads 2] [--top 15]

Exports the fused model the way `benchmarks/inference.py`'s ORT rows do (converters/onnx_graph.export_graph,
fp32, default opset), runs the prompt (batch 4 x 256 tokens, empty past) once to warm up and --runs times
profiled, and prints milliseconds per run and the share of each operator type's kernel time.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import tempfile
from pathlib import Path


def main() -> None:
    from benchmarks.inference import KINDS, SIZES, Case, OrtEngine

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kind", choices=sorted(KINDS), default="bam-shared-kv")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()

    import numpy as np
    import onnxruntime as ort
    import torch

    torch.set_num_threads(args.threads)
    size = SIZES["issue9"]
    engine = OrtEngine(Case(f"{args.kind} ORT", "onnxruntime", args.kind, "sparse"), size)
    tokens = torch.randint(0, size["vocab_size"], (size["batch"], size["seq"]),
                           generator=torch.Generator().manual_seed(1)).numpy()
    with tempfile.TemporaryDirectory(prefix="profile-onnx-") as tmp:
        options = ort.SessionOptions()
        options.intra_op_num_threads, options.inter_op_num_threads = args.threads, 1
        session = ort.InferenceSession(str(Path(engine._folder.name) / "model.onnx"), options,
                                       providers=["CPUExecutionProvider"])
        mask = np.ones_like(tokens)
        feeds = {"input_ids": tokens, "attention_mask": mask, "position_ids": mask.cumsum(-1) - 1}
        feeds.update({i.name: np.zeros((tokens.shape[0], i.shape[1], 0, i.shape[3]), np.float32)
                      for i in session.get_inputs() if i.name.startswith("past_key_values.")})
        session.run(None, feeds)  # warm-up, not profiled
        options.enable_profiling, options.profile_file_prefix = True, os.path.join(tmp, "ort")
        session = ort.InferenceSession(str(Path(engine._folder.name) / "model.onnx"), options,
                                       providers=["CPUExecutionProvider"])
        session.run(None, feeds)  # the new session's own warm-up
        for _ in range(args.runs):
            session.run(None, feeds)
        events = json.loads(Path(session.end_profiling()).read_text())
    per_op: collections.Counter = collections.Counter()
    for event in events:
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
            per_op[event["args"]["op_name"]] += event["dur"]  # microseconds
    runs = args.runs + 1  # the profiled session's warm-up is in the profile too
    total = sum(per_op.values())
    print(f"{args.kind}: prompt {tokens.shape[0]} x {tokens.shape[1]}, {args.threads} threads, "
          f"{total / runs / 1e3:.1f} ms of kernel time per run")
    for op, us in per_op.most_common(args.top):
        print(f"  {op:28s} {us / runs / 1e3:8.1f} ms  {100 * us / total:5.1f}%")


if __name__ == "__main__":
    main()
