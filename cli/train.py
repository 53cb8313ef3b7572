"""`bam-surgery train`, `eval` and `plot`: declarations of app/train.py's use cases (train, evaluate, plot).

Every knob of TrainConfig is a flag (`--seq-len`, `--warmup-steps`, ...), built from the config's
fields and their help sentences, so the flags, the YAML keys and docs/training.md name the same
things. Flags override the --config file; with --resume they override RUN/config.yaml (only the
knobs that do not change past steps may differ).
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Any

import click

from bam_surgery.app.errors import UserError
from bam_surgery.app.train import evaluate, interrupted_message, plot, train
from bam_surgery.runtime.config import PRESETS
from bam_surgery.train.config import CHOICES, TrainConfig

from .options import CommandReporter, eval_input_options

# flags whose name differs from the field's, or that take a fixed set of values
_CHOICE_FIELDS = {**CHOICES, "preset": tuple(PRESETS)}
_METAVARS = {"init": "CKPT", "data": "SPEC", "eval_data": "SPEC", "out": "RUN", "model_config": "FILE",
             "tokenizer": "PATH|bytes", "token_cache": "DIR", "trainable": "PATTERNS", "preset": "NAME"}


def _knob_options(fn):
    """One click option per TrainConfig field, default None (= not given: the config file's value)."""
    for f in reversed(dataclasses.fields(TrainConfig)):
        flag = "--" + f.name.replace("_", "-")
        help_text = f.metadata["help"]
        kind = str(f.type)
        if kind == "bool":
            opt = click.option(f"{flag}/--no-{f.name.replace('_', '-')}", f.name, default=None, help=help_text)
        elif f.name in _CHOICE_FIELDS:
            opt = click.option(flag, f.name, type=click.Choice(_CHOICE_FIELDS[f.name]), default=None, help=help_text)
        else:
            typ = click.INT if kind.startswith("int") else click.FLOAT if kind.startswith("float") else click.STRING
            opt = click.option(flag, f.name, type=typ, default=None, metavar=_METAVARS.get(f.name), help=help_text)
        fn = opt(fn)
    return fn


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


@click.command("train")
@click.option("--config", "config_file", type=click.Path(dir_okay=False), metavar="FILE",
              help="YAML file of training knobs (docs/training.md lists them); flags override it.")
@click.option("--resume", is_flag=True,
              help="Continue the run in --out from its latest checkpoint, exactly where it stopped (its saved "
                   "config.yaml holds the settings; --steps may extend it).")
@_knob_options
def train_cmd(config_file, resume, **knobs):
    """Train a model: a merged mixture (routers and all), a seed, or a specialist.

    Start from --init CKPT (any checkpoint open_checkpoint reads, or a run folder), or from random
    weights with --preset / --model-config. --data names the domains: NAME=SOURCE[:WEIGHT],...
    Writes RUN/ (checkpoints, metrics.jsonl, config.yaml, plots). Run under torchrun for several
    processes (--strategy ddp|fsdp).
    """
    try:
        result = train(config_file=config_file, resume=resume, reporter=CommandReporter(), **knobs)
    except UserError:
        if _rank() != 0:  # under torchrun rank 0 reports it; the others leave quietly
            sys.exit(2)
        raise
    except KeyboardInterrupt:
        if _rank() == 0:
            click.echo(f"bam-surgery: {interrupted_message(knobs.get('out'))}", err=True)
        sys.exit(130)
    if _rank() == 0:
        click.echo(f"trained {result.steps} steps ({result.tokens:,} tokens); final loss {result.loss:.4f}; "
                   f"checkpoint {result.checkpoint}", err=True)


@click.command("eval")
@click.argument("ckpt", metavar="CKPT")
@eval_input_options
@click.option("--json", "as_json", is_flag=True, help="Print the full report (every router) as JSON.")
def eval_cmd(ckpt, data, split, tokenizer, eos_id, text_field, seq_len, batch_size, max_tokens, token_cache,
             device, as_json):
    """Per-domain held-out loss and perplexity, and routing statistics for mixtures.

    CKPT is any checkpoint open_checkpoint reads, or a run folder (its latest checkpoint). For
    mixtures: the share of tokens per FFN expert, the mean attention gates, the experts used, the
    routing entropy in bits and the Gini coefficient of expert usage, per domain (means over layers;
    --json: per router; `routing-stats` shows every layer). A progress bar shows on stderr when it
    is a terminal, else a progress line every 30 seconds.
    """
    report = evaluate(ckpt, data, split=split, tokenizer=tokenizer, eos_id=eos_id, text_field=text_field,
                      seq_len=seq_len, batch_size=batch_size, max_tokens=max_tokens, token_cache=token_cache,
                      device=device, reporter=CommandReporter(progress=True))
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2))
        return
    click.echo(report.table())


@click.command("plot")
@click.argument("run", metavar="RUN", type=click.Path(file_okay=False))
@click.option("--out", metavar="DIR", help="Where to write the PNG files (default: the run folder).")
def plot_cmd(run, out):
    """Draw a run's loss, learning-rate and evaluation curves (PNG) from RUN/metrics.jsonl."""
    plot(run, out, reporter=CommandReporter())
