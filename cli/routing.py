"""`bam-surgery routing-stats`: how a mixture uses its experts, per layer and per domain.

A thin command over bam_surgery.train.routing_report (the numbers) and train.plot.plot_routing (the
PNGs); docs/routing-metrics.md defines every column.
"""
from __future__ import annotations

import json

import click

from bam_surgery.runtime.text import render_table
from bam_surgery.train.data import parse_data_spec

from .options import eval_input_options

# Up to this many experts a table has one column per expert; past it, a summary per layer.
MAX_EXPERT_COLUMNS = 12
KINDS = (("ffn", "FFN routers: share of top-k assignments", "usage"),
         ("attn", "attention routers: mean gate", "mean_gate"))


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
    # lazy: the routing report and its plots (evaluation, tokenizers, matplotlib) are 0.03 s more on every start
    from bam_surgery.train.plot import plot_routing, routing_plot_files
    from bam_surgery.train.routing_report import routing_stats

    if plot_dir is not None:  # refuse a bad DIR before the forward passes
        routing_plot_files(plot_dir, [d.name for d in parse_data_spec(data)])
    report = routing_stats(ckpt, data, compare=compare, tokenizer=tokenizer, eos_id=eos_id, seq_len=seq_len,
                           batch_size=batch_size, max_tokens=max_tokens, text_field=text_field,
                           token_cache=token_cache, device=device, split=split)
    if plot_dir is not None:
        for path in plot_routing(report, plot_dir):
            click.echo(f"wrote {path}", err=True)
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2))
        return
    click.echo(render_routing(report))


def render_routing(report) -> str:
    """Per domain, one table per router kind: layers x experts (or a summary per layer past
    MAX_EXPERT_COLUMNS experts), with used, entropy, Gini and the stability column."""
    out = [f"checkpoint  {report.checkpoint}"]
    if report.compare:
        out.append(f"compare     {report.compare}  (changed: share of tokens whose top-1 expert differs)")
    out.append(f"tokenizer   {report.tokenizer}, windows of {report.seq_len}")
    for domain, result in report.domains.items():
        out += ["", f"== {domain}: {result.tokens:,} tokens"]
        for kind, title, key in KINDS:
            rows = report.by_layer(domain, kind)
            if not rows:
                continue
            names = report.experts.get(kind) or rows[0][2]["experts"]
            out += ["", f"{title} (entropy in bits, max {rows[0][2]['entropy_max']:.3f})",
                    _layer_table(rows, names, key, result.routing_summary.get(kind, {}), report.compare is not None)]
    return "\n".join(out)


def _layer_table(rows, names: list[str], key: str, summary: dict, with_changed: bool) -> str:
    E = len(names)
    wide = E <= MAX_EXPERT_COLUMNS
    header = ["layer", *(names if wide else ["max (expert)", "min (expert)"]), "used", "entropy", "gini"]
    if with_changed:
        header.append("changed")
    body = []
    for layer, router, s in rows:
        values = s[key]
        cells = [f"{v:.3f}" for v in values] if wide else [_extreme(values, names, max), _extreme(values, names, min)]
        line = [router if layer is None else str(layer), *cells, f"{s['used']}/{E} ({s['used_percent']:.0f}%)",
                f"{s['entropy']:.3f}", f"{s['gini']:.3f}"]
        if with_changed:
            line.append(f"{s['changed']:.3f}" if s.get("changed") is not None else "-")
        body.append(line)
    if len(rows) > 1 and summary:  # the means over layers that `eval` shows
        mean_key = "share" if key == "usage" else "mean_gate"
        cells = [f"{v:.3f}" for v in summary[mean_key]] if wide else ["", ""]
        line = ["mean", *cells, f"{summary['used']:g}/{E}", f"{summary['entropy_bits']:.3f}",
                f"{summary['gini']:.3f}"]
        if with_changed:
            line.append(f"{summary['changed']:.3f}" if summary.get("changed") is not None else "-")
        body.append(line)
    return render_table(header, body)


def _extreme(values: list[float], names: list[str], pick) -> str:
    i = pick(range(len(values)), key=lambda e: values[e])
    return f"{values[i]:.3f} ({names[i]})"
