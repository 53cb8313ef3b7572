"""`bam-surgery train`, `eval` and `plot`: thin click commands over bam_surgery.train.

Every knob of TrainConfig is a flag (`--seq-len`, `--warmup-steps`, ...), built from the config's
fields and their help sentences, so the flags, the YAML keys and docs/training.md name the same
things. Flags override the --config file; with --resume they override RUN/config.yaml (only the
knobs that do not change past steps may differ).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from typing import Any

import click

from bam_surgery.runtime.config import PRESETS
from bam_surgery.runtime.text import render_table
from bam_surgery.train.checkpoints import latest_checkpoint
from bam_surgery.train.config import CHOICES, TrainConfig, split_patterns

from .options import eval_input_options

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


def _overrides(knobs: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in knobs.items() if v is not None}
    if "trainable" in out:
        out["trainable"] = split_patterns(out["trainable"])
    return out


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
    from bam_surgery.train import TrainError, load_run_config, train  # lazy: the loop, 0.04 s on every start

    overrides = _overrides(knobs)
    try:
        if resume:
            if not overrides.get("out"):
                raise TrainError("--resume needs --out RUN (the run folder to continue)")
            if config_file:
                overrides = {**TrainConfig.from_yaml(config_file).to_dict(), **overrides}
            cfg = load_run_config(overrides["out"], overrides)
        elif config_file:
            cfg = TrainConfig.from_yaml(config_file, overrides)
        else:
            cfg = TrainConfig.from_dict(overrides, where="flags")
        result = train(cfg, resume=resume, log=lambda m: click.echo(m, err=True))
    except TrainError:
        if _rank() != 0:  # under torchrun rank 0 reports it; the others leave quietly
            sys.exit(2)
        raise
    except KeyboardInterrupt:
        if _rank() == 0:
            last = latest_checkpoint(knobs.get("out") or ".") if knobs.get("out") else None
            click.echo("bam-surgery: interrupted; " + (f"the newest checkpoint is {last} (continue with --resume)"
                                                     if last else "no checkpoint was written"), err=True)
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
    from bam_surgery.train import evaluate  # lazy: evaluation, 0.03 s on every start

    report = evaluate(ckpt, data, tokenizer=tokenizer, eos_id=eos_id, seq_len=seq_len, batch_size=batch_size,
                      max_tokens=max_tokens, text_field=text_field, token_cache=token_cache, device=device,
                      split=split, progress=True)
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2))
        return
    click.echo(render_eval(report))


def render_eval(report) -> str:
    out = [f"checkpoint  {report.checkpoint}", f"tokenizer   {report.tokenizer}, windows of {report.seq_len}",
           f"separator   {report.separator}", ""]
    rows = [(n, r.tokens, f"{r.loss:.4f}", f"{r.perplexity:.3f}") for n, r in report.domains.items()]
    out.append(render_table(("domain", "tokens", "loss", "perplexity"), rows))
    for kind, title, key in (("ffn", "FFN experts: share of tokens", "share"),
                             ("attn", "attention experts: mean gate", "mean_gate")):
        names = report.experts.get(kind)
        if not names:
            continue
        rows = []
        for n, r in report.domains.items():
            s = r.routing_summary.get(kind)
            if s:
                rows.append((n, *[f"{v:.3f}" for v in s[key]], f"{s['used']:g}/{len(names)}",
                             f"{s['entropy_bits']:.3f}", f"{s['gini']:.3f}"))
        out += ["", f"{title} (mean over layers; entropy in bits, max {_log2(len(names)):.3f})",
                render_table(("domain", *names, "used", "entropy", "gini"), rows)]
    return "\n".join(out)


def _log2(n: int) -> float:
    return math.log2(n) if n else 0.0


@click.command("plot")
@click.argument("run", metavar="RUN", type=click.Path(file_okay=False))
@click.option("--out", metavar="DIR", help="Where to write the PNG files (default: the run folder).")
def plot_cmd(run, out):
    """Draw a run's loss, learning-rate and evaluation curves (PNG) from RUN/metrics.jsonl."""
    from bam_surgery.train import plot_run  # lazy: train.plot (the routing report, matplotlib), 0.03 s on every start

    for path in plot_run(run, out):
        click.echo(f"wrote {path}", err=True)
