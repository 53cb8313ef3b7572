"""Routing statistics, FLOP and MFU estimates, and the metrics.jsonl writer.

Routing statistics per router, over the tokens seen (docs/routing-metrics.md defines them; `eval`,
`routing-stats` and the training log all compute them here):
    usage      share of the routing assignments per expert: top-k routers count each (token, slot)
               choice (shares sum to 1); soft routers and forced gates count each token's gates
               (the mean gate per expert, normalised to sum 1)
    mean_gate  mean gate actually applied per expert (zeros for unselected experts)
    used       experts whose usage is > 0 (top-k: chosen at least once), and used_percent = 100 used / E
    entropy    of the usage distribution, in bits; entropy_max = log2 E (perfectly balanced; 0: one expert)
    token_entropy  mean per-token entropy of the full softmax, in bits (how sure the router is)
    gini       Gini coefficient of usage, sorted formula (0 balanced, (E-1)/E one expert)
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import torch

from bam_surgery.runtime.atomic import write_text_atomic
from bam_surgery.runtime.config import ModelConfig
from bam_surgery.runtime.jsonfile import iter_jsonl
from bam_surgery.runtime.layout import tensor_shapes

from .errors import TrainError

# Dense bf16 peak TFLOP/s of one device, by a substring of torch.cuda.get_device_name().
PEAK_BF16_TFLOPS = (("H200", 989.0), ("H100", 989.0), ("GH200", 989.0), ("A100", 312.0), ("L40S", 362.0),
                    ("L4", 121.0), ("A10G", 125.0), ("A10", 125.0), ("V100", 125.0), ("RTX 4090", 165.0),
                    ("RTX 3090", 71.0))


def entropy_bits(p: torch.Tensor) -> float:
    """Shannon entropy in bits of a distribution given by non-negative weights (normalised here)."""
    p = p.double()
    p = p / p.sum() if float(p.sum()) > 0 else p
    nz = p[p > 0]
    return float(-(nz * nz.log2()).sum()) if nz.numel() else 0.0


def gini(u: torch.Tensor) -> float:
    """Gini coefficient of non-negative weights u_1..u_E, sorted ascending (u_(1) <= ... <= u_(E)):
    G = sum_i (2i - E - 1) u_(i) / (E sum_i u_i), i = 1..E; equal to the mean absolute difference
    sum_ij |u_i - u_j| / (2 E sum_i u_i) in O(E log E). 0 when all are equal, (E-1)/E when one
    expert has everything; 0 for all-zero weights."""
    u = u.double().reshape(-1)
    total = float(u.sum())
    if total <= 0:
        return 0.0
    E = u.numel()
    rank = torch.arange(1, E + 1, dtype=torch.float64)
    return float(((2 * rank - E - 1) * u.sort().values).sum() / (E * total))


def experts_used(usage: torch.Tensor) -> int:
    """Experts with usage > 0 (no threshold: an expert chosen for one token counts as used)."""
    return int((usage > 0).sum())


def top1_expert(routing) -> torch.Tensor:
    """[N] each token's top-1 expert: the first top-k choice (the highest probability), else (soft or
    forced gates) the largest gate, the lowest index among ties."""
    if routing.topk is not None:
        return routing.topk[:, 0]
    return routing.gates.argmax(-1)


class RoutingAccumulator:
    """Sums, per router, what the statistics above need; `add(out.routing)` after each forward.

    Each router's sums are one float64 vector on the routing's device, [assign (E), gates (E),
    token entropy, tokens, tokens with probabilities], so adding never waits for the device and one
    all-reduce adds every process's sums (evaluation.reduce_routing)."""

    def __init__(self):
        self.sums: dict[str, torch.Tensor] = {}

    def add(self, routing: dict, count: bool = True) -> None:
        """Add a forward pass's routing; count=False only registers the routers (with zero sums), so
        that every process reduces the same routers."""
        for name, r in routing.items():
            gates = r.gates.detach()  # [N, E]
            E = gates.shape[-1]
            v = self.sums.get(name)
            if v is None:
                v = self.sums[name] = torch.zeros(2 * E + 3, dtype=torch.float64, device=gates.device)
            if not count:
                continue
            if r.topk is not None:
                v[:E] += torch.bincount(r.topk.detach().reshape(-1), minlength=E).double()
            else:
                v[:E] += gates.double().sum(0)
            v[E:2 * E] += gates.double().sum(0)
            v[2 * E + 1] += gates.shape[0]
            if r.probs is not None:
                p = r.probs.detach().double()
                v[2 * E] += -(p * p.clamp_min(1e-300).log2()).sum()
                v[2 * E + 2] += p.shape[0]

    def assignments(self) -> dict[str, torch.Tensor]:
        """Router -> assignment counts (or summed soft gates) per expert, on the CPU."""
        return {name: v[:(len(v) - 3) // 2].cpu() for name, v in self.sums.items()}

    def stats(self, names: dict[str, list[str]] | None = None) -> dict[str, dict[str, Any]]:
        """Per router: usage, mean_gate, entropy, token_entropy, gini; experts named if `names`
        maps "ffn"/"attn" to expert names."""
        out = {}
        for router, v in self.sums.items():
            v = v.cpu()
            E = (len(v) - 3) // 2
            assign, gates = v[:E], v[E:2 * E]
            token_entropy, tokens, with_probs = float(v[2 * E]), int(v[2 * E + 1]), int(v[2 * E + 2])
            usage = assign / assign.sum() if float(assign.sum()) > 0 else assign
            kind = "attn" if router.endswith("attn_router") else "ffn"
            labels = (names or {}).get(kind) or [f"expert{e}" for e in range(E)]
            used = experts_used(usage)
            out[router] = {
                "experts": list(labels[:E]),
                "usage": [round(float(u), 6) for u in usage],
                "mean_gate": [round(float(g), 6) for g in gates / max(1, tokens)],
                "used": used,
                "used_percent": round(100.0 * used / E, 4),
                "entropy": round(entropy_bits(assign), 6),
                "entropy_max": round(math.log2(E), 6),
                "token_entropy": round(token_entropy / with_probs, 6) if with_probs else None,
                "gini": round(gini(usage), 6),
                "tokens": tokens,
            }
        return out


def summarize_routing(per_router: dict[str, dict]) -> dict[str, Any]:
    """Means over layers, per kind: FFN expert shares, attention mean gates, experts used, entropy
    (and its maximum log2 E), Gini, and `changed` (stability) when every router has it."""
    out: dict[str, Any] = {}
    for kind, suffix, key in (("ffn", "ffn_router", "usage"), ("attn", "attn_router", "mean_gate")):
        rs = [r for n, r in per_router.items() if n.endswith(suffix)]
        if not rs:
            continue
        E = len(rs[0][key])
        out[kind] = {
            "experts": rs[0]["experts"],
            "share" if kind == "ffn" else "mean_gate": [round(sum(r[key][e] for r in rs) / len(rs), 6)
                                                       for e in range(E)],
            "used": round(sum(r["used"] for r in rs) / len(rs), 4),
            "entropy_bits": round(sum(r["entropy"] for r in rs) / len(rs), 6),
            "entropy_max_bits": round(math.log2(E), 6),
            "gini": round(sum(r["gini"] for r in rs) / len(rs), 6),
        }
        if all(r.get("changed") is not None for r in rs):
            out[kind]["changed"] = round(sum(r["changed"] for r in rs) / len(rs), 6)
        te = [r["token_entropy"] for r in rs if r["token_entropy"] is not None]
        if te:
            out[kind]["token_entropy_bits"] = round(sum(te) / len(te), 6)
    return out


# ---- FLOPs ------------------------------------------------------------------------------------
def active_matmul_params(cfg: ModelConfig) -> int:
    """Parameters a token multiplies through: every matrix except the input embedding lookups,
    FFN experts scaled by top_k / E, attention experts by (top_k or E) / E (soft: all run)."""
    total = 0.0
    for name, shape in tensor_shapes(cfg).items():
        n = math.prod(shape)
        if name.startswith(("embed.", "pos_embed.")) or len(shape) < 2:
            continue
        if ".ffn_experts." in name:
            n = n * cfg.ffn_top_k / cfg.ffn_experts
        elif ".attn_experts." in name and cfg.attn_top_k is not None:
            n = n * cfg.attn_top_k / cfg.attn_experts
        total += n
    if cfg.tie_embeddings:  # the LM head is the embedding matrix
        total += cfg.vocab_size * cfg.d_model
    return int(total)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward, PaLM's appendix-B estimate): 6 * active matmul
    parameters + 12 * layers * T * (query width), the latter times the attention experts a token
    runs."""
    attn_runs = (cfg.attn_top_k or cfg.attn_experts) if cfg.attn_experts else 1
    return 6.0 * active_matmul_params(cfg) + 12.0 * cfg.n_layers * seq_len * cfg.q_dim * attn_runs


def peak_flops(device: torch.device, precision: str, override_tflops: float | None) -> float | None:
    """Peak FLOP/s of one device for MFU: the override, else known GPUs in bf16; None otherwise."""
    if override_tflops:
        return override_tflops * 1e12
    if device.type != "cuda" or precision != "bf16":
        return None
    name = torch.cuda.get_device_name(device)
    for key, tflops in PEAK_BF16_TFLOPS:
        if key in name:
            return tflops * 1e12
    return None


# ---- metrics.jsonl ----------------------------------------------------------------------------
class MetricsWriter:
    """Appends one JSON object per line and flushes it (a crash loses at most the current line)."""

    def __init__(self, path: Path, enabled: bool = True):
        self.path, self.enabled = Path(path), enabled
        self._f = open(self.path, "a", encoding="utf-8") if enabled else None

    def write(self, record: dict[str, Any]) -> None:
        if self._f is not None:
            try:
                self._f.write(json.dumps(record, separators=(",", ":")) + "\n")
                self._f.flush()
            except OSError as e:  # a full disk: the error names the file (write(2) does not)
                raise OSError(e.errno, e.strerror, str(self.path)) from None

    def close(self) -> None:
        f, self._f = self._f, None
        if f is not None:
            try:
                f.close()
            except OSError as e:
                raise OSError(e.errno, e.strerror, str(self.path)) from None


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Every complete record of a metrics.jsonl (a torn last line, from a crash, is skipped), each an object
    with an integer step; any other line (a list, null, a string step, nested or huge, not UTF-8) is a
    TrainError naming the line, as is a metrics.jsonl that is not a regular file (a FIFO used to hang a
    resume, a 4 GB sparse file to exhaust memory: lines are read one at a time, each bounded)."""
    out = []
    if not os.path.lexists(path):
        return out
    for where, rec in iter_jsonl(path, error=TrainError, max_line=MAX_LINE, torn_last=True, allow_nan=True):
        if not isinstance(rec, dict):
            raise _bad(where, f"a JSON {type(rec).__name__}, not an object")
        _step_of(rec, where)
        out.append(rec)
    return out


# Bounds of what a plot reads: a step count and a value a run can log, and a line no run writes longer.
MAX_STEP = 10**15
MAX_VALUE = 1e30
MAX_LINE = 1 << 20


def read_curves(path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The training and evaluation points of a metrics.jsonl, checked, for `plot`:
    train: [{"step": int, "loss": float, "nll": float, "lr": float}] (nll defaults to loss);
    eval:  [{"step": int, "domains": {name: loss}}].
    A torn last line (a crash while writing it) is skipped; any other line that is not such a record
    (not JSON, not an object, a step or value of the wrong type, nested past json's recursion limit) is
    a TrainError naming the line. Values beyond +-MAX_VALUE, NaN and infinities are drawn as gaps."""
    path = Path(path)
    train: list[dict[str, Any]] = []
    evals: list[dict[str, Any]] = []
    if not os.path.lexists(path):
        return train, evals
    for where, rec in iter_jsonl(path, error=TrainError, max_line=MAX_LINE, torn_last=True, allow_nan=True):
        if not isinstance(rec, dict):
            raise _bad(where, f"a JSON {type(rec).__name__}, not an object")
        kind = rec.get("kind")
        if kind == "train":
            loss = _value(rec, "loss", where)
            nll = _value(rec, "nll", where) if "nll" in rec else loss
            train.append({"step": _step_of(rec, where), "loss": loss, "nll": nll, "lr": _value(rec, "lr", where)})
        elif kind == "eval":
            domains = rec.get("domains")
            if not isinstance(domains, dict):
                raise _bad(where, f"an eval record whose domains is {_shown(domains)}, not an object")
            losses = {}
            for name, d in domains.items():
                if not isinstance(d, dict):
                    raise _bad(where, f"eval domain {_shown(name)} is {_shown(d)}, not an object")
                losses[name] = _value(d, "loss", where, f"eval domain {_shown(name)}: ")
            evals.append({"step": _step_of(rec, where), "domains": losses})
    return train, evals


def _bad(where: str, what: str):
    return TrainError(f"{where}: {what}; not a metrics.jsonl bam-surgery train writes")


def _shown(v: Any) -> str:
    text = json.dumps(v)[:40] if not isinstance(v, (dict, list)) else type(v).__name__
    return text if v is not None else "missing"


def _step_of(rec: dict, where: str) -> int:
    step = rec.get("step")
    if type(step) is not int or not 0 <= step <= MAX_STEP:
        kind = rec.get("kind") if rec.get("kind") in ("train", "eval") else "metrics"
        raise _bad(where, f"a {kind} record whose step is {_shown(step)}, not a whole number from 0 to "
                          f"{MAX_STEP}")
    return step


def _value(rec: dict, key: str, where: str, prefix: str = "") -> float:
    v = rec.get(key)
    if type(v) not in (int, float):
        raise _bad(where, f"{prefix}{key} is {_shown(v)}, not a number")
    try:
        v = float(v)
    except OverflowError:  # an integer past the float range
        return math.nan
    return v if abs(v) <= MAX_VALUE else math.nan


def truncate_metrics(path: Path, last_step: int) -> None:
    """Keep only records up to `last_step` (a resumed run re-logs the steps after its checkpoint)."""
    path = Path(path)
    if not os.path.lexists(path):  # anything else there (a FIFO, a folder) is read_metrics' error, not skipped
        return
    keep = [r for r in read_metrics(path) if r["step"] <= last_step]
    write_text_atomic(path, "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in keep))
