"""The pipeline's report: DIR/report.json, DIR/report.md and DIR/plots/*.png.

Numbers come from the eval stage's files (DIR/eval/MODEL.json, what `bam-surgery eval --json` prints for
the same checkpoint), parameter counts from the audit of each checkpoint's header (exact convention),
tokens and times from the stage markers and the runs' trainer state, curves from the runs' metrics.jsonl.

    Table 1 style   perplexity per model (rows) and eval domain (columns), and their average (the paper's
                    "Average": the arithmetic mean of the columns)
    Table 3 style   the attention-routing comparison (stages.report.attention_routing against the baseline)
    parameters      total and active per model; training FLOPs per token, steps, tokens, FLOPs per run
    routing         FFN expert shares and attention gates per domain of each trained mixture
    stages          tokens, wall time and CPU time per stage

Keys ending in `_s` (times) are the only ones that differ between two runs of the same pipeline.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bam_surgery.converters import open_checkpoint
from bam_surgery.runtime.jsonfile import read_json
from bam_surgery.surgery.audit import audit_checkpoint
from bam_surgery.train import TrainConfig

from .files import provenance, training_seconds, write_record
from .plots import draw_plots
from .spec import STAGES, Mixture

if TYPE_CHECKING:
    from .run import PipelineRun

FLOPS_DEFINITION = ("training FLOPs per token = 6 x active matmul parameters (FFN experts counted top-k/E, soft "
                    "attention experts all, top-k attention experts k/E, the LM head included, embedding lookups "
                    "not) + 12 x layers x seq_len x query width x attention experts a token runs "
                    "(bam_surgery.train.metrics.flops_per_token)")
SETTING_LABEL = {"data-matched": "DM", "compute-matched": "CM", "time-matched": "TM"}


# ---- collecting -------------------------------------------------------------------------------------
def _read_json(path: Path) -> dict[str, Any]:
    return read_json(path, expect=dict)  # our own records, read with the bounds of every JSON file


def _audit(ckpt: str) -> dict[str, int]:
    with open_checkpoint(ckpt) as reader:
        a = audit_checkpoint(reader)
    return {"total": a.total, "active": a.active}


def _run_training(run: "PipelineRun", unit: str) -> dict[str, Any]:
    """Steps, tokens and FLOPs of a training unit, from its final checkpoint and config."""
    cfg = TrainConfig.from_yaml(run.configs / f"{unit}.yaml")
    tokens = cfg.steps * (cfg.batch_tokens or cfg.micro_batch * run.spec.seq_len)
    fpt = run.spec.unit_flops_per_token(unit)
    return {"unit": unit, "steps": cfg.steps, "tokens": tokens, "flops_per_token": fpt, "flops": fpt * tokens,
            "lr": cfg.lr, "train_s": training_seconds(run.final_checkpoint(unit, cfg.steps))}


def _model_rows(run: "PipelineRun") -> list[dict[str, Any]]:
    """One entry per evaluated model, in table order: seed, specialists, mixtures untrained, the dense baselines,
    the trained mixtures."""
    spec, ckpts = run.spec, run.eval_models()
    rows: list[dict[str, Any]] = []

    def add(model: str, label: str, kind: str, mix: Mixture | None, setting: str | None, unit: str | None,
            settings: list[str] | None = None) -> None:
        ev = _read_json(run.evals / f"{model}.json")
        doms = ev["domains"]
        ppl = {d: doms[d]["perplexity"] for d in spec.eval_domains()}
        rows.append({
            "id": model, "label": label, "kind": kind, "mixture": mix.name if mix else None,
            "recipe": mix.recipe.name if mix else None, "setting": setting, "settings": settings,
            "checkpoint": ev["checkpoint"], "perplexity": ppl,
            "average_perplexity": sum(ppl.values()) / len(ppl),
            "loss": {d: doms[d]["loss"] for d in spec.eval_domains()},
            "tokens_evaluated": {d: doms[d]["tokens"] for d in spec.eval_domains()},
            "params": _audit(ckpts[model]),
            "training": _run_training(run, unit) if unit else None,
            "experts": ev.get("experts") or {},
            "routing": {d: doms[d]["routing"] for d in spec.eval_domains() if doms[d].get("routing")},
        })

    add("seed", "seed (dense)", "seed", None, None, "seed" if spec.seed_init is None else None)
    for d in run.branched():
        add(f"branch-{d}", f"{d} specialist", "specialist", None, None, f"branch-{d}")
    for mix in spec.mixtures:
        add(f"mix-{mix.name}", f"{mix.name} (untrained)", "untrained", mix, "untrained", None)
    for setting, unit in spec.dense_runs():
        both = [s for s in spec.settings if spec.dense_unit(s) == unit]
        add(unit, f"dense {' = '.join(SETTING_LABEL[s] for s in both)}", "dense", None, setting, unit, both)
    for setting, mix in spec.trained_mixtures():
        unit = spec.unit_name(setting, mix)
        both = [s for s in spec.settings if spec.unit_name(s, mix) == unit]
        tag = " = ".join(SETTING_LABEL[s] for s in both)
        add(unit, f"{mix.name} {tag}", "trained", mix, setting, unit, both)
    return rows


def _routing_table(rows: list[dict[str, Any]], spec, setting: str) -> list[dict[str, Any]]:
    """The Table-3-style rows for one setting: the dense baseline (if trained), the baseline mixture, then the
    attention-routing mixtures."""
    out = []
    if spec.dense_baseline:
        row = next(r for r in rows if r["id"] == spec.dense_unit(setting))
        out.append({"id": row["id"], "mixture": "dense", "attention": "dense attention, no experts",
                    "perplexity": row["perplexity"], "average_perplexity": row["average_perplexity"],
                    "tokens": row["training"]["tokens"], "flops": row["training"]["flops"]})
    for name in [spec.report_baseline, *[n for n in spec.report_attention_routing if n != spec.report_baseline]]:
        mix = spec.mixture(name)
        unit = spec.unit_name(setting, mix)
        row = next(r for r in rows if r["id"] == unit)
        routing = "dense attention" if not mix.config.attn_experts else (
            "soft" if mix.config.attn_top_k is None else f"top-{mix.config.attn_top_k}")
        out.append({"id": unit, "mixture": name, "attention": routing, "perplexity": row["perplexity"],
                    "average_perplexity": row["average_perplexity"],
                    "tokens": row["training"]["tokens"], "flops": row["training"]["flops"]})
    return out


def collect(run: "PipelineRun") -> dict[str, Any]:
    """report.json's content."""
    spec = run.spec
    rows = _model_rows(run)
    stages = {}
    for stage in STAGES:
        if run.marker(stage).is_file():
            m = _read_json(run.marker(stage))
            stages[stage] = {"tokens": m["tokens"], "wall_s": m["wall_s"], "cpu_s": m["cpu_s"],
                             "commits": sorted({r["commit"] for r in m["units"].values() if r.get("commit")}),
                             "machines": sorted({r["machine"] for r in m["units"].values() if r.get("machine")}),
                             "units": {u: {k: v for k, v in r.items() if k in ("tokens", "wall_s", "cpu_s", "train_s",
                                                                               "resumed")}
                                       for u, r in m["units"].items()}}
    routing = {}
    if spec.report_attention_routing:
        routing = {s: _routing_table(rows, spec, s) for s in spec.settings}
    ref = spec.mixture(spec.compute_reference) if spec.compute_reference else None
    return {
        "pipeline": spec.name, "description": spec.description, "seed": spec.seed, "resolved": spec.doc,
        "tokenizer": spec.tokenizer, "seq_len": spec.seq_len, "domains": spec.eval_domains(),
        "eval": {"max_tokens": spec.eval_max_tokens, "batch_size": spec.eval_batch_size, "split": "val"},
        "compute": {"definition": FLOPS_DEFINITION, "reference": spec.compute_reference,
                    "reference_flops_per_token": ref.flops_per_token if ref else None,
                    "flops_per_token": {m.name: m.flops_per_token for m in spec.mixtures},
                    "steps": {m.name: {s: spec.train_steps(m, s) for s in spec.settings} for m in spec.mixtures},
                    **({"throughput": spec.throughput} if spec.throughput else {})},
        "models": rows, "attention_routing": routing, "stages": stages, "provenance": provenance(),
    }


# ---- markdown -----------------------------------------------------------------------------------------
def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" if i == 0 else "---:" for i in range(len(header)))
             + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def _ppl_rows(rows: list[dict[str, Any]], domains: list[str], label_key: str = "label") -> list[list[str]]:
    """Perplexities with the best (lowest) of each column in bold."""
    cols = domains + ["average"]
    val = lambda r, c: r["average_perplexity"] if c == "average" else r["perplexity"][c]  # noqa: E731
    best = {c: min(val(r, c) for r in rows) for c in cols}
    return [[r[label_key]] + [f"**{val(r, c):.3f}**" if val(r, c) == best[c] else f"{val(r, c):.3f}" for c in cols]
            for r in rows]


def _fmt_s(x: float | None) -> str:
    return "n/a" if x is None else f"{x:,.1f}"


def render_markdown(rep: dict[str, Any], plots: list[str]) -> str:
    doms = rep["domains"]
    models = rep["models"]
    out = [f"# Pipeline report: {rep['pipeline']}", ""]
    if rep["description"]:
        out += [rep["description"], ""]
    ev = rep["eval"]
    out += [f"Seed {rep['seed']}; tokenizer `{rep['tokenizer']}`; sequences of {rep['seq_len']} tokens. Evaluation: "
            f"the held-out (val) split of each domain, " + (f"the first {ev['max_tokens']:,} tokens"
                                                           if ev["max_tokens"] else "every token")
            + f", windows of {rep['seq_len']}; the numbers equal `bam-surgery eval CKPT --json` on the same "
            "checkpoint (the commands are in commands.sh). Perplexity, lower is better; **bold**: best in the "
            "column. Average: the mean of the columns (as in the paper's Table 1).", ""]
    main = [m for m in models if m["kind"] != "untrained"]
    out += ["## Perplexity (Table 1 style)", "",
            _table(["model", *doms, "average"], _ppl_rows(main, doms)), ""]
    untrained = [m for m in models if m["kind"] == "untrained"]
    if untrained:
        out += ["Mixtures right after the merge, before mixture training (fresh routers; see README: perplexity "
                "before training is expected to be high):", "",
                _table(["model", *doms, "average"], _ppl_rows(untrained, doms)), ""]
    for setting, rows in rep["attention_routing"].items():
        for r in rows:
            r["label"] = f"{r['mixture']} ({r['attention']})"
        out += [f"## Attention routing, {setting} (Table 3 style)", "",
                _table(["model (attention)", *doms, "average"], _ppl_rows(rows, doms)), ""]
    out += _parameters_section(rep) + _routing_section(models, doms) + _stages_section(rep)
    if plots:
        out += ["## Plots", ""] + [f"![{Path(p).stem}]({p})" for p in plots] + [""]
    return "\n".join(out)


def _parameters_section(rep: dict[str, Any]) -> list[str]:
    out = ["## Parameters and training compute", "",
           f"Total and active parameters from the audit of each checkpoint (exact convention, "
           f"`bam-surgery count-params`). Compute matching: {rep['compute']['definition']}; every compute-matched "
           f"mixture gets the FLOPs of `{rep['compute']['reference']}`'s data-matched run."
           + (f" Time matching: every time-matched run gets that run's training time at the throughputs of "
              f"{rep['compute']['throughput']['source']}." if rep["compute"].get("throughput") else ""), ""]
    prow = []
    for m in rep["models"]:
        t = m["training"]
        prow.append([m["label"], f"{m['params']['total']:,}", f"{m['params']['active']:,}",
                     f"{t['flops_per_token'] / 1e6:.3f}" if t else "", f"{t['steps']:,}" if t else "",
                     f"{t['tokens']:,}" if t else "", f"{t['flops']:.3e}" if t else ""])
    return out + [_table(["model", "total params", "active params", "MFLOP/token", "steps", "tokens",
                          "training FLOPs"], prow), ""]


def _routing_section(models: list[dict[str, Any]], doms: list[str]) -> list[str]:
    out = ["## Routing of the trained mixtures", "",
           "Per eval domain, means over layers: the share of tokens each FFN expert got (top-k choices) and the "
           "mean gate of each attention expert; entropy in bits (log2 E: balanced). Per-layer heatmaps: "
           "plots/routing-*.png.", ""]
    for m in models:
        if m["kind"] != "trained" or not m["routing"]:
            continue
        out += [f"### {m['label']}", ""]
        for kind, key, title in (("ffn", "share", "FFN experts: share of tokens"),
                                 ("attn", "mean_gate", "attention experts: mean gate")):
            names = m["experts"].get(kind) or []
            if not names:
                continue
            rows = [[d, *[f"{v:.3f}" for v in m["routing"][d][kind][key]], f"{m['routing'][d][kind]['entropy_bits']:.3f}"]
                    for d in doms if kind in m["routing"].get(d, {})]
            out += [f"{title}:", "", _table(["domain", *names, "entropy"], rows), ""]
    return out


def _stages_section(rep: dict[str, Any]) -> list[str]:
    out = ["## Stages: tokens and time", "",
           "Wall and CPU time of the process (CPU time counts every thread; on a loaded machine it is the fairer "
           "measure). A unit resumed after an interrupt counts its last attempt; `train_s` in report.json is the "
           "training steps' time over every attempt.", ""]
    srows = [[s, f"{len(v['units'])}", f"{v['tokens']:,}", _fmt_s(v["wall_s"]), _fmt_s(v["cpu_s"]),
              ", ".join(v.get("commits") or ["n/a"])] for s, v in rep["stages"].items()]
    total = [sum(v["wall_s"] for v in rep["stages"].values()), sum(v["cpu_s"] for v in rep["stages"].values())]
    srows.append(["total", "", f"{sum(v['tokens'] for v in rep['stages'].values()):,}", _fmt_s(total[0]),
                  _fmt_s(total[1]), ""])
    machines = sorted({m for v in rep["stages"].values() for m in v.get("machines") or []})
    prov = rep.get("provenance") or {}
    return out + [_table(["stage", "units", "tokens", "wall s", "CPU s", "commit"], srows), "",
                  f"Machine: {'; '.join(machines) or prov.get('machine', 'n/a')}. Report written at commit "
                  f"{prov.get('commit', 'n/a')} (Python {prov.get('python')}, torch {prov.get('torch')}).", ""]


def write_report(run: "PipelineRun") -> list[Path]:
    """Write report.json, the plots and report.md (each atomically); returns the files."""
    rep = collect(run)
    # the report stage's own time is not known until it ends; report.json lists the stages before it
    plots = draw_plots(run, rep)
    rel = [str(p.relative_to(run.dir)) for p in plots]
    write_record(run.dir / "report.json", json.dumps(_clean(rep), indent=1) + "\n")
    write_record(run.dir / "report.md", render_markdown(rep, rel))
    return [run.dir / "report.json", run.dir / "report.md", *plots]


def _clean(x: Any) -> Any:
    """JSON without NaN/Infinity (null instead)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_clean(v) for v in x]
    return x
