"""Router kinds compared: BAM mixtures that differ only in the router, trained alike on the repository's
domain corpus, then evaluated (per-domain perplexity) and measured (usage entropy, Gini, stability).

    OMP_NUM_THREADS=1 nice -n 5 .venv/bin/python -m benchmarks.router_compare \\
        --models /tmp/pl/runs/tiny-s1/models --work-dir bench-router-compare --jobs 3

Inputs: a seed and three specialists (MODELS/{seed,code,law,math}), e.g. those of `bam-surgery pipeline
tiny --seed 1` (D 128, 4 layers, byte-level tokens). For every variant:

1. `bam-surgery merge --seed general=MODELS/seed --experts code=...,law=...,math=... --recipe bam
   --router KIND [--router-init INIT --calibration CORPUS] --router-seed SEED` (the same --router-seed for
   every variant; warm starts calibrate on the train splits of data/domains);
2. `bam-surgery train --init MERGE` with the tiny pipeline's mixture-training knobs (25% each domain plus
   25% general, seq_len 128, micro_batch 16, batch_tokens 2048, lr 3e-3, warm-up 10, cosine to 0.1x,
   weight decay 0.1, --steps, checkpoints every steps/2, the same --seed for every variant);
3. `bam-surgery eval` of the merge (before training) and of the last checkpoint, on the first --eval-tokens
   held-out tokens of each domain;
4. `bam-surgery routing-stats` of the last checkpoint with --compare against the mid-run checkpoint (how
   much top-1 routing still moves in the second half of training) and against the merge (how far routing
   moved from its init: for a warm start, how much of it training kept).

Every command is logged (WORK/commands.sh, WORK/VARIANT/logs/); a step whose output exists is skipped, so
an interrupted run continues where it stopped. Results: WORK/results.json (every number the commands
printed, per variant) and WORK/results.md (the tables of docs/routers.md, "Comparing routers").
Variants run --jobs at a time, each command with OMP_NUM_THREADS=1.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOMAINS = ("code", "law", "math")
EVAL_ORDER = ("general", *DOMAINS)

# name -> merge options beyond --recipe bam
VARIANTS: dict[str, list[str]] = {
    "linear": ["--router", "linear"],
    "mlp": ["--router", "mlp"],
    "attention": ["--router", "attention"],
    "expert_embedding": ["--router", "expert_embedding"],
    "expert_embedding-profile": ["--router", "expert_embedding", "--router-init", "profile"],
    "expert_embedding-domain-mean": ["--router", "expert_embedding", "--router-init", "domain-mean"],
}
WARM_STARTS = {"expert_embedding-profile", "expert_embedding-domain-mean"}

# The tiny pipeline's mixture training (recipes/pipelines/tiny.yaml: knobs, stages.train).
TRAIN_KNOBS = ["--tokenizer", "bytes", "--seq-len", "128", "--micro-batch", "16", "--batch-tokens", "2048",
               "--lr", "3e-3", "--warmup-steps", "10", "--min-lr-ratio", "0.1", "--weight-decay", "0.1",
               "--eval-every", "-1", "--no-plot", "--no-progress"]

_log_lock = threading.Lock()


def corpus(weighted: bool) -> str:
    """The domain SPEC: with weights, the training mixture (25% each domain + 25% general)."""
    parts = []
    for d in (*DOMAINS, "general"):
        parts.append(f"{d}={ROOT / 'data' / 'domains' / d}" + (":0.25" if weighted else ""))
    return ",".join(parts)


def eval_spec() -> str:
    return ",".join(f"{d}={ROOT / 'data' / 'domains' / d}" for d in EVAL_ORDER)


class Runner:
    def __init__(self, work: Path):
        self.work = work
        self.exe = str(Path(sys.executable).parent / "bam-surgery")
        self.commands = work / "commands.sh"

    def run(self, variant: str, tag: str, args: list[str], stdout: Path | None = None) -> float:
        """Run one bam-surgery command (logged), its stdout into `stdout` (written via a temp path)."""
        cmd = [self.exe, *args]
        line = "OMP_NUM_THREADS=1 " + shlex.join(cmd) + (f" > {shlex.quote(str(stdout))}" if stdout else "")
        with _log_lock:
            with self.commands.open("a") as f:
                f.write(line + "\n")
        logs = self.work / variant / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, OMP_NUM_THREADS="1")
        t0 = time.perf_counter()
        with open(logs / f"{tag}.err", "w") as err:
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, env=env, text=True)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            raise RuntimeError(f"{variant}: {tag} exited {proc.returncode} (see {logs / (tag + '.err')}): {line}")
        if stdout is not None:
            tmp = stdout.with_suffix(stdout.suffix + ".tmp")
            tmp.write_text(proc.stdout)
            tmp.rename(stdout)
        else:
            (logs / f"{tag}.out").write_text(proc.stdout)
        return wall


def step_dir(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step-{step:08d}"


def run_variant(r: Runner, name: str, models: Path, steps: int, seed: int, router_seed: int,
                eval_tokens: int) -> dict:
    vdir = r.work / name
    vdir.mkdir(parents=True, exist_ok=True)
    walls: dict[str, float] = {}
    merged = vdir / "merge.safetensors"
    if not merged.exists():
        args = ["merge", "--seed", f"general={models / 'seed'}",
                "--experts", ",".join(f"{d}={models / d}" for d in DOMAINS),
                "--recipe", "bam", *VARIANTS[name], "--router-seed", str(router_seed), "--out", str(merged)]
        if name in WARM_STARTS:
            args += ["--calibration", corpus(weighted=False)]
        walls["merge"] = r.run(name, "merge", args)
    run = vdir / "run"
    mid, last = steps // 2, steps
    if not step_dir(run, last).exists():
        resume = ["--resume"] if (run / "run.json").exists() else []
        walls["train"] = r.run(name, "train", [
            "train", "--init", str(merged), "--data", corpus(weighted=True), *TRAIN_KNOBS,
            "--steps", str(steps), "--save-every", str(mid), "--keep-last", "3", "--seed", str(seed),
            "--out", str(run), *resume])
    ev = ["--data", eval_spec(), "--tokenizer", "bytes", "--seq-len", "128", "--batch-size", "16",
          "--max-tokens", str(eval_tokens), "--json"]
    outputs = {
        "eval-merge": (["eval", str(merged), *ev]),
        "eval-final": (["eval", str(step_dir(run, last)), *ev]),
        "stats-vs-mid": (["routing-stats", str(step_dir(run, last)), "--compare", str(step_dir(run, mid)), *ev]),
        "stats-vs-merge": (["routing-stats", str(step_dir(run, last)), "--compare", str(merged), *ev]),
    }
    result: dict = {"variant": name, "merge_options": VARIANTS[name]}
    for tag, args in outputs.items():
        path = vdir / f"{tag}.json"
        if not path.exists():
            walls[tag] = r.run(name, tag, args, stdout=path)
        result[tag] = json.loads(path.read_text())
    metrics = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if l.strip()]
    train_rows = [m for m in metrics if m.get("kind") == "train"]
    result["train"] = {
        "steps": len(train_rows),
        "last_loss": train_rows[-1]["loss"] if train_rows else None,
        "last_nll": train_rows[-1].get("nll") if train_rows else None,
        "mean_step_s": sum(m["step_s"] for m in train_rows) / max(1, len(train_rows)),
    }
    previous = vdir / "result.json"  # a rerun keeps the wall times of the steps it skipped
    if previous.exists():
        walls = {**json.loads(previous.read_text()).get("wall_s", {}), **walls}
    result["wall_s"] = walls
    (vdir / "result.json").write_text(json.dumps(result, indent=1))
    return result


def summarize(res: dict) -> dict:
    """The numbers of the tables: per-domain perplexity (before/after), FFN and attention routing means."""
    final, before = res["eval-final"]["domains"], res["eval-merge"]["domains"]
    mid, init = res["stats-vs-mid"]["domains"], res["stats-vs-merge"]["domains"]
    out = {"ppl": {d: final[d]["perplexity"] for d in EVAL_ORDER},
           "ppl_merge": {d: before[d]["perplexity"] for d in EVAL_ORDER}}
    out["ppl"]["avg"] = sum(out["ppl"][d] for d in EVAL_ORDER) / len(EVAL_ORDER)
    out["ppl_merge"]["avg"] = sum(out["ppl_merge"][d] for d in EVAL_ORDER) / len(EVAL_ORDER)
    for group in ("ffn", "attn"):
        g = {}
        for d in EVAL_ORDER:
            s = final[d]["routing"][group]
            g[d] = {"entropy": s["entropy_bits"], "entropy_max": s["entropy_max_bits"], "gini": s["gini"],
                    "token_entropy": s.get("token_entropy_bits"),
                    "share": s.get("share", s.get("mean_gate")),
                    "changed_vs_mid": mid[d]["routing"][group]["changed"],
                    "changed_vs_merge": init[d]["routing"][group]["changed"]}
        out[group] = g
    return out


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def markdown(results: dict[str, dict], steps: int, eval_tokens: int) -> str:
    s = {name: summarize(res) for name, res in results.items()}
    lines = [f"Perplexity on the first {eval_tokens} held-out tokens of each domain after {steps} steps "
             "(in brackets: the merge before training).", "",
             "| router | " + " | ".join(EVAL_ORDER) + " | avg |", "|---|" + "---|" * (len(EVAL_ORDER) + 1)]
    for name, v in s.items():
        cells = [f"{v['ppl'][d]:.3f} ({v['ppl_merge'][d]:.2f})" for d in (*EVAL_ORDER, "avg")]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    for group, title in (("ffn", "FFN routers (top-1)"), ("attn", "Attention routers (soft)")):
        lines += ["", f"{title}: means over the 4 layers, then over the 4 domains (per domain in results.json). "
                  "Entropy of the usage in bits (max log2 4 = 2), Gini of the usage, token entropy (bits), "
                  "top-1 changed vs the step-" f"{steps // 2} checkpoint and vs the untrained merge.", "",
                  "| router | usage entropy | Gini | token entropy | changed vs mid | changed vs merge | "
                  "usage per domain (experts general = seed, code, law, math) |",
                  "|---|---|---|---|---|---|---|"]
        for name, v in s.items():
            g = v[group]
            ent = _mean([g[d]["entropy"] for d in EVAL_ORDER])
            gini = _mean([g[d]["gini"] for d in EVAL_ORDER])
            tok = _mean([g[d]["token_entropy"] for d in EVAL_ORDER])
            cm = _mean([g[d]["changed_vs_mid"] for d in EVAL_ORDER])
            ci = _mean([g[d]["changed_vs_merge"] for d in EVAL_ORDER])
            usage = "; ".join(f"{d}: " + " ".join(f"{u:.2f}" for u in g[d]["share"]) for d in EVAL_ORDER)
            lines.append(f"| {name} | {ent:.3f} | {gini:.3f} | {tok:.3f} | {cm:.3f} | {ci:.3f} | {usage} |")
    layers = sorted({int(k.split(".")[1]) for res in results.values()
                     for k in res["stats-vs-mid"]["domains"]["general"]["routers"]})
    lines += ["", "FFN routers per layer (means over the 4 domains): Gini / top-1 changed vs the step-"
              f"{steps // 2} checkpoint / largest expert share.", "",
              "| router | " + " | ".join(f"layer {i}" for i in layers) + " |", "|---|" + "---|" * len(layers)]
    for name, res in results.items():
        doms = res["stats-vs-mid"]["domains"]
        cells = []
        for i in layers:
            st = [doms[d]["routers"][f"layers.{i}.ffn_router"] for d in EVAL_ORDER]
            cells.append(f"{_mean([x['gini'] for x in st]):.2f} / {_mean([x['changed'] for x in st]):.2f} / "
                         f"{_mean([max(x['usage']) for x in st]):.2f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "| router | final train loss | mean s/step | train wall s |", "|---|---|---|---|"]
    for name, res in results.items():
        t = res["train"]
        wall = res["wall_s"].get("train")
        lines.append(f"| {name} | {t['last_loss']:.4f} | {t['mean_step_s']:.3f} | "
                     f"{'%.0f' % wall if wall is not None else '-'} |")
    return "\n".join(lines) + "\n"


def _mean_sd(xs: list[float]) -> str:
    if len(xs) < 2:
        return f"{xs[0]:.3f}"
    m = _mean(xs)
    sd = (sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) ** 0.5
    return f"{m:.3f} ± {sd:.3f}"


def combine(work_dirs: list[Path]) -> str:
    """Runs of several seeds (one WORK dir each): mean ± sample sd over seeds, then the paired differences
    of every variant's average perplexity against the first variant (the same seed's run)."""
    summaries = []
    for w in work_dirs:
        meta = json.loads((w / "results.json").read_text())["meta"]
        summaries.append((meta["seed"], meta["router_seed"], meta["summary"]))
    names = [n for n in summaries[0][2] if all(n in s for _, _, s in summaries)]
    seeds = ", ".join(f"{s}/{r}" for s, r, _ in summaries)
    lines = [f"Over {len(summaries)} runs (train --seed / merge --router-seed: {seeds}): mean ± sample sd.", "",
             "| router | " + " | ".join(EVAL_ORDER) + " | avg | FFN entropy | FFN Gini | FFN changed vs mid "
             "| attn entropy | avg ppl per run |", "|---|" + "---|" * (len(EVAL_ORDER) + 6)]

    def ffn(s: dict, group: str, key: str) -> float:
        return _mean([s[group][d][key] for d in EVAL_ORDER])

    for n in names:
        per = [s[n] for _, _, s in summaries]
        cells = [_mean_sd([p["ppl"][d] for p in per]) for d in (*EVAL_ORDER, "avg")]
        cells += [_mean_sd([ffn(p, "ffn", "entropy") for p in per]), _mean_sd([ffn(p, "ffn", "gini") for p in per]),
                  _mean_sd([ffn(p, "ffn", "changed_vs_mid") for p in per]),
                  _mean_sd([ffn(p, "attn", "entropy") for p in per]),
                  " / ".join(f"{p['ppl']['avg']:.3f}" for p in per)]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    base = names[0]
    lines += ["", f"Paired differences of the average perplexity, variant minus {base} (same seed; < 0: better "
              f"than {base}):", "", "| router | per run | mean |", "|---|---|---|"]
    for n in names[1:]:
        diffs = [s[n]["ppl"]["avg"] - s[base]["ppl"]["avg"] for _, _, s in summaries]
        lines.append(f"| {n} | " + " / ".join(f"{d:+.3f}" for d in diffs) + f" | {_mean(diffs):+.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--combine", type=Path, nargs="+", metavar="WORK",
                   help="only summarize finished runs of several seeds (their --work-dir folders) and exit")
    p.add_argument("--models", type=Path,
                   help="folder holding the dense inputs seed, code, law, math (canonical checkpoints)")
    p.add_argument("--work-dir", type=Path, default=Path("bench-router-compare"),
                   help="merges, runs, logs, results.json and results.md")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated, from: {', '.join(VARIANTS)}")
    p.add_argument("--steps", type=int, default=200, help="training steps of every mixture")
    p.add_argument("--seed", type=int, default=1, help="train --seed of every mixture (init order, data order)")
    p.add_argument("--router-seed", type=int, default=1, help="merge --router-seed of every mixture")
    p.add_argument("--eval-tokens", type=int, default=16384, help="held-out tokens per domain evaluated")
    p.add_argument("--jobs", type=int, default=1, help="variants run at the same time")
    a = p.parse_args(argv)
    if a.combine:
        print(combine(a.combine), end="")
        return
    if a.models is None:
        p.error("--models is required (unless --combine)")
    names = [v for v in a.variants.split(",") if v]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variant(s) {', '.join(unknown)}; known: {', '.join(VARIANTS)}")
    if a.steps < 2:
        p.error("--steps must be at least 2 (stability compares against step --steps/2)")
    missing = [str(a.models / m) for m in ("seed", *DOMAINS) if not (a.models / m).exists()]
    if missing:
        p.error(f"--models: missing {', '.join(missing)}")
    a.work_dir.mkdir(parents=True, exist_ok=True)
    r = Runner(a.work_dir.resolve())
    models = a.models.resolve()
    with ThreadPoolExecutor(max_workers=max(1, a.jobs)) as pool:
        futures = {n: pool.submit(run_variant, r, n, models, a.steps, a.seed, a.router_seed, a.eval_tokens)
                   for n in names}
        results = {}
        for n in names:
            try:
                results[n] = futures[n].result()
                print(f"{n}: done", flush=True)
            except RuntimeError as e:
                print(f"{n}: FAILED: {e}", file=sys.stderr, flush=True)
    if not results:
        sys.exit(1)
    meta = {"command": shlex.join([sys.executable, "-m", "benchmarks.router_compare", *(argv or sys.argv[1:])]),
            "models": str(models), "steps": a.steps, "seed": a.seed, "router_seed": a.router_seed,
            "eval_tokens": a.eval_tokens, "train_knobs": TRAIN_KNOBS,
            "summary": {n: summarize(res) for n, res in results.items()}}
    (a.work_dir / "results.json").write_text(json.dumps({"meta": meta, "variants": results}, indent=1))
    md = markdown(results, a.steps, a.eval_tokens)
    (a.work_dir / "results.md").write_text(md)
    print(md)
    if len(results) < len(names):
        sys.exit(1)


if __name__ == "__main__":
    main()
