"""Training and evaluation of dense and mixture models (`bam-surgery train`, `eval`, `plot`).

    from bam_surgery.train import TrainConfig, train, evaluate
    result = train(TrainConfig(init="mix.safetensors", data="code=data/domains/code,law=data/domains/law",
                               out="run", steps=200, warmup_steps=20, lr=3e-4))
    report = evaluate("run", "code=data/domains/code,law=data/domains/law")

Imports bam_surgery.runtime and bam_surgery.converters only. Modules: config (every knob), data (domain
SPEC, sources), tokenize (tokenizers, token cache), packing (sequences, domain sampling), optim (AdamW,
schedule, trainable patterns), loop (the run), checkpoints (run folder), distributed (torchrun, DDP,
FSDP2), evaluation, metrics (routing statistics, MFU), provenance, plot. See docs/training.md.
"""
from __future__ import annotations

from .config import TrainConfig
from .errors import TrainError

__all__ = ["TrainConfig", "TrainError", "TrainResult", "evaluate", "load_run_config", "plot_run", "train"]


def __getattr__(name: str):
    # the loop, evaluation and plotting pull in more (tqdm, matplotlib); import them when asked
    if name in ("train", "TrainResult", "load_run_config"):
        from . import loop
        return getattr(loop, name)
    if name == "evaluate":
        from .evaluation import evaluate
        return evaluate
    if name == "plot_run":
        from .plot import plot_run
        return plot_run
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
