"""Sliding-window attention in the runtime's static KV cache: what the window mask costs.

The cache keeps every slot and the mask hides the slots out of the window (runtime/blocks.py attention_mask_for),
so a windowed model decodes over the whole cache like an unwindowed one. This measures prefill and greedy decode
of the same model with and without a window, at a cache long enough for the window to matter.

    .venv/bin/python -m benchmarks.window [--prompt 2048] [--new 64] [--window 256]
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from bam_surgery.runtime import Model, ModelConfig
from bam_surgery.runtime.generation import generate


def run(window: int | None, prompt_len: int, new: int) -> dict:
    cfg = ModelConfig(vocab_size=512, d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=512,
                      max_positions=prompt_len + new, attn_window=window)
    model = Model(cfg).eval()
    model.reset_parameters(std=0.02, seed=0)
    prompt = torch.randint(0, 512, (1, prompt_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        generate(model, prompt[:, :64], 4)  # warm-up
        start = time.perf_counter()
        generate(model, prompt, 1)
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        generate(model, prompt, new)
        total = time.perf_counter() - start
    decode = max(total - prefill, 1e-9)
    return {"window": window, "prefill_s": round(prefill, 3), "decode_tokens_per_s": round((new - 1) / decode, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--window", type=int, default=256)
    a = parser.parse_args()
    torch.set_num_threads(2)
    rows = [run(None, a.prompt, a.new), run(a.window, a.prompt, a.new)]
    print(json.dumps({"prompt": a.prompt, "new": a.new, "threads": torch.get_num_threads(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
