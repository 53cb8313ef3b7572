"""PNG plots: a run's curves (`bam-surgery plot RUN`) and routing statistics (`routing-stats --plot DIR`).

plot_run, from RUN/metrics.jsonl:
    loss.png   training loss (and NLL when routers add auxiliary terms) per step
    lr.png     the learning rate per step
    eval.png   held-out loss per domain at each evaluation (when the run evaluated)
plot_routing, from a routing_report.RoutingReport:
    routing-ffn-DOMAIN.png    heatmap, layers x FFN experts: share of top-k assignments
    routing-attn-DOMAIN.png   heatmap, layers x attention experts: mean gate
    routing-usage-histogram.png   how the (layer, expert) usages spread around uniform, per domain

Every PNG carries a `Software: bam-surgery` text chunk; both replace only PNGs that carry it (plot_files).
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np

from bam_surgery.runtime.atomic import remove_created_folders

from .errors import TrainError
from .metrics import read_curves
from .routing_report import router_layer

PLOTS = ("loss.png", "lr.png", "eval.png")  # what plot_run draws (eval.png when the run evaluated)


def plot_run(run: str | Path, out: str | Path | None = None) -> list[Path]:
    """Draw the PNGs into `out` (default: the run folder); returns the files written. A file there under one
    of these names that this tool did not write is an error (plot_files), raised before anything is drawn."""
    plt = _pyplot()

    run = Path(run)
    train, evals = read_curves(run / "metrics.jsonl")  # checked: a malformed line is one TrainError
    if not train:
        raise TrainError(f"{run}: no training metrics (metrics.jsonl is missing or empty)")
    names = list(PLOTS[:2]) + ([PLOTS[2]] if evals else [])
    files = plot_files(Path(out) if out else run, names, "--out" if out else "plot")  # before drawing anything
    created = [p for p in (files[0].parent, *files[0].parent.parents) if not os.path.lexists(p)]  # deepest first
    files[0].parent.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    try:
        return _draw(plt, run, train, evals, files, written)
    except BaseException:  # a full disk, Ctrl-C: a folder this call created goes again, with what it drew there
        if created:
            for f in written:
                f.unlink(missing_ok=True)
            remove_created_folders(created)
        raise


def _draw(plt, run: Path, train: list, evals: list, files: list[Path], written: list[Path]) -> list[Path]:
    steps = [r["step"] for r in train]

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [r["loss"] for r in train], label="loss", lw=1)
    if any(abs(r["loss"] - r["nll"]) > 1e-9 for r in train):
        ax.plot(steps, [r["nll"] for r in train], label="NLL", lw=1)
    ax.set(xlabel="step", ylabel="loss (nats/token)", title=f"{_text(run.name)}: training loss")
    ax.grid(alpha=0.3)
    ax.legend()
    written.append(save_figure(fig, files[0]))

    fig, ax = plt.subplots(figsize=(7, 3))
    ax.plot(steps, [r["lr"] for r in train], lw=1)
    ax.set(xlabel="step", ylabel="learning rate", title=f"{_text(run.name)}: learning rate")
    ax.grid(alpha=0.3)
    written.append(save_figure(fig, files[1]))

    if evals:
        fig, ax = plt.subplots(figsize=(7, 4))
        for name in evals[-1]["domains"]:
            pts = [(r["step"], r["domains"][name]) for r in evals if name in r["domains"]]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=_text(name))
        ax.set(xlabel="step", ylabel="held-out loss (nats/token)", title=f"{_text(run.name)}: evaluation")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # matplotlib leaves out labels that start with "_"
            ax.legend()
        written.append(save_figure(fig, files[2]))
    return written


def _text(name: str) -> str:
    """A name read from a file as matplotlib text: `$` would start math mode (and a parse error)."""
    return name.replace("$", r"\$")


SOFTWARE = "bam-surgery"


def _ours(path: Path) -> bool:
    """A PNG this tool wrote: its Software text chunk (written before the image data) says so."""
    with open(path, "rb") as f:
        head = f.read(4096)
    return head.startswith(b"\x89PNG") and b"tEXtSoftware\x00" + SOFTWARE.encode() in head


def plot_files(out: str | Path, names: list[str], option: str, remedy: str = "move it or pick another DIR"
               ) -> list[Path]:
    """The paths of `names` in folder `out`, each free for a plot to be written: absent, or a PNG this tool
    wrote (replaced). The one rule of every command that draws PNGs into a folder the user names (`plot
    --out`, `routing-stats --plot`); raises TrainError, naming `option`, if `out` is not a folder or one of
    the paths is anything else: a user's file, a symbolic link, a folder. `out` may itself be a symbolic
    link to a folder: what is checked is what is there. `train` checks RUN by this rule before it trains."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise TrainError(f"{option} {out}: exists and is not a folder")
    files = [out / name for name in names]
    for path in files:
        if os.path.lexists(path) and (path.is_symlink() or not path.is_file() or not _ours(path)):
            raise TrainError(f"{option}: {path} exists and was not written by bam-surgery; {remedy}")
    return files


def _pyplot():
    # lazy: matplotlib and pyplot cost 0.4 s, for drawing only
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy as well, and only after the backend is chosen

    return plt


def _file_part(name: str) -> str:
    return re.sub(r"[^\w.+-]", "_", name) or "_"


ROUTING_KINDS = (("ffn", "FFN share of top-k assignments", "usage"), ("attn", "attention mean gate", "mean_gate"))


def routing_plot_files(out: str | Path, domains: list[str], kinds: tuple[str, ...] = ("ffn", "attn")
                       ) -> dict[tuple[str, str] | None, Path]:
    """{(domain, kind): heatmap path, None: histogram path} that plot_routing writes into `out`; raises
    TrainError if `out` is not a folder, or one of these files exists and this tool did not write it."""
    parts = {d: _file_part(d) for d in domains}
    if len(set(parts.values())) < len(parts):
        raise TrainError("--plot: two domain names give the same file name; rename a domain")
    keys: list[tuple[str, str] | None] = [(d, k) for d in domains for k in kinds] + [None]
    names = [f"routing-{k[1]}-{parts[k[0]]}.png" if k else "routing-usage-histogram.png" for k in keys]
    return dict(zip(keys, plot_files(out, names, "--plot")))


def plot_routing(report, out: str | Path) -> list[Path]:
    """Heatmaps (one per domain and router kind) and the usage histogram of a RoutingReport, into `out`
    (created if missing). A file there under one of these names that this tool did not write is an error,
    raised before anything is drawn."""
    kinds = [k for k in ROUTING_KINDS if report.experts.get(k[0])]
    files = routing_plot_files(out, list(report.domains), tuple(k for k, _, _ in kinds))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    plt = _pyplot()
    written = []
    for domain, result in report.domains.items():
        for kind, title, key in kinds:
            rows = sorted((router_layer(n) or 0, s[key]) for n, s in result.routing.items()
                          if n.endswith(f"{kind}_router"))
            if not rows:
                continue
            matrix = [r[1] for r in rows]
            labels = report.experts[kind]
            fig, ax = plt.subplots(figsize=(max(5.5, 1.5 + 0.45 * len(labels)), max(2.5, 1.2 + 0.4 * len(rows))))
            im = ax.imshow(matrix, aspect="auto", cmap="viridis", vmin=0.0, interpolation="nearest")
            fig.colorbar(im, ax=ax, label="share" if key == "usage" else "mean gate")
            ax.set(xlabel="expert", ylabel="layer", title=f"{domain}: {title}")
            ax.set_yticks(range(len(rows)), [str(r[0]) for r in rows])
            if len(labels) <= 32:
                ax.set_xticks(range(len(labels)), labels, rotation=45 if len(labels) > 6 else 0, ha="right"
                              if len(labels) > 6 else "center")
            if len(labels) * len(rows) <= 96:  # small enough to print the numbers in the cells
                top = max(max(r) for r in matrix) or 1.0
                for i, r in enumerate(matrix):
                    for j, v in enumerate(r):
                        ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7,
                                color="black" if v > 0.6 * top else "white")
            written.append(save_figure(fig, files[(domain, kind)]))
    fig, axes = plt.subplots(1, len(kinds), figsize=(6 * len(kinds), 4), squeeze=False)
    for ax, (kind, title, _) in zip(axes[0], kinds):
        E = len(report.experts[kind])
        values = {domain: [u * E for n, s in result.routing.items() if n.endswith(f"{kind}_router")
                           for u in s["usage"]]  # usage x E: 1 is an expert's uniform share 1/E
                  for domain, result in report.domains.items()}
        every = [v for vs in values.values() for v in vs]
        bins = np.histogram_bin_edges(every, bins=min(40, max(8, len(every) // (2 * len(values)))))
        for domain, vs in values.items():
            ax.hist(vs, bins=bins, histtype="step", lw=1.2, label=domain)
        ax.yaxis.get_major_locator().set_params(integer=True)
        ax.axvline(1.0, color="gray", ls="--", lw=0.8)
        ax.set(xlabel="usage x E (1 = uniform share 1/E)", ylabel="(layer, expert) pairs",
               title=f"{kind.upper() if kind == 'ffn' else 'attention'} expert usage, {E} experts")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    written.append(save_figure(fig, files[None]))
    return written


def save_figure(fig, path: Path, dpi: int = 110) -> Path:
    """Write a figure as PNG atomically (a hidden partial file renamed into place) and close it."""
    import matplotlib.pyplot as plt  # lazy: 0.4 s; _pyplot() has set the backend

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.partial.png")
    fig.tight_layout()
    try:
        fig.savefig(tmp, dpi=dpi, metadata={"Software": SOFTWARE})
        tmp.replace(path)
    except OSError as e:  # a full disk, a quota: no partial file left beside the plots, and the file named
        tmp.unlink(missing_ok=True)
        reason = e.strerror or (os.strerror(e.errno) if e.errno else str(e))
        raise TrainError(f"{path}: could not be written ({reason}); nothing was left there") from None
    except BaseException:  # Ctrl-C
        tmp.unlink(missing_ok=True)
        raise
    finally:
        plt.close(fig)
    return path
