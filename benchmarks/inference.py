"""CPU benchmark of the runtime (issue 9): prefill, cached decoding and a training step, reference loop against
the fused path, for dense, BTX, BAM expert KV and BAM shared KV, with transformers' MixtralForCausalLM and
JetMoeForCausalLM of the same shape as peers. One child process per case, run one after another.

    .venv/bin/python -m benchmarks.inference --out bench-out/inference            # the full table (~10 min a round)
    .venv/bin/python -m benchmarks.inference --out bench-out/smoke --size smoke   # a quick check of the script

Shape (issue 9): d_model 512, 8 layers, 8 heads (head dim 64, MHA), FFN 1408 (SwiGLU), vocab 8192, RMSNorm,
RoPE, sequential blocks, untied head, fp32 weights; mixtures have 4 experts, FFN top-1 (gates renormalized
over the top-k), soft attention routing; JetMoE is Mixture-of-Attention with 4 experts, top-4 (its FFN
experts share the count: top-4 of 4). Batch 4 x 256 tokens.

Metrics, each the median of --repeat timed runs after one warm-up run (with --rounds N, the best of N such
medians, taken in N rounds over all cases):
    prefill   one forward over the 4 x 256 prompt tokens, filling the KV cache and computing every position's
              logits (ours: static cache; transformers: its DynamicCache), no gradient
    decode    greedy one-token steps with the KV cache after a 256-token prompt, batch 1 and batch 4; the
              prefill is not timed. Ours: runtime.generation.decode_step, eager; transformers: forward with
              past_key_values
    train     forward with the loss, backward, AdamW step (ours: return_logits=False, the chunked loss head;
              transformers: labels=)
    KV bytes/token: cache bytes per token of one sequence (ours: ModelKVCache.bytes_per_token; transformers:
              measured on the cache after prefill), fp32
    GFLOP/s   tokens/s x active FLOPs per token: 2 x the matmul parameters a token runs through (every
              attention expert under soft routing, top-k FFN experts, routers, the head) plus causal attention
              scores, 4 x query heads x head dim x mean key count; training counts 3x the forward

ORT rows: the fused model exported with bam-surgery's ONNX exporter (converters/onnx_graph, KV-cache graph,
fp32, default opset) and run in onnxruntime's CPU provider with --threads intra-op threads; prefill is the
prompt through the graph with an empty past, decode feeds present back as past (converters/onnx_runtime).
"dense experts" rows export every FFN expert on every token instead of the sparse dispatch (the cost the
dispatch saves; their GFLOP/s still count the top-k FFN FLOPs). No training step.

Adding engines: write a class with the Engine methods below, register it in ENGINES,
and append Case(name, engine, kind) rows to CASES; the runner, table and targets pick them up.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

SIZES = {
    "issue9": dict(vocab_size=8192, d_model=512, n_layers=8, n_heads=8, ffn_hidden=1408, batch=4, seq=256,
                   decode_steps=32),
    "smoke": dict(vocab_size=512, d_model=64, n_layers=2, n_heads=4, ffn_hidden=96, batch=2, seq=32,
                  decode_steps=4),
}
EXPERTS, TOP_K = 4, 1
KINDS = {
    "dense": {},
    "btx": dict(ffn_experts=EXPERTS, ffn_top_k=TOP_K, gate_norm="topk_softmax"),
    "bam-expert-kv": dict(ffn_experts=EXPERTS, ffn_top_k=TOP_K, gate_norm="topk_softmax", attn_experts=EXPERTS),
    "bam-shared-kv": dict(ffn_experts=EXPERTS, ffn_top_k=TOP_K, gate_norm="topk_softmax", attn_experts=EXPERTS,
                          kv_mode="shared"),
}


@dataclass
class Case:
    name: str
    engine: str  # key of ENGINES
    kind: str  # runtime: a KINDS key; transformers: mixtral | jetmoe
    impl: str = ""  # runtime: fused | reference; onnxruntime: sparse | dense (FFN expert dispatch in the graph)


CASES = [Case(f"{kind} {impl}", "runtime", kind, impl) for kind in KINDS for impl in ("reference", "fused")]
CASES += [Case(f"{kind} ORT", "onnxruntime", kind, "sparse") for kind in KINDS]
CASES += [Case(f"{kind} ORT dense experts", "onnxruntime", kind, "dense") for kind in ("btx", "bam-expert-kv")]
CASES += [Case("Mixtral (transformers)", "transformers", "mixtral"),
          Case("JetMoE MoA top-4 (transformers)", "transformers", "jetmoe")]


@dataclass
class Result:
    case: str
    prefill_tps: float = 0.0
    decode1_tps: float = 0.0
    decode4_tps: float = 0.0
    train_tps: float = 0.0
    kv_bytes_per_token: int = 0
    flops_per_token: float = 0.0  # forward, active, at the benchmark's sequence length
    threads: int = 0
    load_before: float = 0.0
    seconds: float = 0.0
    error: str = ""
    times: dict = field(default_factory=dict)


# ---- engines ---------------------------------------------------------------------------------------
class RuntimeEngine:
    """bam-surgery's runtime Model, impl reference or fused."""

    def __init__(self, case: Case, size: dict):
        import torch

        from bam_surgery.runtime import Model, ModelConfig

        self.torch = torch
        self.cfg = ModelConfig(**{k: size[k] for k in ("vocab_size", "d_model", "n_layers", "n_heads", "ffn_hidden")},
                               max_positions=size["seq"] + size["decode_steps"], block="sequential",
                               norm="rmsnorm", activation="swiglu", **KINDS[case.kind])
        torch.manual_seed(0)
        self.model = Model(self.cfg)
        self.model.impl = case.impl

    def flops_per_token(self, seq: int) -> float:
        c = self.cfg
        D, H, G, Dh, F = c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn_hidden
        q_o, k_v = 2 * D * H * Dh, 2 * D * G * Dh
        Ea, Ef = c.attn_experts, c.ffn_experts
        if not Ea:
            attention = q_o + k_v
        elif c.kv_mode == "expert":
            attention = Ea * (q_o + k_v) + Ea * D
        else:
            attention = Ea * q_o + k_v + Ea * D
        ffn = 3 * D * F * (c.ffn_top_k if Ef else 1) + Ef * D
        params = c.n_layers * (attention + ffn) + c.vocab_size * D
        return attention_flops(2 * params, c.n_layers, H * max(Ea, 1), Dh, seq)

    def kv_bytes_per_token(self) -> int:
        from bam_surgery.runtime import ModelKVCache

        return ModelKVCache.bytes_per_token(self.cfg, self.torch.float32)

    def prefill(self, tokens, max_len: int):
        with self.torch.no_grad():
            cache = self.model.new_cache(tokens.shape[0], max_len)
            logits = self.model(tokens, input_pos=self.torch.arange(tokens.shape[1]), cache=cache).logits
        return cache, logits[:, -1].argmax(-1)

    def decode(self, state, start: int, steps: int) -> None:
        from bam_surgery.runtime.generation import decode_step

        cache, token = state
        mask = self.torch.ones(token.shape[0], cache.max_len, dtype=self.torch.long)
        with self.torch.no_grad():
            for i in range(steps):
                token = decode_step(self.model, cache, token[:, None], self.torch.tensor([start + i]), mask,
                                    0.0, 1.0, None)

    def train_step(self, tokens, optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)
        self.model(tokens[:, :-1], targets=tokens[:, 1:], return_logits=False).loss.backward()
        optimizer.step()


class TransformersEngine:
    """transformers' MixtralForCausalLM (FFN experts, top-1) or JetMoeForCausalLM (MoA, 4 experts, top-4)."""

    def __init__(self, case: Case, size: dict):
        import torch
        import transformers

        self.torch, self.kind, self.size = torch, case.kind, size
        common = dict(vocab_size=size["vocab_size"], hidden_size=size["d_model"], intermediate_size=size["ffn_hidden"],
                      num_hidden_layers=size["n_layers"], num_key_value_heads=size["n_heads"],
                      max_position_embeddings=size["seq"] + size["decode_steps"], tie_word_embeddings=False)
        torch.manual_seed(0)
        if case.kind == "mixtral":
            self.config = transformers.MixtralConfig(**common, num_attention_heads=size["n_heads"],
                                                     num_local_experts=EXPERTS, num_experts_per_tok=TOP_K)
            self.model = transformers.MixtralForCausalLM(self.config)
        else:
            self.config = transformers.JetMoeConfig(**common, kv_channels=size["d_model"] // size["n_heads"],
                                                    num_local_experts=EXPERTS, num_experts_per_tok=EXPERTS)
            self.model = transformers.JetMoeForCausalLM(self.config)
        self._kv_bytes = 0

    def flops_per_token(self, seq: int) -> float:
        s = self.size
        D, H, F, L = s["d_model"], s["n_heads"], s["ffn_hidden"], s["n_layers"]
        Dh = D // H
        if self.kind == "mixtral":  # dense MHA, top-1 of 4 SwiGLU experts, router
            layer = 4 * D * H * Dh + 3 * D * F * TOP_K + EXPERTS * D
            q_heads = H
        else:  # JetMoE: q, o per selected expert, one shared k, v; top-4 of 4 SwiGLU experts; two routers
            layer = EXPERTS * 2 * D * H * Dh + 2 * D * H * Dh + EXPERTS * 3 * D * F + 2 * EXPERTS * D
            q_heads = H * EXPERTS
        return attention_flops(2 * (L * layer + s["vocab_size"] * D), L, q_heads, Dh, seq)

    def kv_bytes_per_token(self) -> int:
        return self._kv_bytes

    def prefill(self, tokens, max_len: int):
        with self.torch.no_grad():
            out = self.model(tokens, use_cache=True)
        past = out.past_key_values
        held = sum(t.numel() * t.element_size() for layer in past.layers for t in (layer.keys, layer.values))
        self._kv_bytes = held // (tokens.shape[0] * tokens.shape[1])
        return past, out.logits[:, -1].argmax(-1)

    def decode(self, state, start: int, steps: int) -> None:
        past, token = state
        with self.torch.no_grad():
            for _ in range(steps):
                out = self.model(token[:, None], past_key_values=past, use_cache=True)
                past, token = out.past_key_values, out.logits[:, -1].argmax(-1)

    def train_step(self, tokens, optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)
        self.model(tokens, labels=tokens).loss.backward()
        optimizer.step()


class OrtEngine(RuntimeEngine):
    """The runtime model exported to ONNX with its KV cache and run in onnxruntime (CPU); no training step."""

    trains = False

    def __init__(self, case: Case, size: dict):
        import tempfile

        from bam_surgery.converters.onnx_graph import export_graph
        from bam_surgery.converters.onnx_runtime import OrtDecoder

        super().__init__(Case(case.name, "runtime", case.kind, "fused"), size)
        self.model.eval()
        self._folder = tempfile.TemporaryDirectory(prefix="bench-onnx-")
        path = Path(self._folder.name) / "model.onnx"
        export_graph(self.model, path, ffn_kernel="dense" if case.impl == "dense" else None)
        self.decoder = OrtDecoder(path, threads=self.torch.get_num_threads())

    def prefill(self, tokens, max_len: int):
        import numpy as np

        ids = tokens.numpy()
        mask = np.ones_like(ids)
        logits, past = self.decoder.forward(ids, mask)
        return past, mask, logits[:, -1].argmax(-1)

    def decode(self, state, start: int, steps: int) -> None:
        import numpy as np

        past, mask, token = state
        for _ in range(steps):
            mask = np.concatenate([mask, np.ones((mask.shape[0], 1), mask.dtype)], axis=1)
            logits, past = self.decoder.forward(token[:, None].astype(np.int64), mask, past)
            token = logits[:, -1].argmax(-1)


ENGINES: dict[str, Callable[[Case, dict], object]] = {"runtime": RuntimeEngine, "transformers": TransformersEngine,
                                                      "onnxruntime": OrtEngine}


def attention_flops(matmul_flops: float, layers: int, q_heads: int, head_dim: int, seq: int) -> float:
    """Forward FLOPs per token: the matmuls plus causal attention (QK^T and AV over (seq + 1) / 2 keys on average)."""
    return matmul_flops + layers * 4 * q_heads * head_dim * (seq + 1) / 2


# ---- one case, in a child process -----------------------------------------------------------------
def run_case(case: Case, size: dict, repeat: int, threads: int, clock: str = "wall", train: bool = True) -> Result:
    import torch

    torch.set_num_threads(threads)
    now = time.perf_counter if clock == "wall" else time.process_time
    result = Result(case.name, threads=threads)
    engine = ENGINES[case.engine](case, size)
    B, T, steps = size["batch"], size["seq"], size["decode_steps"]
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, size["vocab_size"], (B, T), generator=gen)
    result.flops_per_token = engine.flops_per_token(T)

    def timed(fn) -> float:
        fn()  # warm-up
        runs = []
        for _ in range(repeat):
            start = now()
            fn()
            runs.append(now() - start)
        return statistics.median(runs)

    prefill_s = timed(lambda: engine.prefill(tokens, T + steps))
    result.prefill_tps = B * T / prefill_s
    result.kv_bytes_per_token = engine.kv_bytes_per_token()
    for batch in (1, B):
        prompt = tokens[:batch]

        def decode():
            state = engine.prefill(prompt, T + steps)
            start = now()
            engine.decode(state, T, steps)
            return now() - start

        decode()  # warm-up
        seconds = statistics.median(decode() for _ in range(repeat))
        setattr(result, "decode1_tps" if batch == 1 else "decode4_tps", batch * steps / seconds)
    if train and getattr(engine, "trains", True):
        engine.model.train()
        optimizer = torch.optim.AdamW(engine.model.parameters(), lr=1e-4)
        result.train_tps = B * T / timed(lambda: engine.train_step(tokens, optimizer))
    result.times = {"prefill_s": prefill_s}
    return result


# ---- the parent: one process per case, the table ------------------------------------------------
def child_main(args) -> None:
    case = next(c for c in CASES if c.name == args.child)
    print(json.dumps(asdict(run_case(case, SIZES[args.size], args.repeat, args.threads, args.clock,
                                     train=not args.no_train))))


def run_all(args) -> list[Result]:
    """Every case in its own child process, round after round; per case and metric the best round counts
    (--pick best: on a shared machine the best round is the one least disturbed by other work), or the median
    round (--pick median: where each process's speed varies by itself, a lucky process does not set the
    figure that others are compared to)."""
    rounds: dict[str, list[Result]] = {}
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    for round_index in range(args.rounds):
        for case in CASES:
            if args.cases and case.name not in args.cases:
                continue
            load = os.getloadavg()[0]
            start = time.perf_counter()
            proc = subprocess.run([sys.executable, "-m", "benchmarks.inference", "--child", case.name, "--size",
                                   args.size, "--repeat", str(args.repeat), "--threads", str(args.threads),
                                   "--clock", args.clock] + (["--no-train"] if args.no_train else []),
                                  capture_output=True, text=True, env=env, cwd=Path(__file__).resolve().parents[1])
            if proc.returncode:
                result = Result(case.name, error=(proc.stderr.strip().splitlines() or ["?"])[-1])
            else:
                result = Result(**json.loads(proc.stdout.strip().splitlines()[-1]))
            result.load_before, result.seconds = load, time.perf_counter() - start
            print(f"round {round_index + 1}, {case.name}: {result.seconds:.0f} s, load {load:.1f}"
                  + (f" FAILED {result.error}" if result.error else ""), file=sys.stderr)
            rounds.setdefault(case.name, []).append(result)
    return [combine(results, args.pick) for results in rounds.values()]


METRICS = ("prefill_tps", "decode1_tps", "decode4_tps", "train_tps")


def combine(results: list[Result], pick: str = "best") -> Result:
    """One case's rounds -> one row: per metric the fastest round (pick "best") or the median round ("median");
    load: the highest seen; the rounds' own figures kept in .times["rounds"]."""
    ok = [r for r in results if not r.error]
    if not ok:
        return results[-1]
    a = ok[0]
    out = Result(a.case, threads=a.threads, kv_bytes_per_token=a.kv_bytes_per_token, flops_per_token=a.flops_per_token)
    for metric in METRICS:
        values = [getattr(r, metric) for r in ok]
        setattr(out, metric, max(values) if pick == "best" else statistics.median(values))
    out.load_before, out.seconds = max(r.load_before for r in ok), sum(r.seconds for r in ok)
    out.times = {"pick": pick, "rounds": [{m: getattr(r, m) for m in METRICS} for r in ok]}
    return out


def table(results: list[Result]) -> str:
    rows = ["| case | prefill tok/s | prefill GFLOP/s | train tok/s | train GFLOP/s | decode b1 tok/s | "
            "decode b4 tok/s | KV bytes/token | GFLOP/token | load |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        if r.error:
            rows.append(f"| {r.case} | failed: {r.error} |")
            continue
        g = r.flops_per_token / 1e9
        train = f"{r.train_tps:,.0f} | {3 * r.train_tps * g:.1f}" if r.train_tps else "- | -"
        rows.append(f"| {r.case} | {r.prefill_tps:,.0f} | {r.prefill_tps * g:.1f} | {train} | "
                    f"{r.decode1_tps:.1f} | {r.decode4_tps:.1f} | "
                    f"{r.kv_bytes_per_token:,} | {g:.3g} | {r.load_before:.1f} |")
    return "\n".join(rows)


def targets(results: list[Result]) -> str:
    """Issue 9's CPU targets, checked on this run."""
    by = {r.case: r for r in results if not r.error}
    lines = []

    def eff(r: Result, metric: str) -> float:
        return getattr(r, metric) * r.flops_per_token

    dense = by.get("dense fused")
    for kind in ("btx", "bam-expert-kv", "bam-shared-kv"):
        r = by.get(f"{kind} fused")
        if dense and r:
            for metric in ("prefill_tps", "train_tps") if dense.train_tps and r.train_tps else ("prefill_tps",):
                ratio = eff(r, metric) / eff(dense, metric)
                lines.append(f"- {kind} fused {metric[:-4]} FLOP efficiency / dense fused: {ratio:.2f} "
                             f"(target >= 0.90: {'met' if ratio >= 0.9 else 'NOT met'})")
    bam, shared, jet = by.get("bam-expert-kv fused"), by.get("bam-shared-kv fused"), by.get(
        "JetMoE MoA top-4 (transformers)")
    if dense and bam:
        ratio = bam.decode1_tps / dense.decode1_tps
        lines.append(f"- BAM expert-KV decode b1 / dense: {ratio:.2f} (target >= 0.5: "
                     f"{'met' if ratio >= 0.5 else 'NOT met'})")
    if bam and jet:
        lines.append(f"- BAM expert-KV decode b1 {bam.decode1_tps:.1f} vs JetMoE {jet.decode1_tps:.1f} tokens/s "
                     f"(target: faster: {'met' if bam.decode1_tps > jet.decode1_tps else 'NOT met'})")
    if bam and shared:
        ok = shared.decode1_tps > bam.decode1_tps and shared.decode4_tps > bam.decode4_tps
        lines.append(f"- shared-KV decode {shared.decode1_tps:.1f} / {shared.decode4_tps:.1f} vs expert-KV "
                     f"{bam.decode1_tps:.1f} / {bam.decode4_tps:.1f} tokens/s (b1 / b4; target: faster: "
                     f"{'met' if ok else 'NOT met'}); cache bytes/token {shared.kv_bytes_per_token:,} vs "
                     f"{bam.kv_bytes_per_token:,} ({bam.kv_bytes_per_token / shared.kv_bytes_per_token:.0f}x)")
    for kind in KINDS:
        fused, ref = by.get(f"{kind} fused"), by.get(f"{kind} reference")
        if fused and ref:
            train = f"{fused.train_tps / ref.train_tps:.2f}x" if ref.train_tps else "-"
            lines.append(f"- {kind}: fused / reference: prefill {fused.prefill_tps / ref.prefill_tps:.2f}x, "
                         f"train {train}, decode b1 "
                         f"{fused.decode1_tps / ref.decode1_tps:.2f}x")
    for kind in KINDS:
        ort, eager = by.get(f"{kind} ORT"), by.get(f"{kind} fused")
        if ort and eager:
            ok = all(getattr(ort, m) >= getattr(eager, m) for m in ("prefill_tps", "decode1_tps", "decode4_tps"))
            lines.append(f"- {kind}: ORT / eager fused: prefill {ort.prefill_tps / eager.prefill_tps:.2f}x, decode b1 "
                         f"{ort.decode1_tps / eager.decode1_tps:.2f}x, b4 {ort.decode4_tps / eager.decode4_tps:.2f}x "
                         f"(target >= 1: {'met' if ok else 'NOT met'})")
        dense = by.get(f"{kind} ORT dense experts")
        if ort and dense:
            lines.append(f"- {kind}: ORT sparse FFN dispatch / every expert on every token: prefill "
                         f"{ort.prefill_tps / dense.prefill_tps:.2f}x, decode b1 "
                         f"{ort.decode1_tps / dense.decode1_tps:.2f}x, b4 {ort.decode4_tps / dense.decode4_tps:.2f}x")
    return "\n".join(lines)


def machine() -> str:
    import torch

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).resolve().parents[1]).stdout.strip()
    except OSError:
        commit = "?"
    return (f"{os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}), Python "
            f"{platform.python_version()}, torch {torch.__version__}, commit {commit}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="directory for results.json and results.md")
    parser.add_argument("--size", choices=list(SIZES), default="issue9", help="model and batch size")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per metric (median reported)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads per case")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every case this many times, round after round; report each metric's best round")
    parser.add_argument("--pick", choices=("best", "median"), default="best",
                        help="with --rounds: report each metric's best round or its median round")
    parser.add_argument("--cases", nargs="*", help="run only these case names")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="wall: elapsed time; cpu: the process's CPU time, which time spent descheduled by "
                             "other work does not inflate (meaningful with --threads 1 only)")
    parser.add_argument("--no-train", action="store_true", help="skip the training step (prefill and decode only)")
    parser.add_argument("--child", metavar="CASE", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.clock == "cpu" and args.threads != 1:
        parser.error("--clock cpu needs --threads 1 (CPU time adds up over threads)")
    if args.child:
        return child_main(args)
    results = run_all(args)
    setting = (f"{args.threads} thread(s), {args.clock} clock, {args.rounds} round(s) of --repeat {args.repeat}"
               + (f", {args.pick} round per metric" if args.rounds > 1 else ""))
    text = f"{machine()}\n{setting}\n\n{table(results)}\n\n{targets(results)}\n"
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps([asdict(r) for r in results], indent=2) + "\n")
        (args.out / "results.md").write_text(text)


if __name__ == "__main__":
    main()
