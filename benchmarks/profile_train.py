"""Where a training step's time goes (issue 40): torch.profiler over the runtime's training step, and the step's
tokens/s under a few variants, in one process (each model built and compiled once).

    python -m benchmarks.profile_train --device cuda --size paper-small --out bench-out/profile   # on a GPU
    .venv/bin/python -m benchmarks.profile_train --device cpu --size smoke --out bench-out/profile-smoke

Variants (--variants): eager (the step as `benchmarks.inference` times it: fp32 master weights, bf16 autocast on
CUDA, AdamW with torch's default implementation), fused-adamw (AdamW(fused=True)), compiled (torch.compile of
the model, fused AdamW). Kinds (--kinds): the runtime kinds of benchmarks.inference (fused path), and
"bam-expert-kv reference" for the per-expert loop. Each (kind, variant) row: median step time of --steps timed
steps after --warmup steps, tokens/s and MFU (3x the forward FLOPs of benchmarks.inference). With --profile, the
eager step of each kind is profiled: the top operators by device (CUDA) or CPU self time are printed and written
to OUT/profile-KIND.txt. Rows are appended to OUT/rows.jsonl as they are measured; --budget-s stops starting new
rows past that many seconds (a lease that ends early keeps what was measured).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from benchmarks.inference import KINDS, PEAK_TFLOPS, SIZES, peak_tflops, runtime_config, runtime_flops_per_token


def build(kind: str, size: dict, device: str):
    import torch

    from bam_surgery.runtime import Model

    base, _, impl = kind.partition(" ")
    torch.manual_seed(0)
    model = Model(runtime_config(base, size)).to(device)
    model.impl = impl or "fused"
    return model


def step_fn(model, optimizer, tokens, device: str, bf16: bool):
    import torch

    def step():
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=bf16):
            loss = model(tokens[:, :-1], targets=tokens[:, 1:], return_logits=False).loss
        loss.backward()
        optimizer.step()
    return step


def timed(step, sync, warmup: int, steps: int) -> list[float]:
    for _ in range(warmup):
        step()
    sync()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
    return times


def profile(step, sync, device: str, out: Path, name: str, rows: int) -> str:
    import torch
    from torch.profiler import ProfilerActivity, profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    step()
    sync()
    with torch_profile(activities=activities, record_shapes=True) as prof:
        for _ in range(2):
            step()
        sync()
    key = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
    text = (f"# {name}: top operators by {key} (2 steps)\n"
            + prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=60)
            + f"\n# {name}: top operators by shape, {key}\n"
            + prof.key_averages(group_by_input_shape=True).table(sort_by=key, row_limit=rows,
                                                                 max_name_column_width=50,
                                                                 max_shapes_column_width=70))
    (out / f"profile-{name.replace(' ', '-')}.txt").write_text(text, encoding="utf-8")
    return text


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--size", choices=list(SIZES), default="smoke")
    parser.add_argument("--kinds", nargs="*", default=["dense", "btx", "bam-expert-kv", "bam-expert-kv reference"])
    parser.add_argument("--variants", nargs="*", default=["eager", "fused-adamw", "compiled"])
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--profile-rows", type=int, default=25)
    parser.add_argument("--budget-s", type=float, default=1e9)
    parser.add_argument("--out", type=Path, default=Path("bench-out/profile"))
    args = parser.parse_args(argv)
    import torch

    started = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    name = torch.cuda.get_device_name() if cuda else "cpu"
    peak = peak_tflops(name) if cuda else None
    size = SIZES[args.size]
    B, T = size["batch"], size["seq"]
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, size["vocab_size"], (B, T + 1), generator=gen).to(args.device)
    print(f"device {name}, torch {torch.__version__}, size {args.size}, peak {peak} TFLOP/s", flush=True)
    rows_file = args.out / "rows.jsonl"
    for kind in args.kinds:
        model = build(kind, size, args.device)
        fwd = runtime_flops_per_token(model.config, T)
        for variant in args.variants:
            if time.perf_counter() - started > args.budget_s:
                print(f"{kind} {variant}: skipped (budget)", flush=True)
                continue
            if variant == "compiled" and kind.endswith("reference"):
                continue
            torch.manual_seed(0)
            run_model = torch.compile(model) if variant == "compiled" else model
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4,
                                          fused=(variant != "eager") or None)
            step = step_fn(run_model, optimizer, tokens, args.device, cuda)
            t0 = time.perf_counter()
            try:
                times = timed(step, sync, args.warmup, args.steps)
            except Exception as e:  # noqa: BLE001 - one failed row is reported, the others go on
                print(f"{kind} {variant}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:300]}", flush=True)
                continue
            med = statistics.median(times)
            tps = B * T / med
            row = dict(kind=kind, variant=variant, step_s=med, tokens_per_s=tps,
                       mfu=(3 * fwd * tps / (peak * 1e12)) if peak else None, warm_s=time.perf_counter() - t0,
                       peak_gib=(torch.cuda.max_memory_allocated() / 2**30) if cuda else None, device=name)
            with rows_file.open("a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")
            mfu = f"{row['mfu'] * 100:.1f}%" if row["mfu"] is not None else "-"
            print(f"{kind:26s} {variant:12s} step {med * 1e3:8.1f} ms  {tps:10,.0f} tok/s  MFU {mfu}"
                  f"  (rows took {row['warm_s']:.0f} s)", flush=True)
            if args.profile and variant == "eager":
                print(profile(step, sync, args.device, args.out, kind, args.profile_rows), flush=True)
            del optimizer, run_model
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
        del model
    print(f"total {time.perf_counter() - started:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
