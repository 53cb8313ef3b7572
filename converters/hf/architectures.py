"""The weight-mapping table of every Hugging Face architecture the tool reads, registered by config.json's model_type:
each is a family record (converters/hf/families.py: the family's base plus what differs), whose rows
(converters/hf/weights.py) say these HF tensors <-> these canonical tensors, through this named reshape op.

Which rows apply depends on the config (bias rows only when the config has biases, lm_head only
when embeddings are untied): a row is active when all its canonical tensors are in
`runtime.layout.tensor_shapes(cfg)`. `bind` checks that the active rows produce every canonical
tensor exactly once. Rows whose canonical side is None are HF buffers dropped on purpose.
"""
from __future__ import annotations

from dataclasses import dataclass

from bam_surgery.runtime.config import ModelConfig
from bam_surgery.runtime.layout import tensor_shapes

from ..base import CapabilityError
from .families import FAMILIES
from .families import REFUSED as _REFUSED
from .family import Family
from .ops import ReshapeOp
from .weights import WeightRule

Architecture = Family  # an architecture is its family's record: model_type, hf_class, weights, config, prefixes

ARCHITECTURES: dict[str, Architecture] = {f.model_type: f for f in FAMILIES}

# Families users branch from that are read nowhere yet, with what stands in the way (one line, naming it)
REFUSED: dict[str, str] = {r.model_type: r.why for r in _REFUSED}


def architecture(model_type: str | None) -> Architecture:
    if isinstance(model_type, str) and model_type in REFUSED:
        raise CapabilityError(f"model_type={model_type!r} is not supported: {REFUSED[model_type]}")
    if not isinstance(model_type, str) or model_type not in ARCHITECTURES:
        raise CapabilityError(f"model_type={str(model_type)[:60]!r} is not supported "
                                 f"(supported: {', '.join(sorted(ARCHITECTURES))})")
    return ARCHITECTURES[model_type]


# ---- binding a table to a config ------------------------------------------------------------
@dataclass(frozen=True)
class BoundRule:
    """A table row with the layer index filled in."""

    hf: tuple[str, ...]
    canonical: tuple[str, ...]
    op: ReshapeOp
    rule: WeightRule


@dataclass
class Binding:
    active: list[BoundRule]  # rows that move data, in canonical (model) order
    optional_drops: set[str]  # HF names accepted if present and dropped (buffers, tied lm_head)
    inactive: dict[str, BoundRule]  # HF names the table knows but this config says are absent
    producer: dict[str, tuple[BoundRule, int]]  # canonical name -> (row, index into op outputs)

    def known(self) -> set[str]:
        return {n for r in self.active for n in r.hf} | self.optional_drops | set(self.inactive)


def _expand(rule: WeightRule, cfg: ModelConfig) -> list[BoundRule]:
    """The rows of one rule: one per layer if it has `{}`; `{e}` HF names once per FFN expert, in order."""
    experts = range(cfg.ffn_experts) if rule.per_expert else [None]
    out = []
    for i in range(cfg.n_layers) if rule.per_layer else [None]:
        fill = (lambda n, e=None: n.format(i, e=e)) if i is not None else (lambda n, e=None: n.format(e=e))
        hf = tuple(fill(n, e) for n in rule.hf for e in experts) if rule.per_expert or i is not None else rule.hf
        canonical = tuple(fill(n) for n in rule.canonical) if i is not None else rule.canonical
        out.append(BoundRule(hf, canonical, rule.op, rule))
    return out


def bind(arch: Architecture, cfg: ModelConfig) -> Binding:
    """The rows of `arch`'s table that apply to `cfg`, with every canonical tensor produced once."""
    expected = tensor_shapes(cfg)
    b = Binding(active=[], optional_drops=set(), inactive={}, producer={})
    bound = [br for r in arch.weights for br in _expand(r, cfg)]
    for br in bound:
        present = [c in expected for c in br.canonical]
        if not br.canonical:
            b.optional_drops.update(br.hf)
        elif all(present):
            b.active.append(br)
            for j, c in enumerate(br.canonical):
                if c in b.producer:
                    raise CapabilityError(f"{arch.model_type} table maps {c} twice")
                b.producer[c] = (br, j)
        elif any(present):
            raise CapabilityError(f"{arch.model_type} table row {br.hf} -> {br.canonical} only partly "
                                     "applies to this config")
        elif (br.rule.tied_alias and cfg.tie_embeddings) or br.rule.optional:
            b.optional_drops.update(br.hf)  # a stored copy of the tied embeddings; the model reuses embed
        else:
            for n in br.hf:
                b.inactive[n] = br
    order = {c: k for k, c in enumerate(expected)}
    b.active.sort(key=lambda br: min(order[c] for c in br.canonical))
    missing = [c for c in expected if c not in b.producer]
    if missing:
        raise CapabilityError(f"{arch.model_type} has no HF tensor for canonical {missing[0]}")
    return b
