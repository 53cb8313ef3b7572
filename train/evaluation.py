"""Per-domain held-out loss, perplexity and routing statistics.

    report = evaluate("run/checkpoints/step-00000200", "code=data/domains/code,law=data/domains/law")
    report.domains["code"].loss, report.domains["code"].perplexity, report.domains["code"].routing

Each domain's held-out token stream is cut into consecutive windows of seq_len + 1 tokens that
overlap by one (packing.eval_windows): every token but the first is predicted exactly once, with
as much context as the window gives; a window's first input is the tokenizer's beginning-of-sequence
token where it has one (Gemma's, Llama's <bos>), as in training. loss = (sum of next-token NLL) / (tokens predicted), in nats;
perplexity = exp(loss). Routing statistics (metrics.py) are over the same tokens.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch import nn
import tqdm  # called as tqdm.tqdm, so that tests can replace the bar class

from bam_surgery.converters import open_checkpoint
from bam_surgery.runtime import model_from_reader
from bam_surgery.runtime.text import render_table

from .checkpoints import resolve_checkpoint
from .data import parse_data_spec, open_source
from .distributed import Dist, all_sum, pick_device
from .errors import TrainError
from .metrics import RoutingAccumulator, summarize_routing
from .packing import eval_windows, window_inputs
from .progress import ProgressLines
from .provenance import expert_names, read_provenance
from .tokenize import resolve_tokenizer, token_cache_folder, tokenize_source


@dataclass
class DomainResult:
    name: str
    tokens: int
    loss: float
    perplexity: float
    routing: dict[str, dict[str, Any]] = field(default_factory=dict)  # per router (metrics.py)
    routing_summary: dict[str, Any] = field(default_factory=dict)  # means over layers

    def to_dict(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "loss": self.loss, "perplexity": self.perplexity,
                "routing": self.routing_summary, "routers": self.routing}


@dataclass
class EvalReport:
    checkpoint: str
    tokenizer: str
    seq_len: int
    domains: dict[str, DomainResult]
    experts: dict[str, list[str]] = field(default_factory=dict)
    separator: str = ""  # the document separator and why (tokenize: eos_reason)

    def to_dict(self) -> dict[str, Any]:
        return {"checkpoint": self.checkpoint, "tokenizer": self.tokenizer, "separator": self.separator,
                "seq_len": self.seq_len, "experts": self.experts, "domains": {n: d.to_dict() for n, d in self.domains.items()}}

    def table(self) -> str:
        """The report as `bam-surgery eval` prints it: the domains' loss and perplexity, and the routing means."""
        out = [f"checkpoint  {self.checkpoint}", f"tokenizer   {self.tokenizer}, windows of {self.seq_len}",
               *([f"separator   {self.separator}"] if self.separator else []), ""]
        rows = [(n, r.tokens, f"{r.loss:.4f}", f"{r.perplexity:.3f}") for n, r in self.domains.items()]
        out.append(render_table(("domain", "tokens", "loss", "perplexity"), rows))
        for kind, title, key in (("ffn", "FFN experts: share of tokens", "share"),
                                 ("attn", "attention experts: mean gate", "mean_gate")):
            names = self.experts.get(kind)
            if not names:
                continue
            rows = []
            for n, r in self.domains.items():
                s = r.routing_summary.get(kind)
                if s:
                    rows.append((n, *[f"{v:.3f}" for v in s[key]], f"{s['used']:g}/{len(names)}",
                                 f"{s['entropy_bits']:.3f}", f"{s['gini']:.3f}"))
            out += ["", f"{title} (mean over layers; entropy in bits, max {_log2(len(names)):.3f})",
                    render_table(("domain", *names, "used", "entropy", "gini"), rows)]
        return "\n".join(out)


def _log2(n: int) -> float:
    return math.log2(n) if n else 0.0


def autocast(device: torch.device, precision: str):
    """bf16 autocast for precision bf16 (auto means bf16 on CUDA, fp32 on CPU)."""
    use = precision == "bf16" or (precision == "auto" and device.type == "cuda")
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=use)


@torch.no_grad()
def evaluate_streams(model: nn.Module, streams: dict[str, np.ndarray], seq_len: int, batch_size: int = 8,
                     max_tokens: int = 0, device: torch.device | None = None, precision: str = "auto",
                     routing=None, expert_names: dict[str, list[str]] | None = None,
                     d: Dist | None = None, on_routing=None, progress: bool = False,
                     bos_id: int | None = None) -> dict[str, DomainResult]:
    """Evaluate a model on tokenized streams {domain: 1-D token array}; each window's first input is bos_id
    where given (the tokenizer's beginning-of-sequence token: packing.window_inputs).

    on_routing(domain, out.routing), if given, sees every counted forward pass in order (routing_report
    records the top-1 choices with it). progress: a bar on stderr over the forward passes of every
    domain (the main process's), removed when done.

    Under torchrun every process runs the same number of forward passes (FSDP needs it): batch i
    goes to process i mod world, a process with nothing left in the last round runs a batch whose
    result it discards, and the sums are added over processes."""
    d = d or Dist(device=device or next(model.parameters()).device)
    device = device or d.device
    was_training = model.training
    model.eval()
    results = {}
    plan = {name: group_windows(eval_windows(tokens, seq_len, max_tokens), batch_size)
            for name, tokens in streams.items()}
    bar, ticker = _progress(sum(math.ceil(len(b) / d.world) for b in plan.values()), progress and d.is_main)
    try:
        for name, tokens in streams.items():
            batches = plan[name]
            rounds = math.ceil(len(batches) / d.world) if batches else 0
            bar.set_description(f"eval {name}", refresh=False)
            nll_sum = torch.zeros((), dtype=torch.float64, device=device)  # on the device: no sync per batch
            count = torch.zeros((), dtype=torch.float64, device=device)
            acc = RoutingAccumulator()
            for r in range(rounds):
                i = r * d.world + d.rank
                real = i < len(batches)
                wins = batches[i if real else 0]
                seq = torch.stack([torch.from_numpy(np.asarray(tokens[s:e], dtype=np.int64)) for s, e in wins])
                inputs, targets = window_inputs(seq, bos_id).to(device), seq[:, 1:].to(device)
                with autocast(device, precision):  # the chunked loss head: no [B, T, V] logits held
                    out = model(inputs, targets=targets, routing=routing, return_logits=False)
                nll = out.nll.float() * targets.numel()  # the mean over every target (none ignored here) -> the sum
                if real:
                    nll_sum += nll.double()
                    count += targets.numel()
                    if on_routing is not None:
                        on_routing(name, out.routing)
                acc.add(out.routing, count=real)
                bar.update(1)
                ticker.tick(detail=name)
            sums = all_sum(d, torch.stack([nll_sum, count])).cpu()
            acc = reduce_routing(acc, d)
            n = int(sums[1])
            loss = float(sums[0] / n) if n else float("nan")
            per_router = acc.stats(expert_names)
            results[name] = DomainResult(name, n, loss, math.exp(loss) if n else float("nan"), per_router,
                                         summarize_routing(per_router))
    finally:
        bar.close()
        model.train(was_training)
    return results


def group_windows(windows: list[tuple[int, int]], batch_size: int) -> list[list[tuple[int, int]]]:
    """Batches of equal-length windows (the last, shorter window gets a batch of its own)."""
    full = [w for w in windows if w[1] - w[0] == windows[0][1] - windows[0][0]] if windows else []
    rest = windows[len(full):]
    out = [full[i:i + batch_size] for i in range(0, len(full), batch_size)]
    return out + [[w] for w in rest]


def reduce_routing(acc: RoutingAccumulator, d: Dist) -> RoutingAccumulator:
    """Add the routing sums of every process (one all-reduce of the concatenated vectors)."""
    if not d.active or not acc.sums:  # every process ran the same forward passes: same routers (or none)
        return acc
    names = sorted(acc.sums)
    flat = all_sum(d, torch.cat([acc.sums[n].to(d.device) for n in names]))
    k = 0
    for n in names:
        size = len(acc.sums[n])
        acc.sums[n] = flat[k:k + size].clone()
        k += size
    return acc


@dataclass
class LoadedModel:
    """A checkpoint opened for evaluation: the resolved spec, its config, the fp32 model on its device,
    its expert names and (when asked for) its tokenizer."""
    spec: str
    config: Any  # runtime.ModelConfig
    model: nn.Module
    expert_names: dict[str, list[str]]
    tokenizer: Any = None  # tokenize.Tokenizer


def load_model_for_eval(checkpoint: str, device: torch.device, *, tokenizer: str | None = None,
                        eos_id: int | None = None, with_tokenizer: bool = True,
                        check_config: Callable[[str, Any], None] | None = None) -> LoadedModel:
    """Open a checkpoint (anything open_checkpoint accepts, or a run folder: its latest checkpoint),
    resolve its tokenizer (tokenize.resolve_tokenizer's rules) and load its weights as fp32.
    check_config(spec, config), if given, may refuse the model before any weight is read."""
    spec = resolve_checkpoint(checkpoint)
    with open_checkpoint(spec) as reader:
        cfg = reader.config
        if check_config is not None:
            check_config(spec, cfg)
        tok = resolve_tokenizer(tokenizer, reader, cfg.vocab_size, eos_id) if with_tokenizer else None
        names = expert_names(read_provenance(reader.metadata), cfg)
        # the layout is checked first, so a checkpoint that contradicts its config fails with one line
        model = model_from_reader(reader, device, torch.float32)
    return LoadedModel(spec, cfg, model, names, tok)


def check_seq_len(seq_len: int | None, cfg) -> int:
    """The window length: seq_len, or the model's max_positions; longer than that is an error."""
    T = seq_len or cfg.max_positions
    if T > cfg.max_positions:
        raise TrainError(f"seq_len {T} exceeds the model's max_positions ({cfg.max_positions})")
    return T


def load_streams(data: str, tok, split: str = "val", text_field: str = "text",
                 token_cache: str | Path | None = None) -> dict[str, np.ndarray]:
    """{domain: token stream} of the `split` of each domain of a SPEC, through the token cache."""
    domains = parse_data_spec(data)
    cache = token_cache_folder(token_cache)
    return {dom.name: tokenize_source(open_source(dom, split, text_field), tok, cache).tokens for dom in domains}


def _progress(total: int, shown: bool):
    """A bar on a terminal, else a line now and then (train/progress.py): (bar, ticker), one of them disabled."""
    terminal = sys.stderr.isatty()
    bar = tqdm.tqdm(total=total, desc="eval", unit="batch", leave=False, dynamic_ncols=True, file=sys.stderr,
                    disable=not (shown and terminal))
    return bar, ProgressLines("eval batches", total, enabled=shown and not terminal)


def evaluate(checkpoint: str, data: str, *, tokenizer: str | None = None, eos_id: int | None = None,
             seq_len: int | None = None, batch_size: int = 8, max_tokens: int = 0, text_field: str = "text",
             token_cache: str | Path | None = None, device: str = "auto", precision: str = "auto",
             split: str = "val", routing=None, progress: bool = False) -> EvalReport:
    """Evaluate a checkpoint (anything open_checkpoint accepts, or a run folder: its latest
    checkpoint) on the held-out split of each domain of `data` (a domain SPEC). progress: a bar on
    stderr while the windows run (the CLI shows it when stderr is a terminal)."""
    parse_data_spec(data)  # a bad SPEC is reported before the weights are read
    dev = pick_device(device)
    loaded = load_model_for_eval(checkpoint, dev, tokenizer=tokenizer, eos_id=eos_id)
    T = check_seq_len(seq_len, loaded.config)
    streams = load_streams(data, loaded.tokenizer, split, text_field, token_cache)
    results = evaluate_streams(loaded.model, streams, T, batch_size, max_tokens, dev, precision, routing,
                               loaded.expert_names, progress=progress, bos_id=loaded.tokenizer.bos_id)
    return EvalReport(loaded.spec, loaded.tokenizer.name, T, results, loaded.expert_names,
                      loaded.tokenizer.eos_reason)
