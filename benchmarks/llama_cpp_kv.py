"""llama.cpp against the runtime on a real model, with an f32 and an f16 KV cache: the largest logit difference
over a prompt (prefill) and over greedy decoding steps, and whether the greedy tokens agree.

    .venv-compat/gguf/bin/python -m benchmarks.llama_cpp_kv --gguf SmolLM2-135M-Instruct.Q4_1.gguf --out bench-out/kv

The seed is read from the GGUF by the runtime (dequantized to f32) and exported back with `bam-surgery
export-gguf --dtype f32`, so llama.cpp and the runtime hold the same f32 weights; what differs is the arithmetic
(llama.cpp's kernels, and its KV cache: `type_k`/`type_v` f32 or its default f16). The prompt is a real English
paragraph through the model's own tokenizer (llama.cpp's); decoding feeds the runtime's greedy tokens one at a
time and compares each step's logits. Runs in .venv-compat/gguf (llama-cpp-python; no transformers needed).
Writes results.json and results.md under --out.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

PROMPT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
          "movable metal type, oil-based ink and a screw press adapted from wine making. Within fifty years, "
          "presses were at work in more than two hundred European cities, and the price of books fell sharply.")
KV_TYPES = ("f32", "f16")


def measure(gguf: Path, work: Path, steps: int, threads: int) -> dict:
    import llama_cpp
    import numpy as np
    import torch

    from bam_surgery.converters import open_checkpoint
    from bam_surgery.runtime import model_from_reader

    exported = work / "seed-f32.gguf"
    if not exported.exists():
        subprocess.run([sys.executable, "-m", "bam_surgery", "export-gguf", str(gguf), "--out", str(exported),
                        "--dtype", "f32"], check=True)
    with open_checkpoint(str(gguf)) as reader:
        model = model_from_reader(reader, "cpu", torch.float32)
    torch.set_num_threads(threads)
    ggml = {"f32": llama_cpp.GGML_TYPE_F32, "f16": llama_cpp.GGML_TYPE_F16}
    rows = []
    for kv in KV_TYPES:
        llm = llama_cpp.Llama(model_path=str(exported), n_ctx=256, logits_all=True, n_threads=threads,
                              n_threads_batch=threads, type_k=ggml[kv], type_v=ggml[kv], verbose=False)
        ids = llm.tokenize(PROMPT.encode(), add_bos=False)
        with torch.no_grad():
            want = model(torch.tensor([ids])).logits[0].double().numpy()
        llm.eval(ids)
        got = np.array(llm.scores[:len(ids)], dtype=np.float64)
        prefill = float(np.abs(got - want).max())
        seq, decode, equal, llama_tokens = list(ids), 0.0, True, []
        token = int(want[-1].argmax())
        for _ in range(steps):
            seq.append(token)
            llm.eval([token])
            got = np.array(llm.scores[len(seq) - 1], dtype=np.float64)
            with torch.no_grad():
                want_step = model(torch.tensor([seq])).logits[0, -1].double().numpy()
            decode = max(decode, float(np.abs(got - want_step).max()))
            llama_tokens.append(int(got.argmax()))
            token = int(want_step.argmax())
            equal &= llama_tokens[-1] == token
        rows.append(dict(kv_cache=kv, prompt_tokens=len(ids), decode_steps=steps, prefill_max_abs=prefill,
                         decode_max_abs=decode, greedy_equal=bool(equal),
                         logit_scale=float(np.abs(want).max())))
        del llm
    return dict(gguf=str(gguf), exported=str(exported), rows=rows)


def render(result: dict) -> str:
    lines = ["| KV cache | prompt tokens | max \\|dlogit\\| prefill | max \\|dlogit\\| decode | greedy tokens equal |",
             "|---|---:|---:|---:|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['kv_cache']} | {r['prompt_tokens']} | {r['prefill_max_abs']:.1e} | "
                     f"{r['decode_max_abs']:.1e} ({r['decode_steps']} steps) | {'yes' if r['greedy_equal'] else 'no'} |")
    return "\n".join(lines) + f"\n\nlargest |logit| of the runtime: {result['rows'][0]['logit_scale']:.1f}\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", type=Path, required=True, help="the real model's GGUF (any type gguf dequantizes)")
    ap.add_argument("--out", type=Path, default=None, help="folder for results.json, results.md and the f32 export")
    ap.add_argument("--steps", type=int, default=8, help="greedy decoding steps after the prompt")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = args.out or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        result = measure(args.gguf, work, args.steps, args.threads)
    result.update(command=" ".join(sys.argv), machine=f"{platform.node()} {os.cpu_count()} cpus",
                  load_average=os.getloadavg())
    print(render(result))
    if args.out:
        (args.out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
        (args.out / "results.md").write_text(render(result))


if __name__ == "__main__":
    main()
