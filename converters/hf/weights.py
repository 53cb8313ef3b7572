"""A weight table's rows: these HF tensors <-> these canonical tensors, through this named reshape op.

`{}` in a name is the layer index; `{e}` in an HF name the expert index, expanded to one HF tensor per FFN expert
(stacked into one canonical [E, ...] tensor by STACK). Import runs `op.forward`; export runs `op.inverse` over the
same rows, so the canonical -> HF direction is never written by hand. A family's table is its base's rows plus what
differs (`Rows.diff`, converters/hf/family.py); converters/hf/architectures.py binds a table to a config.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from .ops import DROP, IDENTITY, STACK, ReshapeOp


@dataclass(frozen=True)
class WeightRule:
    hf: tuple[str, ...]  # HF name templates
    canonical: tuple[str, ...]  # canonical name templates; () = dropped on purpose
    op: ReshapeOp = IDENTITY
    tied_alias: bool = False  # the HF lm_head that duplicates tied embeddings: accepted, dropped, not written
    # where the config has no use for it, an HF tensor some checkpoints still carry (Gemma 4's K/V projections in
    # the layers that read another layer's): accepted there, dropped, not written
    optional: bool = False

    @property
    def per_layer(self) -> bool:
        return any("{}" in n for n in self.hf + self.canonical)

    @property
    def per_expert(self) -> bool:
        return any("{e}" in n for n in self.hf)


def w(hf: str | tuple[str, ...], canonical: str | tuple[str, ...] | None, op: ReshapeOp = IDENTITY) -> WeightRule:
    """A table row; canonical None = an HF tensor dropped on purpose (a buffer the model rebuilds)."""
    as_tuple = lambda x: (x,) if isinstance(x, str) else tuple(x)  # noqa: E731
    if canonical is None:
        return WeightRule(as_tuple(hf), (), DROP)
    return WeightRule(as_tuple(hf), as_tuple(canonical), op)


def lm_head(hf: str = "lm_head.weight") -> WeightRule:
    return WeightRule((hf,), ("lm_head.weight",), IDENTITY, tied_alias=True)


def linear(hf_prefix: str, canonical_prefix: str, op: ReshapeOp = IDENTITY) -> list[WeightRule]:
    """weight and (when the config has one) bias of one projection."""
    return [w(f"{hf_prefix}.weight", f"{canonical_prefix}.weight", op),
            w(f"{hf_prefix}.bias", f"{canonical_prefix}.bias")]


def qkv(hf_attn: str, names: tuple[str, str, str] = ("q_proj", "k_proj", "v_proj")) -> list[WeightRule]:
    out: list[WeightRule] = []
    for hf_name, c in zip(names, "qkv"):
        out += linear(f"{hf_attn}.{hf_name}", f"layers.{{}}.attn.{c}")
    return out


def moe_rows(moe: str, router: str, expert: tuple[str, str, str]) -> tuple[WeightRule, ...]:
    """The router at model.layers.{}.MOE.ROUTER and the experts at MOE.experts.{e}.NAME (gate, up, down names)."""
    m = f"model.layers.{{}}.{moe}"
    return (w(f"{m}.{router}.weight", "layers.{}.ffn_router.weight"),
            *[w(f"{m}.experts.{{e}}.{name}.weight", f"layers.{{}}.ffn_experts.{proj}.weight", STACK)
              for name, proj in zip(expert, ("gate", "up", "down"))])


@dataclass(frozen=True)
class Rows:
    """What a family changes in its base's table: the rows whose canonical names (a dropped buffer's: its HF names)
    start with one of `drop` go; `add` comes in before the first row whose canonical names start with `before` (the
    final norm unless it says)."""

    add: tuple[WeightRule, ...] = ()
    drop: tuple[str, ...] = ()
    before: str = "final_norm"

    def diff(self, base: Iterable[WeightRule]) -> tuple[WeightRule, ...]:
        kept = [r for r in base if not any(n.startswith(p) for n in r.canonical or r.hf for p in self.drop)]
        at = next((i for i, r in enumerate(kept) if any(c.startswith(self.before) for c in r.canonical)), len(kept))
        return (*kept[:at], *self.add, *kept[at:])
