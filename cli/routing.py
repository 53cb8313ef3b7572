"""`bam-surgery routing-stats`: how a mixture uses its experts, per layer and per domain.

A declaration of app/train.py:routing_stats (the numbers: train/routing_report.py; the PNGs: train/plot.py); the
tables are rendered here. docs/routing-metrics.md defines every column.
"""
from __future__ import annotations

import json

import click

from bam_surgery.app.train import routing_stats

from .options import CommandReporter, eval_input_options

@click.command("routing-stats")
@click.argument("ckpt", metavar="CKPT")
@eval_input_options
@click.option("--compare", metavar="CKPT2",
              help="A second checkpoint of the same shape (e.g. after training): report, per router, the share "
                   "of tokens whose top-1 expert differs between CKPT and CKPT2 (same tokens through both).")
@click.option("--json", "as_json", is_flag=True, help="Print every number (every router, every expert) as JSON.")
@click.option("--plot", "plot_dir", metavar="DIR",
              help="Also draw PNGs into DIR: a layers x experts heatmap per domain and router kind, and a "
                   "usage histogram.")
def routing_stats_cmd(ckpt, data, split, tokenizer, eos_id, text_field, seq_len, batch_size, max_tokens,
                      token_cache, device, compare, as_json, plot_dir):
    """Expert usage of a mixture, per layer and per domain.

    CKPT is any checkpoint open_checkpoint reads, or a run folder (its latest checkpoint). For every
    router: the share of tokens per expert (FFN: top-k assignments; attention: the mean gate), the
    experts used, the entropy of the usage in bits (and its maximum log2 E), the Gini coefficient of
    usage and, with --compare, the share of tokens whose top-1 expert changed.
    """
    report = routing_stats(ckpt, data, compare=compare, plot=plot_dir, split=split, tokenizer=tokenizer,
                           eos_id=eos_id, text_field=text_field, seq_len=seq_len, batch_size=batch_size,
                           max_tokens=max_tokens, token_cache=token_cache, device=device, reporter=CommandReporter())
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2))
        return
    click.echo(report.table())
