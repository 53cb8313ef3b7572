"""A model family as one record: its base plus what differs (the records are converters/hf/families.py).

Like transformers' modular files (Qwen3's attention is Llama's with a QK-norm) and mergekit's architecture
definitions, a family is written as the few things it changes in its base, as data:

  traits     the canonical fields it fixes (ModelConfig values). A field neither fixed nor read holds its ModelConfig
             default, so a family that does not name a mechanism does not have it, and a mechanism added to the
             runtime changes no record.
  keys       the config.json keys it reads (converters/hf/config_map.py fields). A key replaces the base's key of the
             same canonical fields in its place; a new one goes at the end; a trait removes the base's key of its
             field (the family fixes what the base reads).
  rows       its weight rows as a diff of the base's (converters/hf/weights.py Rows: rows dropped, rows added).
  gguf       llama.cpp's spelling of the family (`Gguf`): its architecture name, fused tensors, tokenizer shape and
             what its graph computes beyond the family's traits; converters/gguf_table.py builds ARCHS from these.
  moe        a native mixture format's config map (converters/hf/moe_family.py), built on the record's trunk traits.
  example    a config.json with the real model's features at tiny sizes (docs/families.md's row for the family).

Derived from a record: its config map (`config`), its weight table (`weights`), its traits (`all_traits`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable, Mapping

from bam_surgery.runtime.config import ModelConfig, dense_fields

from .config_map import ConfigMap, ConfigSpec, Field
from .weights import Rows, WeightRule


@dataclass(frozen=True)
class Fused:
    """One llama.cpp tensor holding several canonical ones stacked along their rows, in this order (per_head: head
    by head, each head's rows of every part in turn: qwen35's attn_q, each head's query then its output gate)."""

    parts: tuple[str, ...]  # canonical prefixes ("layers.{}.attn.q", ...)
    member: str  # gguf.MODEL_TENSOR member
    suffixes: tuple[str, ...] = ("weight", "bias")
    per_head: bool = False


@dataclass(frozen=True)
class Gguf:
    """llama.cpp's architecture for a family: what its graph computes beyond the family's traits (its QK-norm, norm
    position, activation, embedding scale and (1 + w) norms are the family's own), as converters/gguf_table.py reads
    them. A mixture record's part names the architecture and its gating; the dense record of the same architecture
    (llama's, for Mixtral's) gives the rest."""

    name: str
    rope_pairs: bool = False  # rotates pairs of dimensions (LLAMA_ROPE_TYPE_NORM): rotate-halves Q/K rows permuted
    gate_norm: str | None = None  # a mixture's: the gates its graph computes
    expert_width: bool = False  # a mixture's: reads expert_feed_forward_length (else takes feed_forward_length / top-k)
    output_always: bool = False  # loads output.weight even for tied embeddings
    nope_every: int = 0  # n > 0: layers i with (i + 1) % n == 0 apply no RoPE (fixed in llama.cpp)
    biases: tuple[str, ...] = ("q/k/v",)  # the biases its graph adds (of q/k/v, o, ffn)
    rope_scalings: tuple[str, ...] = ("linear", "yarn")  # the scaled_rope types it applies
    fused: tuple[Fused, ...] = ()
    q_is_d_model: bool = False  # loads q and o as [d_model, d_model]: n_heads * head_dim = d_model
    tied_only: bool = False  # loads no output.weight: the embedding is the head
    attn_softcap: str = "none"  # none | always (attn_logit_softcapping, SOFTCAP_DEFAULTS when absent)
    final_softcap: str = "none"  # none | optional (final_logit_softcapping, 0 or absent: none) | always
    # none | optional (with attention.sliding_window) | always (default_window when absent) | fixed (llama.cpp slides
    # window_pattern's layers at a block_count of window_block_count only, the window from the key)
    windows: str = "none"
    window_block_count: int = 0
    rope_sliding_only: bool = False  # with windows, RoPE in the sliding layers only
    default_window: int = 0  # the window llama.cpp takes where the file has none (windows: always)
    window_pattern: int = 0  # absent sliding_window_pattern: layers i with i % n < n - 1 slide
    window_rope: str = "global"  # the sliding layers' RoPE: global (scaled as the others) or plain
    attn_scale_layers: int = 0  # at this block_count (the 27B's) 1/sqrt(d_model / n_heads), else 1/sqrt(head_dim)
    tokenizer: str = "llama"  # the shape of its SentencePiece tokenizer (converters/gguf_sentencepiece.py)
    carries: tuple[str, ...] = ()  # config fields its own {arch}.* keys carry (gguf_table.hparams has their keys)
    # the config features that pick this architecture for an export (converters/gguf_export.py candidates), beyond
    # the family's QK-norm and norm position: {feature: value}
    picks: Mapping[str, Any] = field(default_factory=dict)
    moe_checks: str | None = None  # a mixture's FFN side is judged as this native format's (None: the record's own)
    moe_biases: tuple[str, ...] | None = None  # a mixture's: the biases its graph adds (None: as moe_checks judges)
    partial_rotary: bool = False  # rotates the first rope.dimension_count dims of each head (else all of them)
    # the family's own layers, which gguf_table's sections read and write and the family's HF format judges
    # (gguf_export.arch_column): Gated DeltaNet layers and gated attention (Qwen3.5: LINEAR), Gemma 4's per-layer geometry (GEMMA4)
    linear_attention: bool = False
    per_layer_geometry: bool = False


@dataclass(frozen=True)
class Family:
    """One Hugging Face model family (module docstring)."""

    model_type: str  # config.json model_type
    hf_class: str  # config.json "architectures" entry written on export
    base: Family | None = None
    traits: Mapping[str, Any] = field(default_factory=dict)
    keys: tuple[Field, ...] = ()
    rows: Rows | tuple[WeightRule, ...] = Rows()  # a tuple: the whole table (a family without a base)
    gguf: Gguf | None = None
    moe: Callable[[Family], ConfigMap] | None = None  # a native mixture format: its config map, from the record
    stands_for: str = ""  # the real model its example stands for (docs/families.md)
    example: Mapping[str, Any] | None = None
    summary: str = ""  # a native mixture format's --format help
    format: str = ""  # a native mixture format's --format name, where it is not the model_type
    base_prefix: str = "model."  # prefix of the base model inside the *ForCausalLM
    alias_prefixes: Mapping[str, str] = field(default_factory=dict)  # other spellings of an HF prefix, read only

    def child(self, model_type: str, hf_class: str, **diff: Any) -> Family:
        """A family based on this one: what differs (module docstring)."""
        return Family(model_type, hf_class, base=self, **diff)

    # -- derived ----------------------------------------------------------------------------
    @cached_property
    def all_keys(self) -> tuple[Field, ...]:
        out = [k for k in (self.base.all_keys if self.base else ()) if not _reads(k, set(self.traits))]
        for key in self.keys:
            at = next((i for i, k in enumerate(out) if _same(k, key)), None)
            if at is None:
                out.append(key)
            else:
                out[at] = key
        return tuple(out)

    @cached_property
    def all_traits(self) -> dict[str, Any]:
        """Every dense field the family fixes, its base's and its own, in ModelConfig order (defaults for the rest)."""
        read = {c for k in self.all_keys for c in k.canonical}
        own = {**(self.base.all_traits if self.base else {}), **self.traits}
        defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
        return {f: own.get(f, defaults[f]) for f in dense_fields() if f not in read}

    @cached_property
    def weights(self) -> tuple[WeightRule, ...]:
        if isinstance(self.rows, tuple):
            return self.rows
        return self.rows.diff(self.base.weights if self.base else ())

    @cached_property
    def config(self) -> ConfigMap:
        """config.json <-> ModelConfig: the native mixture's map, or the dense spec of the keys and traits."""
        if self.moe is not None:
            return self.moe(self)
        return ConfigSpec(self.all_keys, self.all_traits)

    @property
    def activation(self) -> str:
        """The FFN activation the family computes: its trait, else the first its activation key reads."""
        if "activation" in self.all_traits:
            return self.all_traits["activation"]
        return next(k for k in self.all_keys if "activation" in k.canonical).kinds[0]

    @property
    def format_name(self) -> str:
        """A native mixture format's --format name: its own, else the model_type."""
        return self.format or self.model_type

    @property
    def mixture(self) -> bool:
        return any(r.per_expert for r in self.weights)


def _same(a: Field, b: Field) -> bool:
    """Whether key b replaces key a: they read a canonical field in common, or the same config.json keys (a Require)."""
    return bool(set(a.canonical) & set(b.canonical)) or (not a.canonical and a.hf_keys == b.hf_keys)


def _reads(key: Field, fields: set[str]) -> bool:
    """Whether `key` reads one of `fields` (then all of them: a trait may not split a key)."""
    hit = set(key.canonical) & fields
    if hit and hit != set(key.canonical):
        raise ValueError(f"traits {sorted(hit)} fix part of the key {key.hf_keys} (it reads {key.canonical})")
    return bool(hit)


@dataclass(frozen=True)
class Refused:
    """A family the tool refuses, with the mechanism it does not model (one line)."""

    model_type: str
    why: str
