"""Training and evaluation of dense and mixture models (`bam-surgery train`, `eval`, `plot`).

    from bam_surgery.train import TrainConfig, train, evaluate
    result = train(TrainConfig(init="mix.safetensors", data="code=data/domains/code,law=data/domains/law",
                               out="run", steps=200, warmup_steps=20, lr=3e-4))
    report = evaluate("run", "code=data/domains/code,law=data/domains/law")

Imports bam_surgery.runtime and bam_surgery.converters only. Modules: config (every knob), data (domain
SPEC, sources), tokenize (tokenizers, token cache), packing (sequences, domain sampling), optim (AdamW,
schedule, trainable patterns), loop (the run), checkpoints (run folder), distributed (torchrun, DDP,
FSDP2), evaluation, metrics (routing statistics, MFU), routing_report (per layer and domain, stability
between two checkpoints), provenance, plot. See docs/training.md and docs/routing-metrics.md.
"""
from __future__ import annotations

from .config import TrainConfig
from .errors import TrainError

__all__ = ["TrainConfig", "TrainError", "TrainResult", "evaluate", "load_run_config", "plot_routing", "plot_run",
           "routing_stats", "train"]


def __getattr__(name: str):
    # Lazy (PEP 562): the CLI imports this package for --help (train.config, train.errors); the loop, evaluation,
    # routing report and plots are another 0.06 s of modules, loaded when one of their names is asked for.
    if name in ("train", "TrainResult", "load_run_config"):
        from . import loop  # lazy: see above
        return getattr(loop, name)
    if name == "evaluate":
        from .evaluation import evaluate  # lazy: see above
        return evaluate
    if name == "routing_stats":
        from .routing_report import routing_stats  # lazy: see above
        return routing_stats
    if name in ("plot_run", "plot_routing"):
        from . import plot  # lazy: see above
        return getattr(plot, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
