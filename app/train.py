"""The training use cases: `train` (a run), `evaluate` (`bam-surgery eval`), `routing_stats` and `plot`; the CLI's
commands and the Python API are declarations of them, the pipeline calls them too.

    result = train(init="mix.safetensors", data="code=data/domains/code,law=data/domains/law", out="run",
                   steps=200, warmup_steps=20)
    train(resume=True, out="run", steps=400)                     # continue exactly where it stopped
    report = evaluate("run", "code=data/domains/code", max_tokens=4096)
    stats = routing_stats("run", "code=data/domains/code", compare="mix.safetensors", plot="plots/")

Knobs are TrainConfig's fields, named as the flags name them (--warmup-steps: warmup_steps); docs/training.md lists
them. Refusals are one-line UserErrors (TrainError, naming the knob or file).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from bam_surgery.runtime.errors import UsageError
from bam_surgery.train.checkpoints import latest_checkpoint
from bam_surgery.train.config import TrainConfig, split_patterns
from bam_surgery.train.errors import TrainError

from .reporter import Reporter

KNOBS = tuple(f.name for f in dataclasses.fields(TrainConfig))


def train(config: TrainConfig | None = None, *, config_file: str | Path | None = None, resume: bool = False,
          reporter: Reporter | None = None, **knobs: Any):
    """Train a model (train.loop: processes, init, data, steps, checkpoints, plots) and return its TrainResult.

    config: a whole TrainConfig; config_file: a YAML file of knobs (`--config FILE`); knobs: TrainConfig's fields
    (None: not given), over the file's (or the config's); resume: continue the run in `out` from its newest
    checkpoint with its saved config.yaml (only the knobs that do not change past steps may differ). reporter:
    the run's lines (steps, evaluations, checkpoints)."""
    cfg = train_config(config, config_file=config_file, resume=resume, **knobs)
    from bam_surgery.train.loop import train as run  # lazy: the loop, 0.04 s on every start of the CLI
    return run(cfg, resume=resume, log=(reporter or Reporter()).log)


def train_config(config: TrainConfig | None = None, *, config_file: str | Path | None = None,
                 resume: bool = False, **knobs: Any) -> TrainConfig:
    """The TrainConfig a train call runs with (train's arguments)."""
    unknown = sorted(set(knobs) - set(KNOBS))
    if unknown:
        raise UsageError(f"unknown training knob {unknown[0]!r}; the knobs are TrainConfig's fields "
                         "(docs/training.md)")
    overrides = {k: v for k, v in knobs.items() if v is not None}
    if isinstance(overrides.get("trainable"), str):
        overrides["trainable"] = split_patterns(overrides["trainable"])
    if resume:
        if config is not None and not overrides.get("out") and config.out:
            overrides = {**config.to_dict(), **overrides}
        if not overrides.get("out"):
            raise TrainError("--resume needs --out RUN (the run folder to continue)")
        if config_file:
            overrides = {**TrainConfig.from_yaml(config_file).to_dict(), **overrides}
        from bam_surgery.train.loop import load_run_config  # lazy: as train's
        return load_run_config(overrides["out"], overrides)
    if config is not None:
        return config.replace(**overrides) if overrides else config
    if config_file:
        return TrainConfig.from_yaml(config_file, overrides)
    return TrainConfig.from_dict(overrides, where="flags")


def interrupted_message(out: str | None) -> str:
    """What an interrupted run left: its newest checkpoint (continue with --resume), or none."""
    last = latest_checkpoint(out) if out else None
    return "interrupted; " + (f"the newest checkpoint is {last} (continue with --resume)" if last
                              else "no checkpoint was written")


def evaluate(checkpoint: str, data: str, *, split: str = "val", tokenizer: str | None = None,
             eos_id: int | None = None, text_field: str = "text", seq_len: int | None = None, batch_size: int = 8,
             max_tokens: int = 0, token_cache: str | None = None, device: str = "auto",
             reporter: Reporter | None = None):
    """Per-domain held-out loss and perplexity of a checkpoint (any the tool opens, or a run folder: its newest),
    and routing statistics for mixtures (train/evaluation.py:EvalReport). data: a domain SPEC,
    NAME=SOURCE[:WEIGHT],...; reporter.progress: a bar on stderr while the windows run."""
    from bam_surgery.train.evaluation import evaluate as run  # lazy: evaluation, 0.03 s on every start of the CLI
    _note_token_cache(token_cache, reporter or Reporter())
    return run(checkpoint, data, tokenizer=tokenizer, eos_id=eos_id, seq_len=seq_len, batch_size=batch_size,
               max_tokens=max_tokens, text_field=text_field, token_cache=token_cache, device=device, split=split,
               progress=(reporter or Reporter()).progress)


def routing_stats(checkpoint: str, data: str, *, compare: str | None = None, plot: str | None = None,
                  split: str = "val", tokenizer: str | None = None, eos_id: int | None = None,
                  text_field: str = "text", seq_len: int | None = None, batch_size: int = 8, max_tokens: int = 0,
                  token_cache: str | None = None, device: str = "auto", reporter: Reporter | None = None):
    """How a mixture uses its experts, per layer and per domain (train/routing_report.py:RoutingReport); with
    `compare`, the share of tokens whose top-1 expert differs in a second checkpoint; with `plot` a folder, the
    heatmaps and the usage histogram drawn there (a bad folder refused before the forward passes; each file
    written told to reporter.log)."""
    # lazy: the routing report and its plots (evaluation, tokenizers, matplotlib) are 0.03 s more on every start
    from bam_surgery.train.data import parse_data_spec
    from bam_surgery.train.plot import plot_routing, routing_plot_files
    from bam_surgery.train.routing_report import routing_stats as run

    reporter = reporter or Reporter()
    if plot is not None:  # refuse a bad DIR before the forward passes
        routing_plot_files(plot, [d.name for d in parse_data_spec(data)])
    _note_token_cache(token_cache, reporter)
    report = run(checkpoint, data, compare=compare, tokenizer=tokenizer, eos_id=eos_id, seq_len=seq_len,
                 batch_size=batch_size, max_tokens=max_tokens, text_field=text_field, token_cache=token_cache,
                 device=device, split=split)
    if plot is not None:
        for path in plot_routing(report, plot):
            reporter.log(f"wrote {path}")
    return report


def _note_token_cache(token_cache: str | None, reporter: Reporter) -> None:
    """The note of a token cache that is not trusted (train/tokenize.py: the splits go to a private folder)."""
    from bam_surgery.train.tokenize import token_cache_note  # lazy: tokenizers, as above
    note = token_cache_note(token_cache)
    if note:
        reporter.note(note)


def plot(run: str | Path, out: str | Path | None = None, reporter: Reporter | None = None) -> list[Path]:
    """A run's loss, learning-rate and evaluation curves as PNGs into `out` (default: the run folder)."""
    from bam_surgery.train.plot import plot_run  # lazy: train.plot (matplotlib), 0.03 s on every start of the CLI
    paths = plot_run(run, out)
    for path in paths:
        (reporter or Reporter()).log(f"wrote {path}")
    return paths


__all__ = ["KNOBS", "evaluate", "interrupted_message", "plot", "routing_stats", "train", "train_config"]
