"""The GPU benchmark (`make bench-gpu`, issue 40): every case of benchmarks/inference.py in ONE process, the most
important first, each model built (and compiled) once, each row written out as soon as it is measured, and a time
budget (--budget-s) past which nothing new starts: a lease that ends early keeps every row already measured.

    python -m benchmarks.gpu --out bench-out/gpu                                   # on a GPU (make bench-gpu)
    .venv/bin/python -m benchmarks.gpu --device cpu --size smoke --out bench-out/gpu-smoke   # a check on the CPU

Per case, in this order (phases of a case share its model):
    prefill          one forward over batch x seq tokens into the static cache, bf16 weights (median of --repeat)
    decode b1 / bB   greedy steps after the prompt, bf16 weights and cache; fused cases through torch.compile of
                     the decode step (CUDA: mode reduce-overhead, i.e. CUDA graphs; compiled once per batch size),
                     transformers' forward with past_key_values for its engines; and generate() at batch 1 for them
    train            the step `bam-surgery train` runs: fp32 master weights under bf16 autocast (fp32 on the CPU
                     unless --dtype bf16), the chunked loss head, gradient clipping, train.optim's AdamW (fused);
                     transformers: labels=, torch's default AdamW (what a plain loop runs)
    train compiled   the same step with train.optim.compile_blocks (each block compiled once, shared by every
                     layer: what `bam-surgery train --compile on` and, on CUDA, --compile auto run); fused cases
Columns: tokens/s, MFU (3x the forward FLOPs for training) against --peak-tflops or the device's table entry, the
compile time, decode b1 against the device's memory-bandwidth limit (every active bf16 weight and the KV cache read
once per token: bandwidth / bytes per token; --hbm-tbs or the table), peak memory per phase.

Order (most important first; --cases picks a subset): dense fused, BAM expert KV fused, BAM expert KV reference,
Mixtral (transformers), BTX fused, HF BAM export, JetMoE, BAM shared KV fused, the other reference rows. Writes
OUT/rows.jsonl (one line per finished case) and OUT/results.md (the table and the issue's targets so far) after
every case. Imports what benchmarks/inference.py imports (transformers only for its three peer rows).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

from benchmarks.inference import (CASES, ENGINES, SIZES, Case, Setting, _met, _percent, by_device_name, machine,
                                  peak_tflops, skip_reason, table_head)

ORDER = ["dense fused", "bam-expert-kv fused", "bam-expert-kv reference", "Mixtral (transformers)", "btx fused",
         "HF BAM export expert KV (transformers)", "JetMoE MoA top-4 (transformers)", "bam-shared-kv fused",
         "bam-shared-kv reference", "btx reference", "dense reference"]
# Peak memory bandwidth (TB/s) by a substring of the device name, first match: the decode limit's denominator
HBM_TBS = (("H100 PCIe", 2.0), ("H100 NVL", 3.9), ("H100", 3.35), ("GH200", 4.9), ("H200", 4.8), ("H800", 3.35),
           ("H20", 4.0), ("B200", 8.0), ("A100-SXM4-40GB", 1.555), ("A100 80GB PCIe", 1.935), ("A100", 2.039),
           ("L40S", 0.864), ("L40", 0.864), ("L4", 0.3), ("A10G", 0.6), ("A10", 0.6), ("RTX 4090", 1.008))
TARGETS = dict(dense_train_mfu=0.40, bam_train_mfu=0.35, bam_prefill_over_reference=3.0, decode1_of_limit=0.5)
PHASE_COST_S = {"compile": 60.0}  # a compiled phase starts only with this much of the budget left


def hbm_tbs(device_name: str) -> Optional[float]:
    return by_device_name(HBM_TBS, device_name)


@dataclass
class Row:
    case: str
    device: str = ""
    prefill_tps: float = 0.0
    decode1_tps: float = 0.0
    decode_batch_tps: float = 0.0
    decode_batch: int = 0
    decode_mode: str = ""
    generate_tps: float = 0.0
    train_tps: float = 0.0
    train_compiled_tps: float = 0.0
    compile_s: float = 0.0
    flops_per_token: float = 0.0
    decode_bytes_per_token: float = 0.0  # bf16 weights a batch-1 token reads plus its KV cache reads
    kv_bytes_per_token: int = 0
    peak_gib: dict = field(default_factory=dict)
    seconds: float = 0.0
    errors: dict = field(default_factory=dict)  # phase -> one line
    skipped: str = ""  # the whole case
    skipped_phases: list = field(default_factory=list)


# ---- the runner ----------------------------------------------------------------------------------
class Bench:
    """Every case in this process, within the budget; rows written as they finish."""

    def __init__(self, args):
        import torch

        self.torch, self.args = torch, args
        self.cuda = args.device == "cuda"
        self.device_name = torch.cuda.get_device_name() if self.cuda else "cpu"
        self.peak = args.peak_tflops if args.peak_tflops is not None else (
            peak_tflops(self.device_name) if self.cuda else None)
        self.hbm = args.hbm_tbs if args.hbm_tbs is not None else (hbm_tbs(self.device_name) if self.cuda else None)
        self.size = SIZES[args.size]
        self.setting = Setting(args.device, args.dtype, decode_graphs=True,
                               compile_backend=args.compile_backend or "inductor")
        self.started = time.perf_counter()
        self.rows: list[Row] = []
        gen = torch.Generator().manual_seed(1)
        rows = max(self.size["batch"], self.size["decode_batch"])
        self.tokens = torch.randint(0, self.size["vocab_size"], (rows, self.size["seq"] + 1), generator=gen
                                    ).to(args.device)

    def left(self) -> float:
        return self.args.budget_s - (time.perf_counter() - self.started)

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def timed(self, fn: Callable[[], None], repeat: int) -> float:
        fn()  # warm-up (compiles, captures)
        times = []
        for _ in range(repeat):
            self.sync()
            start = time.perf_counter()
            fn()
            self.sync()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    def phase(self, row: Row, name: str, measure: Callable[[], None], cost: str = "") -> None:
        """Run one phase unless the budget is spent (a compiled phase needs PHASE_COST_S left); a failure is
        one line in row.errors and the case goes on."""
        if self.left() < PHASE_COST_S.get(cost, 0.0):
            row.skipped_phases.append(name)
            return
        if self.cuda:
            self.torch.cuda.reset_peak_memory_stats()
        try:
            measure()
        except Exception as e:  # noqa: BLE001 - one failed phase is reported, the others go on
            row.errors[name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
            print(f"{row.case}: {name} FAILED {row.errors[name]}", file=sys.stderr, flush=True)
        if self.cuda:
            row.peak_gib[name] = round(self.torch.cuda.max_memory_allocated() / 2**30, 2)

    def run(self, cases: list[Case]) -> list[Row]:
        for case in cases:
            row = Row(case.name, device=self.device_name)
            reason = skip_reason(case, self.args.device)
            if reason or self.left() <= 0:
                row.skipped = reason or f"time budget ({self.args.budget_s:.0f} s) spent"
            else:
                start = time.perf_counter()
                self.run_case(case, row)
                row.seconds = round(time.perf_counter() - start, 1)
            self.rows.append(row)
            self.write(row)
        return self.rows

    def run_case(self, case: Case, row: Row) -> None:
        torch = self.torch
        try:
            engine = ENGINES[case.engine](case, self.size, self.setting)
        except Exception as e:  # noqa: BLE001 - a model that cannot be built is one row
            row.errors["build"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
            return
        row.flops_per_token = engine.flops_per_token(self.size["seq"])
        runtime = case.engine == "runtime"
        if self.setting.low_precision is not None:
            engine.model.to(self.setting.low_precision)  # inference: bf16 weights and cache
        self.phase(row, "prefill", lambda: self.prefill(engine, row))
        row.kv_bytes_per_token = engine.kv_bytes_per_token()
        compiled = runtime and case.impl == "fused"
        row.decode_mode = engine.decode_mode() if runtime else "eager"
        self.phase(row, "decode", lambda: self.decode(engine, row), "compile" if compiled else "")
        if hasattr(engine, "generate"):
            steps = self.size["decode_steps"]
            self.phase(row, "generate", lambda: setattr(
                row, "generate_tps", steps / self.timed(lambda: engine.generate(self.tokens[:1, :-1], steps),
                                                        self.args.repeat)))
        if runtime:
            row.decode_bytes_per_token = decode_bytes(engine.cfg, self.size)
        engine.model.float().train()
        self.phase(row, "train", lambda: self.train(engine, row, runtime, compiled=False))
        if compiled:
            self.phase(row, "train compiled", lambda: self.train(engine, row, runtime, compiled=True), "compile")
        del engine
        # compiled code (and CUDA graphs) of this model go: the next model compiles afresh, never against a
        # recompile limit filled by earlier models
        torch._dynamo.reset()
        if self.cuda:
            torch.cuda.empty_cache()

    # ---- phases ----------------------------------------------------------------------------------
    def prefill(self, engine, row: Row) -> None:
        B, T, steps = self.size["batch"], self.size["seq"], self.size["decode_steps"]
        row.prefill_tps = B * T / self.timed(lambda: engine.prefill(self.tokens[:B, :T], T + steps), self.args.repeat)

    def decode(self, engine, row: Row) -> None:
        T, steps, DB = self.size["seq"], self.size["decode_steps"], self.size["decode_batch"]
        row.decode_batch = DB
        for batch in (1, DB):
            prompt = self.tokens[:batch, :T]

            def once() -> float:
                state = engine.prefill(prompt, T + steps)
                self.sync()
                start = time.perf_counter()
                engine.decode(state, T, steps)
                self.sync()
                return time.perf_counter() - start

            once()  # compiles and captures for this batch size
            seconds = statistics.median(once() for _ in range(self.args.repeat))
            setattr(row, "decode1_tps" if batch == 1 else "decode_batch_tps", batch * steps / seconds)

    def train(self, engine, row: Row, runtime: bool, compiled: bool) -> None:
        torch = self.torch
        B, T = self.size["batch"], self.size["seq"]
        tokens = self.tokens[:B]
        if runtime:
            from bam_surgery.train import TrainConfig
            from bam_surgery.train.optim import build_optimizer, compile_blocks

            optimizer, _ = build_optimizer(engine.model, TrainConfig(lr=1e-4, warmup_steps=0))
            if compiled:
                start = time.perf_counter()
                compile_blocks(engine.model, backend=self.setting.compile_backend)
        else:
            optimizer = torch.optim.AdamW(engine.model.parameters(), lr=1e-4)

        def step() -> None:
            optimizer.zero_grad(set_to_none=True)
            with self.setting.autocast():
                if runtime:
                    loss = engine.model(tokens[:, :-1], targets=tokens[:, 1:], return_logits=False).loss
                else:
                    loss = engine.model(tokens[:, :-1], labels=tokens[:, :-1]).loss
            loss.backward()
            if runtime:
                torch.nn.utils.clip_grad_norm_(engine.model.parameters(), 1.0)
            optimizer.step()

        if compiled:
            step()  # the compilation
            self.sync()
            row.compile_s = round(time.perf_counter() - start, 1)
        tps = B * T / self.timed(step, self.args.repeat)
        setattr(row, "train_compiled_tps" if compiled else "train_tps", tps)

    # ---- output ----------------------------------------------------------------------------------
    def write(self, row: Row) -> None:
        out = self.args.out
        out.mkdir(parents=True, exist_ok=True)
        with (out / "rows.jsonl").open("a", encoding="utf-8") as f:
            f.write(json.dumps(asdict(row)) + "\n")
        (out / "results.md").write_text(self.report(), encoding="utf-8")
        state = "skipped: " + row.skipped if row.skipped else f"{row.seconds:.0f} s" + (
            f", failed: {', '.join(row.errors)}" if row.errors else "")
        print(f"{row.case}: {state} (at {time.perf_counter() - self.started:.0f} s)", file=sys.stderr, flush=True)

    def report(self) -> str:
        a = self.args
        head = (f"{machine()}\n{a.device}, {a.dtype}, size {a.size}, repeat {a.repeat}, one process, budget "
                f"{a.budget_s:.0f} s; MFU against " + (f"{self.peak:g} TFLOP/s" if self.peak else "no known peak")
                + "; decode limit at " + (f"{self.hbm:g} TB/s" if self.hbm else "no known bandwidth"))
        return f"{head}\n\n{table(self.rows, self.peak, self.hbm)}\n\n{targets(self.rows, self.peak, self.hbm)}\n"


def decode_bytes(cfg, size: dict) -> float:
    """Bytes one batch-1 decode step reads at least, in bf16: every matmul weight the token runs through (all
    attention experts under soft routing, the top-k FFN experts, routers, the head; one embedding row) and the
    KV cache over the mean context of the decode."""
    D, Hq, Gk, F, L = cfg.d_model, cfg.q_dim, cfg.kv_dim, cfg.ffn_hidden, cfg.n_layers
    Ea, Ef = cfg.attn_experts, cfg.ffn_experts
    if not Ea:
        attention = 2 * D * Hq + 2 * D * Gk
    elif cfg.kv_mode == "expert":
        attention = Ea * (2 * D * Hq + 2 * D * Gk) + Ea * D
    else:
        attention = Ea * 2 * D * Hq + 2 * D * Gk + Ea * D
    ffn = 3 * D * F * ((cfg.ffn_top_k or Ef) if Ef else 1) + Ef * D
    weights = L * (attention + ffn) + cfg.vocab_size * D + D
    kv_heads = (Ea if Ea and cfg.kv_mode == "expert" else 1) * cfg.n_kv_heads
    context = size["seq"] + size["decode_steps"] / 2
    return 2.0 * (weights + 2 * L * kv_heads * cfg.head_dim * context)


def _mfu(tps: float, flops: float, peak: Optional[float], factor: int) -> Optional[float]:
    return tps * flops * factor / (peak * 1e12) if peak and tps else None


def _limit(r: Row, hbm: Optional[float]) -> Optional[float]:
    """decode b1 as a share of the bandwidth limit (hbm TB/s / bytes per token)."""
    if not (hbm and r.decode_bytes_per_token and r.decode1_tps):
        return None
    return r.decode1_tps / (hbm * 1e12 / r.decode_bytes_per_token)


def table(rows: list[Row], peak: Optional[float], hbm: Optional[float]) -> str:
    db = next((r.decode_batch for r in rows if r.decode_batch), 0)
    out = table_head("case", "prefill tok/s:", "prefill MFU:", "train tok/s:", "train MFU:", "train compiled tok/s:",
                     "compiled MFU:", "compile s:", "decode b1 tok/s:", "b1 of bandwidth limit:",
                     f"decode b{db} tok/s:", "generate b1 tok/s:", "decode", "KV bytes/token:", "peak GiB", "s:",
                     "notes")
    for r in rows:
        if r.skipped:
            out.append(f"| {r.case} | skipped: {r.skipped} |")
            continue
        n = lambda v, f="{:,.0f}": f.format(v) if v else "-"  # noqa: E731
        notes = "; ".join([f"{k} failed: {v}" for k, v in r.errors.items()]
                          + ([f"not run (budget): {', '.join(r.skipped_phases)}"] if r.skipped_phases else []))
        peaks = " / ".join(f"{k} {v:g}" for k, v in r.peak_gib.items())
        out.append(f"| {r.case} | {n(r.prefill_tps)} | {_percent(_mfu(r.prefill_tps, r.flops_per_token, peak, 1))} | "
                   f"{n(r.train_tps)} | {_percent(_mfu(r.train_tps, r.flops_per_token, peak, 3))} | "
                   f"{n(r.train_compiled_tps)} | {_percent(_mfu(r.train_compiled_tps, r.flops_per_token, peak, 3))} | "
                   f"{n(r.compile_s, '{:.0f}')} | {n(r.decode1_tps, '{:,.1f}')} | {_percent(_limit(r, hbm))} | "
                   f"{n(r.decode_batch_tps, '{:,.1f}')} | {n(r.generate_tps, '{:,.1f}')} | {r.decode_mode or '-'} | "
                   f"{r.kv_bytes_per_token:,} | {peaks or '-'} | {r.seconds:.0f} | {notes} |")
    return "\n".join(out)


def targets(rows: list[Row], peak: Optional[float], hbm: Optional[float]) -> str:
    """Issue 40's GPU targets, set for paper-small on an H100-class device, checked on the rows measured."""
    t, by = TARGETS, {r.case: r for r in rows if not r.skipped}
    lines = ["Issue 40's targets (paper-small, H100-class device):"]
    for name, goal in (("dense fused", t["dense_train_mfu"]), ("bam-expert-kv fused", t["bam_train_mfu"])):
        r = by.get(name)
        best = max(r.train_tps, r.train_compiled_tps) if r else 0.0
        m = _mfu(best, r.flops_per_token, peak, 3) if r else None
        lines.append(f"- {name} training MFU {_percent(m)} (best of eager and compiled; target >= {goal:.0%}: "
                     + ("not measured)" if m is None else f"{_met(m >= goal)})"))
    fused, ref = by.get("bam-expert-kv fused"), by.get("bam-expert-kv reference")
    if fused and ref and fused.prefill_tps and ref.prefill_tps:
        ratio = fused.prefill_tps / ref.prefill_tps
        lines.append(f"- bam-expert-kv fused prefill {ratio:.2f}x the reference (target >= "
                     f"{t['bam_prefill_over_reference']:.0f}x: {_met(ratio >= t['bam_prefill_over_reference'])})")
    else:
        lines.append("- bam-expert-kv fused prefill / reference: not measured")
    for r in rows:
        share = _limit(r, hbm)
        if share is not None and r.case.endswith("fused"):
            limit = hbm * 1e12 / r.decode_bytes_per_token
            lines.append(f"- {r.case} decode b1 {r.decode1_tps:,.1f} tokens/s = {share:.0%} of the bandwidth limit "
                         f"{hbm:g} TB/s / {r.decode_bytes_per_token / 1e9:.3f} GB per token = {limit:,.0f} tokens/s "
                         f"(target >= {t['decode1_of_limit']:.0%}: {_met(share >= t['decode1_of_limit'])})")
    peers = ("Mixtral (transformers)", "JetMoE MoA top-4 (transformers)", "HF BAM export expert KV (transformers)")
    got = [p for p in peers if p in by and (by[p].prefill_tps or by[p].train_tps)]
    lines.append(f"- transformers rows measured: {', '.join(got) if got else 'none'}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench-out/gpu"))
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--size", choices=list(SIZES), default="paper-small")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="bf16",
                        help="bf16: bf16 inference weights and cache, training under bf16 autocast (the default)")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per metric after a warm-up (median)")
    parser.add_argument("--budget-s", type=float, default=280.0,
                        help="start nothing new after this many seconds (a compiled phase needs 60 s left)")
    parser.add_argument("--cases", nargs="*", help="run only these cases (in the benchmark's order)")
    parser.add_argument("--peak-tflops", type=float, help="peak dense bf16 TFLOP/s for MFU (default: by device name)")
    parser.add_argument("--hbm-tbs", type=float, help="memory bandwidth in TB/s for the decode limit (default: "
                                                       "by device name)")
    parser.add_argument("--compile-backend", help="torch.compile backend (default: inductor on CUDA, aot_eager on "
                                                  "the CPU: a check of the capture, not of speed)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads on the CPU (0: torch's default)")
    args = parser.parse_args(argv)
    names = {c.name for c in CASES}
    unknown = sorted(set(args.cases or ()) - names)
    if unknown:
        parser.error(f"--cases: no case named {', '.join(map(repr, unknown))}; cases: {', '.join(ORDER)}")
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device cuda: this torch ({torch.__version__}) sees no CUDA device")
    if args.compile_backend is None:
        args.compile_backend = "inductor" if args.device == "cuda" else "aot_eager"
    if args.threads:
        torch.set_num_threads(args.threads)
    by_name = {c.name: c for c in CASES}
    cases = [by_name[n] for n in ORDER if not args.cases or n in args.cases]
    if args.out.exists():
        (args.out / "rows.jsonl").unlink(missing_ok=True)
    bench = Bench(args)
    bench.run(cases)
    print(bench.report())


if __name__ == "__main__":
    main()
