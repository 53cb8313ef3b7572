"""`bam-surgery plot RUN`: the run's curves as PNG files, from RUN/metrics.jsonl.

    loss.png   training loss (and NLL when routers add auxiliary terms) per step
    lr.png     the learning rate per step
    eval.png   held-out loss per domain at each evaluation (when the run evaluated)
"""
from __future__ import annotations

from pathlib import Path

from .errors import TrainError
from .metrics import read_metrics


def plot_run(run: str | Path, out: str | Path | None = None) -> list[Path]:
    """Draw the PNGs into `out` (default: the run folder); returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = Path(run)
    records = read_metrics(run / "metrics.jsonl")
    train = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    if not train:
        raise TrainError(f"{run}: no training metrics (metrics.jsonl is missing or empty)")
    out = Path(out) if out else run
    out.mkdir(parents=True, exist_ok=True)
    steps = [r["step"] for r in train]
    written = []

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [r["loss"] for r in train], label="loss", lw=1)
    if any(abs(r["loss"] - r["nll"]) > 1e-9 for r in train):
        ax.plot(steps, [r["nll"] for r in train], label="NLL", lw=1)
    ax.set(xlabel="step", ylabel="loss (nats/token)", title=f"{run.name}: training loss")
    ax.grid(alpha=0.3)
    ax.legend()
    written.append(save_figure(fig, out / "loss.png"))

    fig, ax = plt.subplots(figsize=(7, 3))
    ax.plot(steps, [r["lr"] for r in train], lw=1)
    ax.set(xlabel="step", ylabel="learning rate", title=f"{run.name}: learning rate")
    ax.grid(alpha=0.3)
    written.append(save_figure(fig, out / "lr.png"))

    if evals:
        fig, ax = plt.subplots(figsize=(7, 4))
        for name in evals[-1]["domains"]:
            pts = [(r["step"], r["domains"][name]["loss"]) for r in evals if name in r["domains"]]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=name)
        ax.set(xlabel="step", ylabel="held-out loss (nats/token)", title=f"{run.name}: evaluation")
        ax.grid(alpha=0.3)
        ax.legend()
        written.append(save_figure(fig, out / "eval.png"))
    return written


def save_figure(fig, path: Path, dpi: int = 110) -> Path:
    """Write a figure as PNG atomically (a hidden partial file renamed into place) and close it."""
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.partial.png")
    fig.tight_layout()
    fig.savefig(tmp, dpi=dpi)
    plt.close(fig)
    tmp.replace(path)
    return path
