"""Summarize runs of one pipeline with several seeds: mean and spread per model, raw numbers, and the
paper's claims checked seed by seed (docs/replication.md is written from its output).

    for s in 0 1 2; do bam-surgery pipeline tiny --seed $s --out runs/tiny-s$s; done
    .venv/bin/python -m benchmarks.replication runs/tiny-s0 runs/tiny-s1 runs/tiny-s2 > replication-tables.md

Each argument is a pipeline folder (its report.json). Spread: the sample standard deviation over seeds;
claims compare two models seed by seed (paired: the same seed, data order and router init), so the
difference's mean and standard deviation say whether a gap is larger than the seed-to-seed noise.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

# (row label, model id in report.json)
ROWS = [("dense seed", "seed"), ("code specialist", "branch-code"), ("law specialist", "branch-law"),
        ("math specialist", "branch-math"), ("BTX (DM = CM)", "dm-btx"), ("BAM expert KV, DM", "dm-bam"),
        ("BAM expert KV, CM", "cm-bam"), ("BAM shared KV, DM", "dm-bam-shared-kv"),
        ("BAM shared KV, CM", "cm-bam-shared-kv"), ("BAM top-1 attention (DM = CM)", "dm-bam-top1"),
        ("BAM top-2 attention, DM", "dm-bam-top2"), ("BAM top-2 attention, CM", "cm-bam-top2")]
# (claim, [(better, worse), ...] compared on the average perplexity unless a domain is named)
CLAIMS = [
    ("BAM beats BTX, data-matched", [("dm-bam", "dm-btx")]),
    ("BAM beats BTX, compute-matched", [("cm-bam", "dm-btx")]),
    ("BAM shared KV beats BTX, data-matched", [("dm-bam-shared-kv", "dm-btx")]),
    ("BAM shared KV beats BTX, compute-matched", [("cm-bam-shared-kv", "dm-btx")]),
    ("expert KV beats shared KV, data-matched", [("dm-bam", "dm-bam-shared-kv")]),
    ("expert KV beats shared KV, compute-matched", [("cm-bam", "cm-bam-shared-kv")]),
    ("soft beats top-1 attention routing, data-matched", [("dm-bam", "dm-bam-top1")]),
    ("soft beats top-2 attention routing, data-matched", [("dm-bam", "dm-bam-top2")]),
    ("soft beats top-1 attention routing, compute-matched", [("cm-bam", "dm-bam-top1")]),
    ("soft beats top-2 attention routing, compute-matched", [("cm-bam", "cm-bam-top2")]),
]


def load(folder: Path) -> dict:
    rep = json.loads((folder / "report.json").read_text())
    return {"seed": rep["seed"], "domains": rep["domains"], "models": {m["id"]: m for m in rep["models"]},
            "stages": rep["stages"]}


def value(rep: dict, model: str, col: str) -> float:
    m = rep["models"][model]
    return m["average_perplexity"] if col == "average" else m["perplexity"][col]


def mean_sd(xs: list[float]) -> str:
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{statistics.fmean(xs):.3f} ± {sd:.3f}"


def tables(reps: list[dict]) -> str:
    cols = reps[0]["domains"] + ["average"]
    out = [f"Perplexity on held-out text, mean ± sample standard deviation over seeds "
           f"{', '.join(str(r['seed']) for r in reps)}:", "",
           "| model | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
    for label, mid in ROWS:
        if all(mid in r["models"] for r in reps):
            out.append(f"| {label} | " + " | ".join(mean_sd([value(r, mid, c) for r in reps]) for c in cols) + " |")
    out += ["", "Raw numbers (perplexity per seed; columns " + ", ".join(cols) + "):", "",
            "| model | " + " | ".join(f"seed {r['seed']}" for r in reps) + " |", "|---|" + "---|" * len(reps)]
    for label, mid in ROWS:
        if all(mid in r["models"] for r in reps):
            out.append(f"| {label} | " + " | ".join(" / ".join(f"{value(r, mid, c):.3f}" for c in cols)
                                                    for r in reps) + " |")
    return "\n".join(out)


def claims(reps: list[dict]) -> str:
    doms = [d for d in reps[0]["domains"] if d != "general"]
    out = ["Claims, seed by seed (difference = worse - better in average perplexity; > 0: the claim holds):", "",
           "| claim | holds in | difference per seed | mean ± sd |", "|---|---|---|---:|"]
    for text, pairs in CLAIMS:
        for better, worse in pairs:
            if not all(better in r["models"] and worse in r["models"] for r in reps):
                continue
            diffs = [value(r, worse, "average") - value(r, better, "average") for r in reps]
            held = sum(d > 0 for d in diffs)
            out.append(f"| {text} | {held}/{len(reps)} | {', '.join(f'{d:+.3f}' for d in diffs)} | "
                       f"{mean_sd(diffs)} |")
    out += ["", "Specialists on their own domain (own-domain perplexity; the best other dense model, the best "
            "mixture):", "", "| domain | specialist | best other dense | best trained mixture | best among dense "
            "| best among all |", "|---|---|---|---|---|---|"]
    for d in doms:
        spec = [value(r, f"branch-{d}", d) for r in reps]
        dense = [min(value(r, m, d) for m in r["models"] if r["models"][m]["kind"] in ("seed", "specialist")
                     and m != f"branch-{d}") for r in reps]
        mixes = [min(value(r, m, d) for m in r["models"] if r["models"][m]["kind"] == "trained") for r in reps]
        among_dense = sum(s < o for s, o in zip(spec, dense))
        among_all = sum(s < min(o, x) for s, o, x in zip(spec, dense, mixes))
        out.append(f"| {d} | {mean_sd(spec)} | {mean_sd(dense)} | {mean_sd(mixes)} | {among_dense}/{len(reps)} | "
                   f"{among_all}/{len(reps)} |")
    return "\n".join(out)


def timing(reps: list[dict]) -> str:
    out = ["Time per stage (CPU s / wall s; wall time is inflated by other jobs on the machine):", "",
           "| stage | " + " | ".join(f"seed {r['seed']}" for r in reps) + " |", "|---|" + "---:|" * len(reps)]
    stages = list(reps[0]["stages"])
    for s in stages:
        out.append(f"| {s} | " + " | ".join(f"{r['stages'][s]['cpu_s']:,.0f} / {r['stages'][s]['wall_s']:,.0f}"
                                            for r in reps) + " |")
    tot = [(sum(v["cpu_s"] for v in r["stages"].values()), sum(v["wall_s"] for v in r["stages"].values()))
           for r in reps]
    out.append("| total | " + " | ".join(f"{c:,.0f} / {w:,.0f}" for c, w in tot) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folders", nargs="+", type=Path, help="pipeline folders (one per seed)")
    args = ap.parse_args(argv)
    reps = [load(f) for f in args.folders]
    if not math.isfinite(sum(value(r, "seed", "average") for r in reps)):
        raise SystemExit("a report holds non-finite perplexities")
    print("\n\n".join([tables(reps), claims(reps), timing(reps)]))


if __name__ == "__main__":
    main()
