"""The pipeline report's PNG plots (matplotlib, Agg), each written atomically into DIR/plots/.

    training.png        training loss (NLL) against tokens: the seed and specialists, then the mixtures of
                        each setting (a running mean over 5% of the steps; the raw curves are in each
                        run's metrics.jsonl)
    perplexity.png      held-out perplexity per eval domain (and the average) of every trained model
    routing-UNIT.png    per trained mixture: FFN expert share and attention mean gate, layers x experts,
                        one column per eval domain
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from bam_surgery.runtime.jsonfile import read_json
from bam_surgery.train.metrics import read_metrics
from bam_surgery.train.plot import save_figure

if TYPE_CHECKING:
    from .run import PipelineRun

_LAYER = re.compile(r"^layers\.(\d+)\.(ffn|attn)_router")


def _plt():
    # lazy: matplotlib and pyplot cost 0.4 s, for drawing only
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy as well, and only after the backend is chosen

    return plt


def _smooth(ys: list[float]) -> list[float]:
    w = max(1, len(ys) // 20)
    out, acc = [], 0.0
    for i, y in enumerate(ys):
        acc += y
        if i >= w:
            acc -= ys[i - w]
        out.append(acc / min(i + 1, w))
    return out


def _curve(run_dir: Path) -> tuple[list[int], list[float]]:
    recs = [r for r in read_metrics(run_dir / "metrics.jsonl") if r.get("kind") == "train"]
    return [r["tokens"] for r in recs], _smooth([r["nll"] for r in recs])


def training_curves(run: "PipelineRun", rep: dict[str, Any]) -> Path:
    from matplotlib.ticker import EngFormatter  # lazy: matplotlib, after _plt() chose the backend

    plt = _plt()
    groups: list[tuple[str, list[tuple[str, str]]]] = []
    dense = [(m["label"], m["training"]["unit"]) for m in rep["models"]
             if m["kind"] in ("seed", "specialist") and m["training"]]
    if dense:
        groups.append(("seed and specialists", dense))
    for setting in run.spec.settings:
        runs = [(m["label"], m["training"]["unit"]) for m in rep["models"]  # the dense baseline first
                if (m["kind"] == "dense" and setting in m["settings"]) or (m["kind"] == "trained"
                                                                           and m["setting"] == setting)]
        if runs:
            groups.append((f"mixtures, {setting}", runs))
    fig, axes = plt.subplots(1, len(groups), figsize=(5.5 * len(groups), 4), squeeze=False)
    for ax, (title, runs) in zip(axes[0], groups):
        for label, unit in runs:
            x, y = _curve(run.runs / unit)
            ax.plot(x, y, lw=1, label=label)
        ax.set(xlabel="tokens", ylabel="training NLL (nats/token)", title=title)
        ax.xaxis.set_major_formatter(EngFormatter())
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return save_figure(fig, run.dir / "plots" / "training.png")


def perplexity_bars(run: "PipelineRun", rep: dict[str, Any]) -> Path:
    from matplotlib.ticker import FormatStrFormatter  # lazy: matplotlib, after _plt() chose the backend

    plt = _plt()
    models = [m for m in rep["models"] if m["kind"] != "untrained"]
    cols = rep["domains"] + ["average"]
    fig, ax = plt.subplots(figsize=(max(7.0, 1.1 * len(cols) * max(1, len(models)) / 4), 4.5))
    width = 0.8 / len(models)
    for i, m in enumerate(models):
        ys = [m["average_perplexity"] if c == "average" else m["perplexity"][c] for c in cols]
        ax.bar([j + (i - (len(models) - 1) / 2) * width for j in range(len(cols))], ys, width, label=m["label"],
               color=plt.cm.tab20(i % 20))
    ax.set_xticks(range(len(cols)), cols)
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(FormatStrFormatter("%g"))
    ax.set(ylabel="held-out perplexity (log scale)", title=f"{rep['pipeline']}: perplexity per domain")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7, ncol=2)
    return save_figure(fig, run.dir / "plots" / "perplexity.png")


def routing_heatmaps(run: "PipelineRun", model: dict[str, Any]) -> Path | None:
    """Layers x experts per eval domain, from the eval file's per-router statistics."""
    plt = _plt()
    ev = read_json(run.evals / f"{model['id']}.json", expect=dict)
    domains = list(ev["domains"])
    kinds = [(k, key, title) for k, key, title in (("ffn", "usage", "FFN expert share"),
                                                   ("attn", "mean_gate", "attention mean gate"))
             if ev["experts"].get(k)]
    if not kinds:
        return None
    fig, axes = plt.subplots(len(kinds), len(domains), figsize=(2.6 * len(domains) + 1, 2.4 * len(kinds) + 0.6),
                             squeeze=False)
    for row, (kind, key, title) in enumerate(kinds):
        names = ev["experts"][kind]
        for col, dom in enumerate(domains):
            routers = ev["domains"][dom]["routers"]
            layers = sorted((int(m.group(1)), r[key]) for n, r in routers.items()
                            if (m := _LAYER.match(n)) and m.group(2) == kind)
            grid = np.array([v for _, v in layers])
            ax = axes[row][col]
            ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto")
            ax.set_xticks(range(len(names)), names, rotation=45, fontsize=7)
            ax.set_yticks(range(len(layers)), [str(i) for i, _ in layers], fontsize=7)
            for (i, j), v in np.ndenumerate(grid):
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=6, color="w" if v < 0.6 else "k")
            ax.set_title(f"{dom}: {title}", fontsize=8)
            if col == 0:
                ax.set_ylabel("layer", fontsize=8)
    fig.suptitle(f"{model['label']}: routing per layer", fontsize=9)
    return save_figure(fig, run.dir / "plots" / f"routing-{model['id']}.png")


def draw_plots(run: "PipelineRun", rep: dict[str, Any]) -> list[Path]:
    out = [training_curves(run, rep), perplexity_bars(run, rep)]
    for m in rep["models"]:
        if m["kind"] == "trained" and m["routing"]:
            path = routing_heatmaps(run, m)
            if path:
                out.append(path)
    return out
