"""Parameter audit from shapes alone: total and active counts, by group, in two conventions.

Counts come from `runtime.layout.tensor_shapes(cfg)` or from a checkpoint header (never from tensor
data), so auditing a 2B mixture costs nothing. Every canonical tensor gets a TensorCount:

    total   numel of the tensor
    active  what one token runs:
            FFN experts [E, ...]        numel / E * ffn_top_k        (top-k routing)
            attention experts [E, ...]  numel                         (soft routing: every expert runs)
                                        numel / E * attn_top_k        (top-k routing)
            everything else             numel (routers run for every token; embeddings count whole,
                                        as in the paper)
    Buffers (router state that gradients do not train, runtime/routers.py RouterTensor.buffer, e.g. a key
    store) are not parameters: they are left out of the totals, the groups and Table 5, and counted apart
    (Audit.buffers).
    trainable  the parameters that `train --trainable PATTERNS` trains (the SoME presets freeze their experts)

Conventions:
    exact   the counts above.
    paper   exact, then the named deviations in PAPER_DEVIATIONS: the ones that make the BAM paper's
            Table 5 come out to the parameter. Each applied deviation is returned as an Adjustment with
            its size, so a paper-convention audit always says how far it is from the exact one.
            docs/param-counting.md walks through the numbers.
"""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from bam_surgery.runtime.config import ModelConfig
from bam_surgery.runtime.dtypes import dtype_name, nbytes
from bam_surgery.runtime.layout import (GROUPS, Mismatch, Shape, buffer_names, layout_mismatches,
                                        tensor_group, tensor_shapes)
from bam_surgery.train.optim import select_trainable
from bam_surgery.runtime.reader import Reader

CONVENTIONS = ("exact", "paper")

# layers.{i}.{module}[.{proj}].{weight|bias}, or a top-level {module}.{weight|bias}
_CANONICAL = re.compile(
    r"^(?:layers\.(?P<layer>\d+)\.)?(?P<module>[a-z_]+)(?:\.(?P<proj>[a-z_]+))?\.(?P<param>weight|bias)$"
    # router tensors of any kind: layers.{i}.ffn_router.log_temperature, ...ffn_router.hidden.bias
    r"|^layers\.(?P<rlayer>\d+)\.(?P<router>attn_router|ffn_router)\.(?P<rest>[a-z_.]+)$")


@dataclass(frozen=True)
class TensorRole:
    layer: int | None  # None for embeddings, final norm, lm_head
    module: str  # embed, attn, attn_experts, attn_router, ffn, ffn_experts, ffn_router, attn_norm, ...
    proj: str | None  # q, k, v, o, gate, up, down; None for norms, routers, embeddings
    param: str  # weight | bias


def tensor_role(name: str) -> TensorRole:
    m = _CANONICAL.match(name)
    if not m:
        raise KeyError(f"{name}: not a canonical tensor name")
    if m.group("router"):  # routers count as one module whatever their tensors (proj None)
        return TensorRole(int(m.group("rlayer")), m.group("router"), None, m.group("rest"))
    layer = m.group("layer")
    return TensorRole(int(layer) if layer is not None else None, m.group("module"), m.group("proj"),
                      m.group("param"))


# ---- per-tensor counts ----------------------------------------------------------------------
@dataclass(frozen=True)
class TensorCount:
    name: str
    group: str  # one of runtime.layout.GROUPS
    shape: Shape
    total: int
    active: int
    dtype: str | None = None  # from a checkpoint header; None when audited from a config
    nbytes: int | None = None
    buffer: bool = False  # not a parameter (not trained by gradient): outside the totals


def _active(cfg: ModelConfig, group: str, shape: Shape) -> int:
    numel = math.prod(shape)
    if group == "ffn_experts":
        return numel // shape[0] * min(cfg.ffn_top_k, shape[0])
    if group == "attention_experts" and cfg.attn_top_k is not None:
        return numel // shape[0] * min(cfg.attn_top_k, shape[0])
    return numel


def exact_count(cfg: ModelConfig, name: str, shape: Shape, dtype: str | None = None,
                nbytes: int | None = None, buffer: bool = False) -> TensorCount:
    group = tensor_group(name)
    return TensorCount(name, group, tuple(shape), math.prod(shape), _active(cfg, group, shape), dtype, nbytes,
                       buffer)


# ---- the paper's convention: named deviations from exact ------------------------------------
@dataclass(frozen=True)
class PaperDeviation:
    """A place where the paper's Table 5 counts differ from exact: matching tensors are left out of
    the active count (the table's totals are exact; only its active column deviates)."""

    key: str
    applies: Callable[[ModelConfig], bool]
    selects: Callable[[TensorRole], bool]
    explanation: str


PAPER_DEVIATIONS: tuple[PaperDeviation, ...] = (
    PaperDeviation(
        key="attention_router_not_active",
        applies=lambda cfg: cfg.attn_experts > 0,
        selects=lambda r: r.module == "attn_router",
        explanation=("the paper's Table 5 counts both routers of a BAM block (FFN and attention) in "
                     "the total but only one in the active count ('router / Block'): the attention "
                     "router is left out of active parameters"),
    ),
    PaperDeviation(
        key="shared_kv_not_active",
        applies=lambda cfg: cfg.attn_experts > 0 and cfg.kv_mode == "shared",
        selects=lambda r: r.module == "attn" and r.proj in ("k", "v"),
        explanation=("the paper's Table 5 'BAM (KV sharing)' column counts only the experts' query "
                     "projections in 'qkv_proj / Block': the shared K and V projections, which every "
                     "token runs, are in its total but left out of its active count"),
    ),
)


@dataclass(frozen=True)
class Adjustment:
    """One applied deviation: how the paper convention moved the counts away from exact."""

    key: str
    explanation: str
    group: str
    tensors: int
    total_delta: int
    active_delta: int

    def to_dict(self) -> dict[str, Any]:
        return dict(key=self.key, explanation=self.explanation, group=self.group, tensors=self.tensors,
                    total_delta=self.total_delta, active_delta=self.active_delta)


def apply_paper_deviations(cfg: ModelConfig, counts: list[TensorCount]
                           ) -> tuple[list[TensorCount], list[Adjustment]]:
    adjusted = list(counts)
    adjustments: list[Adjustment] = []
    for dev in PAPER_DEVIATIONS:
        if not dev.applies(cfg):
            continue
        by_group: dict[str, list[int]] = {}  # group -> indices of selected tensors
        for i, c in enumerate(adjusted):
            if dev.selects(tensor_role(c.name)):
                by_group.setdefault(c.group, []).append(i)
        for group, idx in by_group.items():
            delta = -sum(adjusted[i].active for i in idx)
            for i in idx:
                c = adjusted[i]
                adjusted[i] = dataclasses.replace(c, active=0)
            adjustments.append(Adjustment(dev.key, dev.explanation, group, len(idx), 0, delta))
    return adjusted, adjustments


# ---- the paper's routing --------------------------------------------------------------------------
# Each token goes to 1 FFN expert, gated by its p_i from the full softmax, and to every attention expert (soft):
# Table 5's BAM and BTX top-1 columns, Table 6 (its BTX top-3 column routes to 3). count-params --convention paper
# takes these where the options leave them to the recipe (whose default routes to 2: app/params.py).
PAPER_ROUTING = {"ffn_top_k": 1, "gate_norm": "softmax", "attention_routing": "soft"}


def routing_label(cfg: ModelConfig) -> str | None:
    """The routing a mixture's count counts, in words, where it is not the paper's (PAPER_ROUTING); None where it
    is, or where nothing is routed."""
    parts = []
    if cfg.ffn_experts and cfg.ffn_top_k != PAPER_ROUTING["ffn_top_k"]:
        parts.append(f"top-{cfg.ffn_top_k} of {cfg.ffn_experts} FFN experts")
    if cfg.attn_experts and cfg.attn_top_k is not None:
        parts.append(f"top-{cfg.attn_top_k} of {cfg.attn_experts} attention experts")
    if not parts:
        return None
    paper_column = cfg.ffn_top_k == 3 and not cfg.attn_experts and len(parts) == 1
    return f"routed {', '.join(parts)}" + (", as the paper's BTX top-3 column" if paper_column else
                                           " (not the paper's: 1 FFN expert per token, every attention expert)")


# ---- Table 5 rows ---------------------------------------------------------------------------
# (label, per block?, selector). Per-block rows give layer 0's active count (all blocks have the same
# shapes); the others are whole-model. The paper's rows are active counts: its ffn_exp for BTX top-3
# is 3 experts' worth, its BAM attn_out all 4 experts' (soft routing).
TABLE5_ROWS: tuple[tuple[str, bool, Callable[[TensorRole], bool]], ...] = (
    ("layernorm / Block", True, lambda r: r.module in ("attn_norm", "ffn_norm", "attn_post_norm", "ffn_post_norm")
     or r.proj in ("q_norm", "k_norm")),
    ("attn_out / Block", True, lambda r: r.module in ("attn", "attn_experts") and r.proj == "o"),
    ("qkv_proj / Block", True, lambda r: r.module in ("attn", "attn_experts") and r.proj in ("q", "k", "v")),
    ("ffn_exp / Block", True, lambda r: r.module in ("ffn", "ffn_experts") and r.proj in ("gate", "up")),
    ("ffn_red / Block", True, lambda r: r.module in ("ffn", "ffn_experts") and r.proj == "down"),
    ("router / Block", True, lambda r: r.module in ("attn_router", "ffn_router")),
    ("input embedding", False, lambda r: r.module in ("embed", "pos_embed")),
    ("output embedding", False, lambda r: r.module == "lm_head"),
    ("layernorm", False, lambda r: r.module == "final_norm"),
)


# ---- the audit ------------------------------------------------------------------------------
@dataclass(frozen=True)
class GroupCount:
    tensors: int
    total: int
    active: int


@dataclass
class Audit:
    config: ModelConfig
    convention: str
    tensors: list[TensorCount]
    adjustments: list[Adjustment] = field(default_factory=list)
    mismatches: list[Mismatch] = field(default_factory=list)
    trainable_patterns: list[str] = field(default_factory=lambda: ["*"])  # train --trainable syntax

    @property
    def parameters(self) -> list[TensorCount]:
        return [t for t in self.tensors if not t.buffer]

    @property
    def total(self) -> int:
        return sum(t.total for t in self.parameters)

    @property
    def active(self) -> int:
        return sum(t.active for t in self.parameters)

    @property
    def buffers(self) -> GroupCount:
        """Buffer tensors (not parameters): how many, and their values (total = active = numel)."""
        bufs = [t for t in self.tensors if t.buffer]
        n = sum(t.total for t in bufs)
        return GroupCount(len(bufs), n, n)

    @property
    def trainable(self) -> int:
        """Parameters the trainable patterns select (train --trainable; a user error if one matches nothing)."""
        chosen = select_trainable([t.name for t in self.parameters], self.trainable_patterns)
        return sum(t.total for t in self.parameters if t.name in chosen)

    @property
    def groups(self) -> dict[str, GroupCount]:
        """Every group of runtime.layout.GROUPS, in that order (zeros included), parameters only (buffers are
        counted apart: `buffers`)."""
        acc = {g: [0, 0, 0] for g in GROUPS}
        for t in self.parameters:
            a = acc[t.group]
            a[0] += 1
            a[1] += t.total
            a[2] += t.active
        return {g: GroupCount(*v) for g, v in acc.items()}

    def table5(self) -> list[tuple[str, int]]:
        """The audit in the rows of the paper's Table 5 (per-block rows: active count of layer 0)."""
        rows = []
        roles = [(tensor_role(t.name), t) for t in self.parameters]
        for label, per_block, selects in TABLE5_ROWS:
            rows.append((label, sum(t.active for r, t in roles
                                    if selects(r) and (not per_block or r.layer == 0))))
        rows.append(("Active Params", self.active))
        rows.append(("Total Params", self.total))
        return rows

    def to_dict(self) -> dict[str, Any]:
        return dict(
            convention=self.convention,
            total=self.total,
            active=self.active,
            groups={g: dict(tensors=c.tensors, total=c.total, active=c.active) for g, c in self.groups.items()},
            buffers=dict(tensors=self.buffers.tensors, total=self.buffers.total),
            trainable=self.trainable,
            trainable_patterns=list(self.trainable_patterns),
            adjustments=[a.to_dict() for a in self.adjustments],
            table5={label: n for label, n in self.table5()},
            mismatches=[m.to_dict() for m in self.mismatches],
            config=self.config.to_dict(),
        )


def _finish(cfg: ModelConfig, counts: list[TensorCount], convention: str,
            mismatches: list[Mismatch], trainable: list[str] | None = None) -> Audit:
    if convention not in CONVENTIONS:
        raise ValueError(f"convention: unknown convention {convention!r}; choose one of {', '.join(CONVENTIONS)}")
    adjustments: list[Adjustment] = []
    if convention == "paper":
        counts, adjustments = apply_paper_deviations(cfg, counts)
    a = Audit(cfg, convention, counts, adjustments, mismatches, list(trainable or ["*"]))
    a.trainable  # a pattern that matches nothing is refused here, not when the audit is printed
    return a


def audit(cfg: ModelConfig, convention: str = "exact", trainable: list[str] | None = None) -> Audit:
    """Audit the model a config describes, from runtime.layout.tensor_shapes alone. trainable: patterns as
    train --trainable takes them (default: every parameter)."""
    buffers = buffer_names(cfg)
    counts = [exact_count(cfg, name, shape, buffer=name in buffers) for name, shape in tensor_shapes(cfg).items()]
    return _finish(cfg, counts, convention, [], trainable)


def audit_checkpoint(reader: Reader, convention: str = "exact", config: ModelConfig | None = None,
                     trainable: list[str] | None = None) -> Audit:
    """Audit a checkpoint from its header: names, shapes and dtypes only (no tensor data is read).

    `config` overrides reader.config (e.g. to count a BTX checkpoint's active parameters at another
    top-k; the expected layout does not depend on top-k). Tensors that are not canonical names are
    reported as mismatches and left out of the counts.
    """
    cfg = config or reader.config
    found = [(n, tuple(reader.shape(n))) for n in reader.names()]
    mismatches = layout_mismatches(tensor_shapes(cfg), found)
    counts = []
    buffers = buffer_names(cfg)
    for name, shape in found:
        try:
            tensor_group(name), tensor_role(name)
        except KeyError:
            continue  # not a canonical name: already reported as "unexpected"
        dtype = reader.dtype(name)
        counts.append(exact_count(cfg, name, shape, dtype_name(dtype), nbytes(shape, dtype), name in buffers))
    return _finish(cfg, counts, convention, mismatches, trainable)
