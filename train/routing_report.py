"""How a mixture uses its experts, per layer and per domain, and how stable its top-1 choices are.

    report = routing_stats("mix.safetensors", "code=data/domains/code,law=data/domains/law",
                           compare="run/checkpoints/step-00000200", max_tokens=4096)
    report.domains["code"].routing["layers.0.ffn_router"]["usage"]     # share of top-k assignments
    report.domains["code"].routing_summary["ffn"]["changed"]           # stability, mean over layers

The statistics are evaluation's (metrics.RoutingAccumulator, docs/routing-metrics.md defines them)
over the same windows as `bam-surgery eval`, and only ModelOutput.routing is read (gates, probs, topk),
never router weights, so every router kind is measured the same way. Stability: the same token windows
go through `compare`; per router, `changed` is the share of tokens whose top-1 expert (metrics.top1_expert)
differs between the two checkpoints. The checkpoints are loaded one after the other (one model in memory
at a time); between the passes each router keeps one int16 top-1 per token.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bam_surgery.converters import open_checkpoint
from bam_surgery.runtime.text import render_table

from .checkpoints import resolve_checkpoint
from .data import parse_data_spec
from .distributed import pick_device
from .errors import TrainError
from .evaluation import (DomainResult, EvalReport, check_seq_len, evaluate_streams, load_model_for_eval,
                         load_streams)
from .metrics import summarize_routing, top1_expert

# Up to this many experts a table has one column per expert; past it, a summary per layer.
MAX_EXPERT_COLUMNS = 12
KINDS = (("ffn", "FFN routers: share of top-k assignments", "usage"),
         ("attn", "attention routers: mean gate", "mean_gate"))


ROUTER_NAME = re.compile(r"^layers\.(\d+)\.(ffn|attn)_router$")


def router_kind(router: str) -> str:
    """'layers.3.attn_router' -> 'attn'; every other router counts as an FFN router."""
    return "attn" if router.endswith("attn_router") else "ffn"


def router_layer(router: str) -> int | None:
    m = ROUTER_NAME.match(router)
    return int(m.group(1)) if m else None


@dataclass
class RoutingReport(EvalReport):
    """eval's report with the stability comparison: `compare` is the second checkpoint (or None)."""
    compare: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "compare": self.compare}

    def by_layer(self, domain: str, kind: str) -> list[tuple[int | None, str, dict[str, Any]]]:
        """[(layer, router name, statistics)] of one kind of router on one domain, in layer order."""
        rows = [(router_layer(n), n, s) for n, s in self.domains[domain].routing.items() if router_kind(n) == kind]
        return sorted(rows, key=lambda r: (r[0] is None, r[0] or 0, r[1]))

    def table(self) -> str:
        """The report as `bam-surgery routing-stats` prints it (render_routing)."""
        return render_routing(self)


class _Top1Recorder:
    """on_routing hook of evaluate_streams: each router's top-1 experts, in order, per domain."""

    def __init__(self):
        self.top1: dict[str, dict[str, list[torch.Tensor]]] = {}

    def __call__(self, domain: str, routing: dict) -> None:
        per_router = self.top1.setdefault(domain, {})
        for name, r in routing.items():
            per_router.setdefault(name, []).append(top1_expert(r).detach().reshape(-1).to("cpu", torch.int16))

    def joined(self) -> dict[str, dict[str, torch.Tensor]]:
        return {d: {n: torch.cat(v) for n, v in rs.items()} for d, rs in self.top1.items()}


def top1_changes(first: dict[str, dict[str, torch.Tensor]], second: dict[str, dict[str, torch.Tensor]]
                 ) -> dict[str, dict[str, float]]:
    """{domain: {router: share of tokens whose top-1 expert differs}} from two recordings of the same
    tokens."""
    out: dict[str, dict[str, float]] = {}
    for domain, routers in first.items():
        other = second.get(domain, {})
        if set(other) != set(routers):
            raise TrainError(f"--compare: the routers differ on domain {domain!r}: "
                             f"{sorted(set(routers) ^ set(other))[:4]}")
        out[domain] = {}
        for name, a in routers.items():
            b = other[name]
            if a.shape != b.shape:  # same windows through both: a mismatch is a bug, not a user error
                raise AssertionError(f"{name}: {tuple(a.shape)} vs {tuple(b.shape)} tokens")
            out[domain][name] = round(float((a != b).double().mean()), 6) if a.numel() else 0.0
    return out


def require_mixture(spec: str, cfg) -> None:
    if not cfg.is_mixture:
        raise TrainError(f"{spec}: has no routers (a dense model: ffn_experts and attn_experts are 0); "
                         "routing-stats measures mixtures")


def check_comparable(first, second, first_spec: str, second_spec: str) -> None:
    """Two configs whose routers can be compared token for token: same vocabulary, layers, experts."""
    for field, what in (("vocab_size", "vocabulary"), ("n_layers", "layer count"),
                        ("ffn_experts", "FFN expert count"), ("attn_experts", "attention expert count")):
        a, b = getattr(first, field), getattr(second, field)
        if a != b:
            raise TrainError(f"--compare {second_spec}: its {what} ({field} {b}) differs from {first_spec}'s "
                             f"({a}); stability needs the same tokens through the same routers")


def routing_stats(checkpoint: str, data: str, *, compare: str | None = None, tokenizer: str | None = None,
                  eos_id: int | None = None, seq_len: int | None = None, batch_size: int = 8,
                  max_tokens: int = 0, text_field: str = "text", token_cache: str | Path | None = None,
                  device: str = "auto", precision: str = "auto", split: str = "val") -> RoutingReport:
    """Routing statistics of a mixture checkpoint on the `split` of each domain of `data` (a SPEC),
    per router (per layer and kind) and as means over layers; with `compare`, the stability of each
    router's top-1 choice against a second checkpoint of the same shape (same tokens through both)."""
    parse_data_spec(data)  # a bad SPEC is reported before any weights are read
    dev = pick_device(device)
    loaded = load_model_for_eval(checkpoint, dev, tokenizer=tokenizer, eos_id=eos_id, check_config=require_mixture)
    cfg = loaded.config
    T = check_seq_len(seq_len, cfg)
    if compare is not None:  # refuse an incomparable pair before the long pass
        compare_spec = resolve_checkpoint(compare)
        with open_checkpoint(compare_spec) as other:
            check_comparable(cfg, other.config, loaded.spec, compare_spec)
    streams = load_streams(data, loaded.tokenizer, split, text_field, token_cache)
    empty = [name for name, s in streams.items() if len(s) < 2]
    if empty:
        raise TrainError(f"--data: domain {empty[0]!r} ({split} split) has fewer than 2 tokens; nothing to route")

    recorder = _Top1Recorder() if compare is not None else None
    bos_id = loaded.tokenizer.bos_id  # both models read the windows as this tokenizer's (packing.window_inputs)
    results = evaluate_streams(loaded.model, streams, T, batch_size, max_tokens, dev, precision,
                               expert_names=loaded.expert_names, on_routing=recorder, bos_id=bos_id)
    loaded.model = None  # one model in memory at a time
    compare_spec = None
    if compare is not None:
        second = load_model_for_eval(compare, dev, with_tokenizer=False)
        compare_spec = second.spec
        recorder2 = _Top1Recorder()
        evaluate_streams(second.model, streams, T, batch_size, max_tokens, dev, precision, on_routing=recorder2,
                         bos_id=bos_id)
        second.model = None
        changed = top1_changes(recorder.joined(), recorder2.joined())
    else:
        changed = {}
    add_stability(results, changed)
    return RoutingReport(loaded.spec, loaded.tokenizer.name, T, results, loaded.expert_names, compare=compare_spec)


def add_stability(results: dict[str, DomainResult], changed: dict[str, dict[str, float]]) -> None:
    """Put each router's `changed` share into its statistics and the per-kind means into the summary
    (None everywhere when there was no comparison)."""
    for domain, r in results.items():
        for router, stats in r.routing.items():
            stats["changed"] = changed.get(domain, {}).get(router)
        r.routing_summary = summarize_routing(r.routing)
        for summary in r.routing_summary.values():
            summary.setdefault("changed", None)


# ---- the tables `bam-surgery routing-stats` prints ------------------------------------------------------
def render_routing(report: RoutingReport) -> str:
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
