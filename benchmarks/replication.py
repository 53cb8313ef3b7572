"""Replications of one pipeline over several seeds: the paper's claims checked seed by seed, with a verdict.

    for s in 0 1 2; do bam-surgery pipeline tiny --seed $s --out runs/tiny-s$s; done
    python -m benchmarks.replication summarize runs/tiny-s0 runs/tiny-s1 runs/tiny-s2 \\
        --out benchmarks/results/replication-tiny.json       # the numbers of each report that the tables use
    python -m benchmarks.replication render benchmarks/results/replication-tiny.json     # the markdown tables
    python -m benchmarks.replication write-doc docs/replication.md benchmarks/results/replication-*.json

`summarize` keeps, from each seed's report.json, the perplexities, the training runs' steps, tokens and FLOPs,
the stages' times and the provenance (commit, machine). `render` prints the tables from a summary; `write-doc`
puts them between the doc's markers `<!-- replication:NAME begin -->` and `<!-- replication:NAME end -->`
(tests/project/test_replication_doc.py checks that the doc holds exactly what `render` prints).

The verdict rule (stated in the doc before any table): a claim "A beats B" is a paired comparison over seeds
(each seed: the same seed model init, data order and router init for every model), d_i = B's average
perplexity minus A's in seed i (d > 0: A is better). With n seeds, mean m and sample standard deviation s,
t = m / (s / sqrt(n)) is the paired t statistic; the claim **holds** when t > t_crit, **does not hold** when
t < -t_crit (the opposite is significant), and is **within noise** otherwise; t_crit is the one-sided 95%
quantile of Student's t with n - 1 degrees of freedom (2.920 for three seeds). With s = 0 the sign of m
decides. One seed alone never decides: every claim is "within noise".
"""
from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from pathlib import Path
from typing import Any

# one-sided 95% quantiles of Student's t, degrees of freedom 1..12
T_CRIT = [6.314, 2.920, 2.353, 2.132, 2.015, 1.943, 1.895, 1.860, 1.833, 1.812, 1.796, 1.782]
PAPER_SMALL_SEQ = 2048


# ---- summarize ---------------------------------------------------------------------------------------
def _summary_of(folder: Path) -> dict[str, Any]:
    rep = json.loads((folder / "report.json").read_text(encoding="utf-8"))
    model = rep["resolved"]["stages"]["seed"].get("model") or {}
    models = []
    for m in rep["models"]:
        if m["kind"] == "untrained":
            continue
        t = m["training"]
        models.append({"id": m["id"], "label": m["label"], "kind": m["kind"], "mixture": m["mixture"],
                       "settings": m["settings"], "perplexity": m["perplexity"],
                       "average_perplexity": m["average_perplexity"],
                       "training": None if t is None else {k: t[k] for k in ("steps", "tokens", "flops_per_token",
                                                                              "flops")}})
    dense_fpt = next((m["training"]["flops_per_token"] for m in rep["models"] if m["id"] == "seed" and m["training"]),
                     None)
    stages = {s: {"wall_s": v["wall_s"], "cpu_s": v["cpu_s"], "commits": v.get("commits", [])}
              for s, v in rep["stages"].items()}
    return {"seed": rep["seed"], "domains": rep["domains"], "tokenizer": Path(rep["tokenizer"]).name,
            "models": models, "stages": stages, "provenance": rep.get("provenance", {}),
            "shape": {"vocab_size": model.get("vocab_size"), "d_model": model.get("d_model"),
                      "seq_len": rep["seq_len"], "dense_flops_per_token": dense_fpt,
                      "flops_per_token": rep["compute"]["flops_per_token"],
                      **({"throughput": rep["compute"]["throughput"], "steps": rep["compute"]["steps"],
                          "reference": rep["compute"]["reference"]} if rep["compute"].get("throughput") else {})}}


def summarize(folders: list[Path], note: str | None = None) -> dict[str, Any]:
    reps = [json.loads((f / "report.json").read_text(encoding="utf-8")) for f in folders]
    names = {r["pipeline"] for r in reps}
    if len(names) != 1:
        raise SystemExit(f"the folders hold runs of different pipelines: {', '.join(sorted(names))}")
    seeds = [r["seed"] for r in reps]
    if len(set(seeds)) != len(seeds):
        raise SystemExit(f"two folders hold the same seed: {seeds}")
    runs = sorted((_summary_of(f) for f in folders), key=lambda r: r["seed"])
    return {"pipeline": names.pop(), "runs": runs, **({"note": note} if note else {})}


# ---- claims --------------------------------------------------------------------------------------------
def verdict(diffs: list[float]) -> tuple[str, float | None]:
    """(holds | does not hold | within noise, t) for paired differences (> 0 favours the claim)."""
    n = len(diffs)
    if n < 2:
        return "within noise", None
    m, s = statistics.fmean(diffs), statistics.stdev(diffs)
    crit = T_CRIT[min(n - 1, len(T_CRIT)) - 1]
    if s == 0:
        return ("holds" if m > 0 else "does not hold" if m < 0 else "within noise"), None
    t = m / (s / math.sqrt(n))
    return ("holds" if t > crit else "does not hold" if t < -crit else "within noise"), t


def _models(run: dict) -> dict[str, dict]:
    return {m["id"]: m for m in run["models"]}


def _avg(run: dict, mid: str, col: str = "average") -> float:
    m = _models(run)[mid]
    return m["average_perplexity"] if col == "average" else m["perplexity"][col]


def _cm(run: dict, name: str, setting: str = "cm") -> str:
    """The compute-matched (or time-matched: setting tm) run of a mixture (its data-matched run where the two are
    one)."""
    ids = _models(run)
    return f"{setting}-{name}" if f"{setting}-{name}" in ids else f"dm-{name}"


def _dense(run: dict, setting: str) -> str | None:
    ids = _models(run)
    if setting != "dm" and f"dense-{setting}" in ids:
        return f"dense-{setting}"
    return "dense-dm" if "dense-dm" in ids else None


def _has(run: dict, setting: str) -> bool:
    """Did the run train in `setting` (data-matched, compute-matched, time-matched)?"""
    return any(setting in (m["settings"] or []) for m in run["models"])


def _timed(run: dict) -> bool:
    return _has(run, "time-matched")


def claims(runs: list[dict]) -> list[tuple[str, str, str, list[float]]]:
    """(claim, better model id, worse model id, d per seed) of every claim the runs can answer; compared on
    the average perplexity (specialists: on their own domain)."""
    first = runs[0]
    ids = _models(first)
    mixes = [m["mixture"] for m in first["models"] if m["kind"] == "trained" and m["id"].startswith("dm-")]
    out: list[tuple[str, str, str, list[float]]] = []

    def add(text: str, better: str, worse: str, col: str = "average") -> None:
        if all(better in _models(r) and worse in _models(r) for r in runs):
            out.append((text, better, worse, [_avg(r, worse, col) - _avg(r, better, col) for r in runs]))

    for d in first["domains"]:
        spec = f"branch-{d}"
        if spec not in ids:
            continue
        others = [m["id"] for m in first["models"] if m["kind"] in ("seed", "specialist") and m["id"] != spec]
        mixed = [m["id"] for m in first["models"] if m["kind"] in ("trained", "dense")]
        for text, pool in ((f"{d} specialist best on {d} among dense models", others),
                           (f"{d} specialist best on {d} among all models", others + mixed)):
            if pool:
                out.append((text, spec, "best other", [min(_avg(r, o, d) for o in pool) - _avg(r, spec, d)
                                                       for r in runs]))
    add("BAM beats BTX, DM", "dm-bam", "dm-btx")
    add("BAM beats BTX, CM", _cm(first, "bam"), _cm(first, "btx"))
    if _timed(first):
        add("BAM beats BTX, TM", _cm(first, "bam", "tm"), _cm(first, "btx", "tm"))
    add("Drop-Upcycling (r 0.5) beats upcycling, DM", "dm-drop-upcycle", "dm-upcycle")
    add("fine-grained upcycling (G 4) beats upcycling, DM", "dm-fine-grained", "dm-upcycle")
    add("fine-grained upcycling beats Drop-Upcycling, DM", "dm-fine-grained", "dm-drop-upcycle")
    add("BAM shared KV beats BTX, DM", "dm-bam-shared-kv", "dm-btx")
    add("BAM shared KV beats BTX, CM", _cm(first, "bam-shared-kv"), _cm(first, "btx"))
    add("expert KV beats shared KV, DM", "dm-bam", "dm-bam-shared-kv")
    add("expert KV beats shared KV, CM", _cm(first, "bam"), _cm(first, "bam-shared-kv"))
    add("the seed as a shared expert beats BTX, DM", "dm-btx-shared", "dm-btx")
    add("the seed as a shared expert beats BTX, CM", _cm(first, "btx-shared"), _cm(first, "btx"))
    for k in (1, 2):
        add(f"soft beats top-{k} attention, DM", "dm-bam", f"dm-bam-top{k}")
        add(f"soft beats top-{k} attention, CM", _cm(first, "bam"), _cm(first, f"bam-top{k}"))
    for setting, label, name in (("dm", "DM", "data-matched"), ("cm", "CM", "compute-matched"),
                                 ("tm", "TM", "time-matched")):
        dense = _dense(first, setting)
        if dense is None or not _has(first, name):
            continue
        for mix in mixes:
            mid = f"dm-{mix}" if setting == "dm" else _cm(first, mix, setting)
            add(f"{mix} beats the dense baseline, {label}", mid, dense)
    return out


# ---- render ---------------------------------------------------------------------------------------------
def _ms(xs: list[float], digits: int = 3) -> str:
    if len(xs) < 2:
        return f"{xs[0]:.{digits}f}"
    return f"{statistics.fmean(xs):.{digits}f} ± {statistics.stdev(xs):.{digits}f}"


def _table(header: list[str], rows: list[list[str]], right_from: int = 1) -> list[str]:
    return (["| " + " | ".join(header) + " |",
             "|" + "|".join("---" if i < right_from else "---:" for i in range(len(header))) + "|"]
            + ["| " + " | ".join(r) + " |" for r in rows])


def _paper_small_shape() -> tuple[float, float, float]:
    """(head share of the dense FLOPs, BAM/BTX, shared KV/BTX) at paper-small with 2,048-token sequences, by
    the project's FLOP count."""
    from bam_surgery.runtime.config import preset
    from bam_surgery.surgery.options import MergeOptions
    from bam_surgery.surgery.recipe import load_recipe, mixture_config
    from bam_surgery.train.metrics import flops_per_token

    dense = preset("paper-small")
    paper = MergeOptions(ffn_top_k=1, gate_norm="softmax")  # the paper's gates (the recipes route to 2)
    f = {r: flops_per_token(mixture_config(load_recipe(r), dense, 4, paper), PAPER_SMALL_SEQ)
         for r in ("btx", "bam", "bam-shared-kv")}
    head = 6.0 * dense.vocab_size * dense.d_model / flops_per_token(dense, PAPER_SMALL_SEQ)
    return head, f["bam"] / f["btx"], f["bam-shared-kv"] / f["btx"]


def render(summary: dict[str, Any]) -> str:
    runs, name = summary["runs"], summary["pipeline"]
    seeds = ", ".join(str(r["seed"]) for r in runs)
    cols = runs[0]["domains"] + ["average"]
    order = [m["id"] for m in runs[0]["models"] if all(m["id"] in _models(r) for r in runs)]
    labels = {m["id"]: m["label"] for m in runs[0]["models"]}
    tm = ", TM: time-matched" if _timed(runs[0]) else ""
    out = [f"**`{name}`, seeds {seeds}.** Perplexity on held-out text, mean ± sample standard deviation over the "
           f"seeds (DM: data-matched, CM: compute-matched{tm}; `A = B`: one run is both):", ""]
    out += _table(["model", *cols], [[labels[i], *(_ms([_avg(r, i, c) for r in runs]) for c in cols)] for i in order])
    out += ["", "Average perplexity per seed:", ""]
    out += _table(["model", *(f"seed {r['seed']}" for r in runs)],
                  [[labels[i], *(f"{_avg(r, i):.3f}" for r in runs)] for i in order])
    out += ["", "Claims (d = the other model's perplexity minus the claimed winner's, per seed; > 0 favours the "
            "claim; t: paired t statistic; verdict by the rule above):", ""]
    rows = []
    for text, better, worse, diffs in claims(runs):
        v, t = verdict(diffs)
        rows.append([text, f"{labels.get(better, better)} vs {labels.get(worse, worse)}",
                     ", ".join(f"{d:+.3f}" for d in diffs), _ms(diffs), "n/a" if t is None else f"{t:+.2f}",
                     f"**{v}**"])
    out += _table(["claim", "compared", "d per seed", "mean ± sd", "t", "verdict"], rows, right_from=3)
    out += ["", *_shape_lines(runs[0], name), *_time_lines(runs[0]), "", *_cost_lines(runs, summary.get("note"))]
    return "\n".join(out)


def _time_lines(run: dict) -> list[str]:
    """Time matching's throughputs and the steps they give (a pipeline with time-matched runs)."""
    shape = run["shape"]
    if "throughput" not in shape:
        return []
    tps, steps, ref = shape["throughput"]["tokens_per_s"], shape["steps"], shape["reference"]
    rows = [[n, f"{tps[n]:,.0f}", f"{tps[n] / tps[ref]:.3f}",
             *(f"{steps[n].get(s, '-')}" for s in ("data-matched", "compute-matched", "time-matched"))]
            for n in steps]
    return ["", f"Time matching: training tokens/s from {' '.join(shape['throughput']['source'].split())}; each "
            "mixture's steps in each setting:", "",
            *_table(["mixture", "tokens/s", "/ reference", "DM steps", "CM steps", "TM steps"], rows)]


def _shape_lines(run: dict, name: str) -> list[str]:
    shape = run["shape"]
    fpt = shape["flops_per_token"]
    if not shape["dense_flops_per_token"] or "btx" not in fpt:
        return []
    head = 6.0 * shape["vocab_size"] * shape["d_model"] / shape["dense_flops_per_token"]
    p_head, p_bam, p_skv = _paper_small_shape()
    rows = [["output head, share of the dense model's FLOPs", f"{head:.3f}", f"{p_head:.3f}"]]
    if "bam" in fpt:
        rows.append(["BAM (expert KV) / BTX, FLOPs per token", f"{fpt['bam'] / fpt['btx']:.3f}", f"{p_bam:.3f}"])
    if "bam-shared-kv" in fpt:
        rows.append(["BAM shared KV / BTX", f"{fpt['bam-shared-kv'] / fpt['btx']:.3f}", f"{p_skv:.3f}"])
    return ["Cost proportions (the project's FLOP count, train.metrics.flops_per_token; paper-small at "
            f"{PAPER_SMALL_SEQ:,}-token sequences):", "",
            *_table(["", f"`{name}`", "paper-small"], rows)]


def _cost_lines(runs: list[dict], note: str | None = None) -> list[str]:
    stages = list(runs[0]["stages"])
    rows = [[s, *(f"{r['stages'][s]['cpu_s'] / 60:,.1f} / {r['stages'][s]['wall_s'] / 60:,.1f}" for r in runs)]
            for s in stages]
    rows.append(["total", *(f"{sum(v['cpu_s'] for v in r['stages'].values()) / 60:,.1f} / "
                            f"{sum(v['wall_s'] for v in r['stages'].values()) / 60:,.1f}" for r in runs)])
    commits = sorted({c for r in runs for v in r["stages"].values() for c in v.get("commits", [])})
    machines = sorted({r["provenance"].get("machine", "n/a") for r in runs})
    how = note or "one thread per pipeline; two pipelines ran at once on the 2-core machine"
    return [f"Cost per stage, CPU minutes / wall minutes ({how}):", "",
            *_table(["stage", *(f"seed {r['seed']}" for r in runs)], rows),
            "", f"Commit(s): {', '.join(commits) or 'n/a'}. Machine: {'; '.join(machines)}."]


# ---- the doc ---------------------------------------------------------------------------------------------
def doc_blocks(text: str) -> dict[str, str]:
    """NAME -> the text between `<!-- replication:NAME begin -->` and `<!-- replication:NAME end -->`."""
    return {m.group(1): m.group(2).strip("\n") for m in
            re.finditer(r"<!-- replication:([\w.-]+) begin -->\n(.*?)<!-- replication:\1 end -->", text, re.S)}


def write_doc(doc: Path, summaries: list[Path]) -> None:
    text = doc.read_text(encoding="utf-8")
    for f in summaries:
        summary = json.loads(f.read_text(encoding="utf-8"))
        name = summary["pipeline"]
        if name not in doc_blocks(text):
            raise SystemExit(f"{doc}: no <!-- replication:{name} begin --> ... end --> markers")
        text = re.sub(rf"(<!-- replication:{re.escape(name)} begin -->\n).*?(<!-- replication:{re.escape(name)} "
                      r"end -->)", lambda m: m.group(1) + render(summary) + "\n" + m.group(2), text, flags=re.S)
    doc.write_text(text, encoding="utf-8")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("summarize", help="reduce pipeline folders (one per seed) to one summary JSON")
    s.add_argument("folders", nargs="+", type=Path)
    s.add_argument("--out", type=Path, required=True)
    s.add_argument("--note", help="how the runs ran, for the cost table's title (default: two pipelines at once "
                                  "on the 2-core machine)")
    r = sub.add_parser("render", help="print the markdown tables of a summary")
    r.add_argument("summary", type=Path)
    w = sub.add_parser("write-doc", help="replace the doc's generated blocks with the summaries' tables")
    w.add_argument("doc", type=Path)
    w.add_argument("summaries", nargs="+", type=Path)
    args = ap.parse_args(argv)
    if args.cmd == "summarize":
        summary = summarize(args.folders, args.note)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {args.out} ({summary['pipeline']}, seeds {[r['seed'] for r in summary['runs']]})",
              file=sys.stderr)
    elif args.cmd == "render":
        print(render(json.loads(args.summary.read_text(encoding="utf-8"))))
    else:
        write_doc(args.doc, args.summaries)


if __name__ == "__main__":
    main()
