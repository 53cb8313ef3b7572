"""What a target carries of a model's config: the vocabulary of the table of what runs where.

Each target declares its column in its own module (the runtime's is its config's types; HF BAM's
converters/hf_bam/export.py, the native mixture formats' converters/hf/moe_family.py, llama.cpp's
converters/gguf_export.py, ONNX's converters/onnx_export.py, vLLM's converters/vllm_bam/support.py);
converters/targets.py assembles them into the table docs/families.md shows. A column is rows (`Carry`): the config
fields a row reads, whether the target computes the config's values of them, and the words of its refusal (what the
target needs, what the model has). A field no row of a column reads is carried at its ModelConfig default only: a
mechanism added to the runtime is refused by every target until the target declares it (`unread`).

    column.failures(cfg)        the rows cfg fails, in the column's order (unread fields at other values last)
    column.problems(cfg)        [(needs, has)] of those, for a one-line refusal
"""
from __future__ import annotations

import dataclasses
import types
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Literal, Mapping, Union, get_args, get_origin, get_type_hints

from bam_surgery.runtime.config import ModelConfig

Text = str | Callable[[Any], str]  # a phrase, or one made from the config


@dataclass(frozen=True)
class Carry:
    """One row of a column: the fields it reads, the test over the config, the refusal's words, the table's cell."""

    fields: tuple[str, ...]
    ok: Callable[[Any], bool]
    needs: Text = ""
    has: Text = ""
    shown: str | Mapping[str, str] = "any"  # what the target carries of the fields, in words (per field, or one)
    allowed: tuple[Any, ...] | None = None  # the values carried, where the row is a list of them

    def shown_for(self, field: str) -> str:
        return self.shown if isinstance(self.shown, str) else self.shown[field]

    def needs_text(self, cfg: Any) -> str:
        return self.needs(cfg) if callable(self.needs) else self.needs

    def has_text(self, cfg: Any) -> str:
        return self.has(cfg) if callable(self.has) else self.has.format(*(getattr(cfg, f) for f in self.fields))


def values(field: str, allowed: Iterable[Any], needs: Text = "", has: Text = "", shown: str | None = None) -> Carry:
    """The field carried at these values only; has defaults to 'FIELD VALUE'."""
    allowed = tuple(allowed)
    return Carry((field,), lambda cfg: getattr(cfg, field) in allowed, needs or f"{field} in {allowed}",
                 has or f"{field} {{}}", ", ".join(map(str, allowed)) if shown is None else shown, allowed)


def rule(fields: str | tuple[str, ...], ok: Callable[[Any], bool], needs: Text, has: Text,
         shown: str | Mapping[str, str]) -> Carry:
    """The fields carried where `ok` holds (a condition over several fields, or one no list of values says)."""
    return Carry((fields,) if isinstance(fields, str) else tuple(fields), ok, needs, has, shown)


def anything(*fields: str, shown: str = "any") -> tuple[Carry, ...]:
    """The fields carried whatever their values (or whatever they are where they matter: `shown` says)."""
    return tuple(Carry((f,), lambda cfg: True, shown=shown) for f in fields)


@dataclass(frozen=True)
class Column:
    """What one target carries: its rows, in the order its refusal lists what fails."""

    target: str
    rows: tuple[Carry, ...]

    def read(self) -> set[str]:
        return {f for r in self.rows for f in r.fields}

    def unread(self, cfg: Any, defaults: Mapping[str, Any] | None = None) -> list[Carry]:
        """A row for each field no row reads whose value is not its default (the target does not compute it)."""
        defaults = MODEL_DEFAULTS if defaults is None else defaults
        return [Carry((f,), lambda c: False, f"{f} {defaults[f]!r}", f"{f} {getattr(cfg, f)!r}", repr(defaults[f]),
                      (defaults[f],))
                for f in defaults if f not in self.read() and getattr(cfg, f) != defaults[f]]

    def failures(self, cfg: Any, defaults: Mapping[str, Any] | None = None) -> list[Carry]:
        return [r for r in self.rows if not r.ok(cfg)] + self.unread(cfg, defaults)

    def problems(self, cfg: Any, defaults: Mapping[str, Any] | None = None) -> list[tuple[str, str]]:
        return [(r.needs_text(cfg), r.has_text(cfg)) for r in self.failures(cfg, defaults)]

    def cell(self, field: str) -> str:
        """What the target carries of `field`, in words: its rows' (those that say more than "any" where some do; the
        default's where none reads it)."""
        shown = list(dict.fromkeys(r.shown_for(field) for r in self.rows if field in r.fields))
        narrow = [s for s in shown if not s.startswith("any")] or shown[:1]
        bare = {s.rsplit(" (", 1)[0] if s.endswith(")") else s for s in narrow}  # one value, said per kind of model
        if len(narrow) > 1 and len(bare) == 1:
            narrow = list(bare)
        return "; ".join(narrow) if shown else f"{MODEL_DEFAULTS.get(field)!r} only"

    def __add__(self, rows: Iterable[Carry]) -> Column:
        return Column(self.target, (*self.rows, *rows))


def supported_values() -> dict[str, tuple]:
    """Each ModelConfig field of a fixed set of values (a Literal, or a Literal or None) -> its values."""
    hints = get_type_hints(ModelConfig)
    out = {}
    for f in dataclasses.fields(ModelConfig):
        union = get_origin(hints[f.name]) in (Union, types.UnionType)
        args = [a for a in get_args(hints[f.name]) if a is not type(None)] if union else [hints[f.name]]
        if len(args) == 1 and get_origin(args[0]) is Literal:
            optional = [None] if union else []
            out[f.name] = tuple(v for v in (*optional, *get_args(args[0])) if v not in f.metadata.get("never", ()))
    return out


def runtime_column(target: str) -> Column:
    """What the runtime computes (its config's types: every value of a field of a fixed set, any other value
    validate() accepts), the column of every target that runs the runtime's own model math (HF BAM's remote code, the
    ONNX graph)."""
    allowed = supported_values()
    return Column(target, tuple(values(f.name, allowed[f.name]) if f.name in allowed else anything(f.name)[0]
                                for f in dataclasses.fields(ModelConfig)))


MODEL_DEFAULTS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(ModelConfig)
                                  if f.default is not dataclasses.MISSING}
# the fields every target carries at any value: the sizes, and what matters to training only (and a label)
SIZES = ("vocab_size", "d_model", "n_layers", "n_heads", "ffn_hidden", "n_kv_heads", "head_dim", "max_positions",
         "norm_eps")
TRAINING = ("key_store_alpha", "key_store_beta", "key_store_delta", "key_store_theta_percentile",
            "key_store_ema_decay", "lb_coef", "z_coef", "name")
