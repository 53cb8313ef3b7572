"""Where an exported graph spends its time in onnxruntime: a prompt through the KV-cache graph of one model
kind at issue 9's shape, timed per operator type by onnxruntime's own profiler.

    .venv/bin/python -m benchmarks.profile_onnx --kind bam-shared-kv [--runs 3] [--threads 2] [--top 15]

Exports the fused model the way `benchmarks/inference.py`'s ORT rows do (converters/onnx_graph.export_graph,
fp32, default opset), runs the prompt (batch 4 x 256 tokens, empty past) once to warm up and --runs times
more, and prints, over those runs, milliseconds per run and the share of each operator type's kernel time.
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
    from bam_surgery.converters.onnx_runtime import OrtDecoder

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kind", choices=sorted(KINDS), default="bam-shared-kv")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()

    import numpy as np
    import torch

    torch.set_num_threads(args.threads)
    size = SIZES["issue9"]
    engine = OrtEngine(Case(f"{args.kind} ORT", "onnxruntime", args.kind, "sparse"), size)
    tokens = torch.randint(0, size["vocab_size"], (size["batch"], size["seq"]),
                           generator=torch.Generator().manual_seed(1)).numpy()
    mask = np.ones_like(tokens)
    with tempfile.TemporaryDirectory(prefix="profile-onnx-") as tmp:
        decoder = OrtDecoder(Path(engine._folder.name) / "model.onnx", args.threads, os.path.join(tmp, "ort"))
        for _ in range(1 + args.runs):
            decoder.forward(tokens, mask)
        events = json.loads(Path(decoder.session.end_profiling()).read_text())
    # the runs after the warm-up: the windows of every "model_run" event but the first
    windows = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == "model_run")[1:]
    per_op: collections.Counter = collections.Counter()
    for e in events:
        if (e.get("cat") == "Node" and e["name"].endswith("_kernel_time")
                and any(start <= e["ts"] <= end for start, end in windows)):
            per_op[e["args"]["op_name"]] += e["dur"]  # microseconds
    total = sum(per_op.values())
    print(f"{args.kind}: prompt {tokens.shape[0]} x {tokens.shape[1]}, {args.threads} threads, "
          f"{total / len(windows) / 1e3:.1f} ms of kernel time per run ({len(windows)} runs)")
    for op, us in per_op.most_common(args.top):
        print(f"  {op:28s} {us / len(windows) / 1e3:8.1f} ms  {100 * us / total:5.1f}%")


if __name__ == "__main__":
    main()
