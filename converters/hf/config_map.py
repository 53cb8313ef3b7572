"""Hugging Face config.json <-> ModelConfig: the fields a family's keys are made of, and the spec a family record
derives (converters/hf/family.py; the records are converters/hf/families.py).

A spec is a list of fields plus the values the architecture fixes. Every field knows both
directions (`read`: HF keys -> canonical fields; `write`: canonical fields -> HF keys), so export
is derived from the same spec as import. `fixed` values are set on import and checked on export
(a model that does not have them cannot be written in that architecture: a capability error,
raised before any I/O). `Require` pins HF options we do not model (e.g. Cohere's QK-norm) to the
one value we support.

Defaults are the transformers config-class defaults (5.x): a config.json may omit any key that
equals its class default. tests/converters/test_hf_import.py checks them against the installed classes.
"""
from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol

from bam_surgery.runtime.config import ROPE_KEYS, ConfigError, ModelConfig

from ..base import CapabilityError

REQUIRED = object()  # sentinel: the key must be present in config.json


def _value(hf: Mapping[str, Any], key: str, default: Any) -> Any:
    v = hf.get(key)
    if v is None:
        if default is REQUIRED:
            raise ConfigError(f"{key}: required key is missing from config.json")
        return default
    return v


class Field:
    """config.json keys <-> canonical fields, both ways. `stage` orders reading: a field that needs what another reads
    (the sizes, nope_layers, attn_window) reads after it; writing keeps the declared order (config.json's)."""

    hf_keys: tuple[str, ...] = ()
    canonical: tuple[str, ...] = ()
    stage = 0

    def read(self, hf: Mapping[str, Any], out: dict[str, Any], notes: list[str]) -> None:
        raise NotImplementedError

    def write(self, cfg: ModelConfig, model_type: str) -> dict[str, Any]:
        raise NotImplementedError


@dataclass
class Same(Field):
    """One HF key <-> one canonical field, same value (default None: ModelConfig derives it)."""

    hf_key: str
    field_name: str
    default: Any = REQUIRED

    def __post_init__(self):
        self.hf_keys, self.canonical = (self.hf_key,), (self.field_name,)

    def read(self, hf, out, notes):
        v = _value(hf, self.hf_key, self.default)
        if v is not None:  # None: ModelConfig derives it (n_kv_heads = n_heads, head_dim = D / H)
            out[self.field_name] = v

    def write(self, cfg, model_type):
        return {self.hf_key: getattr(cfg, self.field_name)}


@dataclass
class Nullable(Same):
    """One HF key <-> one canonical field that may be null in config.json on purpose (an explicit null means none,
    where the class default may be a value: Gemma 2's soft-caps)."""

    default: Any = None

    def read(self, hf, out, notes):
        out[self.field_name] = hf[self.hf_key] if self.hf_key in hf else self.default


@dataclass
class Reciprocal(Same):
    """One HF key holding the reciprocal of a canonical field (Granite's logits_scaling divides the logits: the
    canonical logit_scale, which multiplies them, is 1 / it)."""

    default: Any = 1.0

    def read(self, hf, out, notes):
        out[self.field_name] = 1.0 / float(_value(hf, self.hf_key, self.default))

    def write(self, cfg, model_type):
        return {self.hf_key: 1.0 / getattr(cfg, self.field_name)}


@dataclass
class AttentionScale(Same):
    """The attention logits' scale itself (Granite's attention_multiplier) <-> attn_scale; a model scaled by
    1/sqrt(attn_scale_dim or head_dim) is written with that value."""

    default: Any = 1.0

    def write(self, cfg, model_type):
        scale = cfg.attn_scale if cfg.attn_scale is not None else (cfg.attn_scale_dim or cfg.head_dim) ** -0.5
        return {self.hf_key: scale}


@dataclass
class FanOut(Field):
    """One HF boolean <-> several canonical booleans that must agree (attention_bias -> qkv_bias, o_bias)."""

    hf_key: str
    fields: tuple[str, ...]
    default: Any = REQUIRED

    def __post_init__(self):
        self.hf_keys, self.canonical = (self.hf_key,), tuple(self.fields)

    def read(self, hf, out, notes):
        v = bool(_value(hf, self.hf_key, self.default))
        for f in self.fields:
            out[f] = v

    def write(self, cfg, model_type):
        vals = {f: getattr(cfg, f) for f in self.fields}
        if len(set(vals.values())) != 1:
            raise CapabilityError(f"cannot export to {model_type}: its {self.hf_key} sets "
                                  f"{' and '.join(self.fields)} together, the model has {vals}")
        return {self.hf_key: vals[self.fields[0]]}


# HF activation names (transformers ACT2FN) -> canonical, for non-gated FFNs. The tanh variants
# compute the same function.
_HF_ACT = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu",
           "silu": "silu", "swish": "silu"}
_CANONICAL_ACT = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu", "silu": "silu"}
_GATED = {"silu": "swiglu", "gelu_tanh": "geglu_tanh"}  # a gated FFN's activation -> the canonical kind


@dataclass
class Activation(Field):
    """hidden_act; a gated architecture (gate_proj/up_proj) with SiLU is swiglu."""

    hf_key: str
    gated: bool
    default: Any = REQUIRED
    gated_kinds: tuple[str, ...] = ("swiglu",)  # the gated FFNs the architecture's class computes

    def __post_init__(self):
        self.hf_keys, self.canonical = (self.hf_key,), ("activation",)

    @property
    def kinds(self) -> tuple[str, ...]:
        """The canonical activations the architecture computes."""
        return self.gated_kinds if self.gated else tuple(_CANONICAL_ACT)

    def read(self, hf, out, notes):
        name = _value(hf, self.hf_key, self.default)
        if not isinstance(name, str):
            raise ConfigError(f"{self.hf_key}: expected an activation name, got {str(name)[:60]}")
        act = _HF_ACT.get(name)
        if act is None:
            raise CapabilityError(f"{self.hf_key}={name!r} is not supported (supported: {', '.join(_HF_ACT)})")
        if self.gated:
            if act not in _GATED:
                raise CapabilityError(f"{self.hf_key}={name!r}: a gated FFN is supported only with SiLU (swiglu) or "
                                      "tanh-approximated GELU (geglu_tanh)")
            act = _GATED[act]
        out["activation"] = act

    def write(self, cfg, model_type):
        act = cfg.activation
        if self.gated:
            if act not in self.gated_kinds:
                raise CapabilityError(f"cannot export to {model_type}: it needs a {' or '.join(self.gated_kinds)} FFN, "
                                      f"the model has {act}")
            return {self.hf_key: {"swiglu": "silu", "geglu_tanh": "gelu_pytorch_tanh"}[act]}
        if act not in _CANONICAL_ACT:
            raise CapabilityError(f"cannot export to {model_type}: it needs a non-gated FFN, the model has {act}")
        return {self.hf_key: _CANONICAL_ACT[act]}


@dataclass
class ParallelResidual(Field):
    """GPT-NeoX use_parallel_residual: True -> two norms in parallel, False -> sequential."""

    hf_key: str
    default: Any = REQUIRED

    def __post_init__(self):
        self.hf_keys, self.canonical = (self.hf_key,), ("block",)

    def read(self, hf, out, notes):
        out["block"] = "parallel_two_norms" if _value(hf, self.hf_key, self.default) else "sequential"

    def write(self, cfg, model_type):
        if cfg.block not in ("parallel_two_norms", "sequential"):
            raise CapabilityError(f"cannot export to {model_type}: block={cfg.block!r} "
                                  "(it has parallel_two_norms or sequential blocks)")
        return {self.hf_key: cfg.block == "parallel_two_norms"}


@dataclass
class InnerWidth(Field):
    """GPT-2 n_inner: None means 4 * n_embd."""

    hf_key: str
    d_model_key: str

    def __post_init__(self):
        self.hf_keys, self.canonical = (self.hf_key,), ("ffn_hidden",)

    def read(self, hf, out, notes):
        v = hf.get(self.hf_key)
        out["ffn_hidden"] = int(v) if v is not None else 4 * int(_value(hf, self.d_model_key, REQUIRED))

    def write(self, cfg, model_type):
        return {self.hf_key: cfg.ffn_hidden}


@dataclass
class DerivedEqual(Field):
    """A canonical field the architecture derives from others (no HF key): checked on export."""

    field_name: str
    rule: str  # "n_heads" (multi-head attention) or "d_model/n_heads" (head_dim)

    def __post_init__(self):
        self.canonical = (self.field_name,)

    def _expected(self, cfg: ModelConfig) -> int:
        return cfg.n_heads if self.rule == "n_heads" else cfg.d_model // cfg.n_heads

    def read(self, hf, out, notes):
        pass  # ModelConfig derives n_kv_heads = n_heads and head_dim = d_model / n_heads

    def write(self, cfg, model_type):
        if getattr(cfg, self.field_name) != self._expected(cfg) or (
                self.rule != "n_heads" and cfg.d_model % cfg.n_heads):
            raise CapabilityError(f"cannot export to {model_type}: it needs {self.field_name} = {self.rule}, "
                                  f"the model has {self.field_name}={getattr(cfg, self.field_name)}")
        return {}


@dataclass
class Rope(Field):
    """RoPE base, rotated fraction and scaling, from transformers 5 `rope_parameters` or the older top-level
    `rope_theta` / `rope_scaling` keys.

    Scaled RoPE (rope_type linear, dynamic, yarn, longrope, llama3) becomes the canonical `scaled_rope`: the
    type's keys (runtime/config.py ROPE_KEYS) taken as transformers standardizes them (llama3, yarn and
    longrope default original_max_position_embeddings to max_position_embeddings; Phi-3 keeps it at the top
    level, where it wins). `aliases` renames legacy types (Phi-3: su and yarn are longrope). Per-layer-type
    RoPE is refused unless every type has the same. HF rotates int(head_dim * factor) dims, so the canonical
    fraction is that count / head_dim.
    """

    default_theta: float
    default_fraction: float | None = None  # None: the architecture has no partial rotary
    legacy_theta_key: str = "rope_theta"
    legacy_fraction_key: str = "partial_rotary_factor"
    aliases: Mapping[str, str] = field(default_factory=dict)
    original_key: str | None = None  # a top-level original_max_position_embeddings that wins (Phi-3)
    default_parameters: Mapping[str, Any] | None = None  # the class's rope_parameters where config.json has none
    stage = 1  # after the sizes (the rotated fraction is a count of head dims)

    def __post_init__(self):
        self.hf_keys = ("rope_parameters", "rope_scaling", "rope_theta", self.legacy_theta_key) + (
            (self.legacy_fraction_key,) if self.default_fraction is not None else ()) + (
            (self.original_key,) if self.original_key else ())
        self.canonical = ("rope_theta", "scaled_rope") + (
            ("rotary_fraction",) if self.default_fraction is not None else ())

    def read(self, hf, out, notes):
        # transformers 4 wrote rope_scaling (None for plain RoPE), 5 writes rope_parameters, which may
        # be nested per layer type ({"full_attention": {...}, "sliding_attention": {...}})
        for key in ("rope_scaling", "rope_parameters"):
            if hf.get(key) is not None and not isinstance(hf[key], dict):
                raise ConfigError(f"{key}: expected an object, got {str(hf[key])[:60]}")
        hf = self.with_default(hf)
        params = hf.get("rope_parameters")
        if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
            if len({json.dumps(v, sort_keys=True) for v in params.values()}) > 1:
                raise CapabilityError(f"rope_parameters differ between layer types ({', '.join(params)}); "
                                      "one RoPE for all layers is supported")
            params = next(iter(params.values()))
        named = [(k, d) for k, d in (("rope_scaling", hf.get("rope_scaling")), ("rope_parameters", params))
                 if isinstance(d, dict)]
        dicts = [d for _, d in named]

        def first(key: str, *fallbacks):
            vals = [d.get(key) for d in dicts] + [hf.get(key), *fallbacks]
            return next((v for v in vals if v is not None), None)

        out["rope_theta"] = float(first("rope_theta", hf.get(self.legacy_theta_key), self.default_theta))
        out["scaled_rope"] = self._scaled(hf, named)
        frac = first("partial_rotary_factor", hf.get(self.legacy_fraction_key), self.default_fraction, 1.0)
        if (out["scaled_rope"] or {}).get("rope_type") == "proportional":
            frac = 1.0  # proportional RoPE keeps its partial_rotary_factor (rope_frequencies): every dim takes part
        if self.default_fraction is None:
            if float(frac) != 1.0:
                raise CapabilityError(f"partial_rotary_factor={frac} is not supported by this architecture")
            return
        d_model, n_heads = out.get("d_model"), out.get("n_heads")
        if not all(isinstance(v, int) and v > 0 for v in (d_model, n_heads)):
            return  # ModelConfig names the bad size (hidden_size / num_attention_heads)
        head_dim = out.get("head_dim") or d_model // n_heads
        out["rotary_fraction"] = int(head_dim * float(frac)) / head_dim

    def with_default(self, hf: Mapping[str, Any]) -> Mapping[str, Any]:
        """config.json with the class's rope_parameters where it has none of its own (nor the older keys)."""
        if self.default_parameters is None or any(hf.get(k) is not None for k in
                                                  ("rope_parameters", "rope_scaling", "rope_theta")):
            return hf
        return {**hf, "rope_parameters": dict(self.default_parameters)}

    def _scaled(self, hf: Mapping[str, Any], named: list[tuple[str, dict]]) -> dict[str, Any] | None:
        """The canonical scaled_rope from the first RoPE dict naming a type other than default, or None."""
        for key, d in named:
            rope_type = d.get("rope_type", d.get("type", "default"))
            rope_type = self.aliases.get(rope_type, rope_type)
            if rope_type == "default":
                continue
            if rope_type not in ROPE_KEYS:
                raise CapabilityError(f"{key}: rope_type={str(rope_type)[:40]!r} is not supported "
                                      f"(supported: default, {', '.join(ROPE_KEYS)})")
            required, optional = ROPE_KEYS[rope_type]
            scaled = {"rope_type": rope_type, **{k: d[k] for k in required + optional if d.get(k) is not None}}
            if "original_max_position_embeddings" in required:
                top = hf.get(self.original_key) if self.original_key else None
                scaled["original_max_position_embeddings"] = (
                    top or scaled.get("original_max_position_embeddings") or hf.get("max_position_embeddings"))
            return scaled
        return None

    def write(self, cfg, model_type):
        params: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
        if cfg.scaled_rope is not None:
            params.update(cfg.scaled_rope)
        body: dict[str, Any] = {"rope_theta": cfg.rope_theta}  # read by transformers < 5
        if self.legacy_theta_key != "rope_theta":
            body[self.legacy_theta_key] = cfg.rope_theta
        if self.default_fraction is not None:
            params["partial_rotary_factor"] = cfg.rotary_fraction
            body[self.legacy_fraction_key] = cfg.rotary_fraction
        if self.original_key and cfg.scaled_rope and "original_max_position_embeddings" in cfg.scaled_rope:
            body[self.original_key] = cfg.scaled_rope["original_max_position_embeddings"]
        if cfg.scaled_rope is not None:  # read by transformers < 5 (5 takes it over rope_parameters: the same RoPE)
            body["rope_scaling"] = dict(cfg.scaled_rope)
        body["rope_parameters"] = params
        return body


SLIDING, FULL = "sliding_attention", "full_attention"  # transformers' layer_types


@dataclass
class LayerTypeRope(Rope):
    """Gemma 3's RoPE per layer type: rope_parameters {"full_attention": {...}, "sliding_attention": {...}} (or
    the older rope_theta, rope_scaling and rope_local_base_freq): the full layers' RoPE as Rope reads it (scaled
    or not), the sliding layers' plain RoPE base as window_rope_theta."""

    local_key: str | None = "rope_local_base_freq"  # the older top-level key of the local base (Gemma 3)
    default_local: float = 10000.0
    stage = 3  # after the window (the local base belongs to the sliding layers)

    def __post_init__(self):
        super().__post_init__()
        self.hf_keys += (self.local_key,) if self.local_key else ()
        self.canonical += ("window_rope_theta",)

    def read(self, hf, out, notes):
        params = hf.get("rope_parameters")
        nested = isinstance(params, dict) and any(k in params for k in (SLIDING, FULL))
        full = params.get(FULL) if nested else params
        super().read({**hf, "rope_parameters": full}, out, notes)
        local = params.get(SLIDING) if nested else None
        if local is not None:
            if not isinstance(local, dict):
                raise ConfigError(f"rope_parameters.{SLIDING}: expected an object, got {str(local)[:40]}")
            if local.get("rope_type", "default") != "default":
                raise CapabilityError(f"rope_parameters.{SLIDING}: rope_type={str(local.get('rope_type'))[:40]!r} "
                                      "is not supported (the sliding layers take plain RoPE)")
        theta = (local or {}).get("rope_theta", hf.get(self.local_key or "", self.default_local))
        out["window_rope_theta"] = float(theta) if out.get("attn_window") is not None else None

    def write(self, cfg, model_type):
        body = super().write(cfg, model_type)
        local = cfg.window_rope_theta or cfg.rope_theta
        body["rope_parameters"] = {FULL: body["rope_parameters"], SLIDING: {"rope_type": "default", "rope_theta": local}}
        if self.local_key:
            body[self.local_key] = local
        return body


@dataclass
class TemperedRope(Rope):
    """RoPE with the queries' scale by position in rope_parameters (Ministral 3: llama_4_scaling_beta, over the
    rope's original_max_position_embeddings) <-> attn_temperature and attn_temperature_length. A model without one
    is written with a temperature of 0 (a scale of 1: the class has none to leave out)."""

    beta_key: str = "llama_4_scaling_beta"

    def __post_init__(self):
        super().__post_init__()
        self.canonical += ("attn_temperature", "attn_temperature_length")

    def read(self, hf, out, notes):
        super().read(hf, out, notes)
        params = self.with_default(hf).get("rope_parameters") or {}
        beta, length = params.get(self.beta_key), params.get("original_max_position_embeddings")
        if not isinstance(beta, (int, float)) or isinstance(beta, bool):
            raise ConfigError(f"rope_parameters.{self.beta_key}: expected a number, got {str(beta)[:40]}")
        out["attn_temperature"], out["attn_temperature_length"] = float(beta), length

    def write(self, cfg, model_type):
        body = super().write(cfg, model_type)
        original = (cfg.scaled_rope or {}).get("original_max_position_embeddings")
        length = cfg.attn_temperature_length or original or cfg.max_positions
        if original is not None and original != length:
            raise CapabilityError(f"cannot export to {model_type}: its queries' scale counts positions in periods of "
                                  f"the RoPE's original_max_position_embeddings ({original}), the model's are "
                                  f"{length}")
        for key in ("rope_parameters", "rope_scaling"):  # transformers 5 takes rope_scaling over rope_parameters
            if key in body:
                body[key].update({self.beta_key: cfg.attn_temperature or 0.0, "original_max_position_embeddings": length})
        return body


@dataclass
class SlidingWindow(Field):
    """Sliding-window attention <-> canonical attn_window and attn_window_layers (None: every layer).

    The window is `sliding_window` (Qwen2, Qwen3, SmolLM3: only when `use_sliding_window`); the layers that slide
    are config.json's `layer_types` where it has them, else the family's rule as its config class applies it:
      all       every layer (Mistral, Phi-3: transformers masks every layer with the window)
      from      layers from max_window_layers on (Qwen2, Qwen3)
      period N  every layer but each N-th (Gemma 2: N = 2; Gemma 3: sliding_window_pattern, 6)
      nope      the layers without RoPE (SmolLM3)
    A query sees the last `window` tokens, itself included, as transformers' sliding masks count them.
    """

    hf_key: str = "sliding_window"
    enabled_key: str | None = None  # use_sliding_window gates the window
    default: Any = None  # the class default of sliding_window
    rule: str = "all"
    period: int = 0  # rule "period": the class default period (period_key overrides it)
    period_key: str | None = None
    layer_types: bool = False  # the family writes layer_types (and reads them)
    last_global: bool = False  # the config class makes the last layer global whatever it is told (Gemma 4)
    rope_sliding_only: bool = False  # with a window, RoPE in the sliding layers only (EXAONE 4): nope_layers
    stage = 2  # after the layer count and the layers without RoPE (rule nope)

    def __post_init__(self):
        self.hf_keys = (self.hf_key,) + ((self.enabled_key,) if self.enabled_key else ()) + (
            ("layer_types",) if self.layer_types else ())
        self.canonical = ("attn_window", "attn_window_layers") + (("nope_layers",) if self.rope_sliding_only else ())

    def read(self, hf, out, notes):
        window = hf[self.hf_key] if self.hf_key in hf else self.default
        if self.enabled_key and not hf.get(self.enabled_key, False):
            window = None
        n_layers = out.get("n_layers")
        if window is None or not isinstance(n_layers, int) or n_layers <= 0:
            out["attn_window"], out["attn_window_layers"] = None, None
            if self.rope_sliding_only:
                out["nope_layers"] = None
            return
        if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
            raise ConfigError(f"{self.hf_key}: expected a positive integer, got {str(window)[:40]}")
        sliding = [i for i in self._sliding_layers(hf, n_layers, out) if not (self.last_global and i == n_layers - 1)]
        out["attn_window"] = window if sliding else None
        out["attn_window_layers"] = None if not sliding or len(sliding) == n_layers else sliding
        if self.rope_sliding_only:
            out["nope_layers"] = [i for i in range(n_layers) if i not in sliding] or None

    def _sliding_layers(self, hf, n_layers: int, out) -> list[int]:
        types = hf.get("layer_types") if self.layer_types else None
        if types is not None:
            if not isinstance(types, list) or len(types) != n_layers or any(t not in (SLIDING, FULL) for t in types):
                raise ConfigError(f"layer_types: expected {n_layers} entries of {SLIDING} or {FULL}, got "
                                  f"{str(types)[:60]}")
            return [i for i, t in enumerate(types) if t == SLIDING]
        if self.rule == "from":
            first = _value(hf, "max_window_layers", 28)
            return [i for i in range(n_layers) if i >= first]
        if self.rule == "period":
            period = int(_value(hf, self.period_key, self.period)) if self.period_key else self.period
            if period <= 0:
                raise ConfigError(f"{self.period_key}: must be a positive integer, got {period}")
            return [i for i in range(n_layers) if (i + 1) % period]
        if self.rule == "nope":
            return list(out.get("nope_layers") or [])
        return list(range(n_layers))

    def write(self, cfg, model_type):
        layers = range(cfg.n_layers) if cfg.attn_window_layers is None else cfg.attn_window_layers
        sliding = set(layers) if cfg.attn_window is not None else set()
        body: dict[str, Any] = {self.hf_key: cfg.attn_window}
        if self.enabled_key:
            body[self.enabled_key] = cfg.attn_window is not None
        if self.last_global and cfg.n_layers - 1 in sliding:
            raise CapabilityError(f"cannot export to {model_type}: its last layer is global (full attention), the "
                                  "model's slides")
        if self.layer_types:
            body["layer_types"] = [SLIDING if i in sliding else FULL for i in range(cfg.n_layers)]
            if self.rule == "from":  # transformers derives nothing from it once layer_types is written
                body["max_window_layers"] = min(sliding, default=cfg.n_layers)
        elif sliding and len(sliding) != cfg.n_layers:
            raise CapabilityError(f"cannot export to {model_type}: its window applies to every layer, the model has "
                                  f"it in layers {sorted(sliding)[:8]} only")
        nope = [i for i in range(cfg.n_layers) if i not in sliding] if cfg.attn_window is not None else []
        if self.rope_sliding_only and (cfg.nope_layers or []) != nope:
            raise CapabilityError(f"cannot export to {model_type}: it applies RoPE in exactly its sliding layers "
                                  f"(none in layers {nope[:8]}), the model has no RoPE in layers "
                                  f"{(cfg.nope_layers or [])[:8]}")
        return body


@dataclass
class NoRopeLayers(Field):
    """SmolLM3's no_rope_layers (1: the layer applies RoPE, 0: it does not; default: every no_rope_layer_interval-th
    layer has none) <-> the canonical nope_layers (the indices of the layers without RoPE)."""

    hf_key: str = "no_rope_layers"
    interval_key: str = "no_rope_layer_interval"
    default_interval: int = 4
    stage = 1  # after the layer count

    def __post_init__(self):
        self.hf_keys, self.canonical = (self.hf_key, self.interval_key), ("nope_layers",)

    def read(self, hf, out, notes):
        n_layers = out.get("n_layers")
        if not isinstance(n_layers, int) or n_layers <= 0:
            return  # ModelConfig names the bad layer count
        flags = hf.get(self.hf_key)
        if flags is None:
            interval = int(_value(hf, self.interval_key, self.default_interval))
            if interval <= 0:
                raise ConfigError(f"{self.interval_key}: must be a positive integer, got {interval}")
            flags = [int((i + 1) % interval != 0) for i in range(n_layers)]
        if not isinstance(flags, list) or len(flags) != n_layers or any(f not in (0, 1) for f in flags):
            raise ConfigError(f"{self.hf_key}: expected {n_layers} flags of 0 or 1 (one per layer), got {str(flags)[:60]}")
        out["nope_layers"] = [i for i, f in enumerate(flags) if not f] or None

    def write(self, cfg, model_type):
        nope = set(cfg.nope_layers or ())
        return {self.hf_key: [int(i not in nope) for i in range(cfg.n_layers)]}


@dataclass
class Require(Field):
    """An HF option we do not model, pinned to the one value the canonical model matches."""

    hf_key: str
    value: Any
    why: str = ""

    def __post_init__(self):
        self.hf_keys = (self.hf_key,)

    def read(self, hf, out, notes):
        v = hf.get(self.hf_key)
        if v is not None and v != self.value:
            raise CapabilityError(f"{self.hf_key}={v!r} is not supported{': ' + self.why if self.why else ''} "
                                  f"(supported: {self.value!r})")

    def write(self, cfg, model_type):
        return {self.hf_key: self.value}


LINEAR = "linear_attention"  # Qwen3.5's layer_types entry of a Gated DeltaNet layer


@dataclass
class LinearLayers(Field):
    """Qwen3.5's Gated DeltaNet layers: config.json's layer_types (linear_attention or full_attention; default every
    layer but each full_attention_interval-th, 4) and the linear_* sizes <-> linear_layers and linear_* (zeros
    without such layers)."""

    SIZES = {"linear_num_key_heads": ("linear_key_heads", 16), "linear_num_value_heads": ("linear_value_heads", 32),
             "linear_key_head_dim": ("linear_key_dim", 128), "linear_value_head_dim": ("linear_value_dim", 128),
             "linear_conv_kernel_dim": ("linear_conv", 4)}

    stage = 1  # after the sizes

    def __post_init__(self):
        self.hf_keys = ("layer_types", "full_attention_interval", *self.SIZES)
        self.canonical = ("linear_layers", *(ours for ours, _ in self.SIZES.values()))

    def read(self, hf, out, notes):
        n_layers = out.get("n_layers")
        if not isinstance(n_layers, int) or n_layers <= 0:
            return  # ModelConfig names the bad layer count
        types = hf.get("layer_types")
        if types is None:
            interval = int(_value(hf, "full_attention_interval", 4))
            if interval <= 0:
                raise ConfigError(f"full_attention_interval: must be a positive integer, got {interval}")
            types = [LINEAR if (i + 1) % interval else FULL for i in range(n_layers)]
        if not isinstance(types, list) or len(types) != n_layers or any(t not in (LINEAR, FULL) for t in types):
            raise ConfigError(f"layer_types: expected {n_layers} entries of {LINEAR} or {FULL}, got {str(types)[:60]}")
        linear = [i for i, t in enumerate(types) if t == LINEAR]
        out["linear_layers"] = linear or None
        for key, (ours, default) in self.SIZES.items():
            out[ours] = int(_value(hf, key, default)) if linear else 0

    def write(self, cfg, model_type):
        linear = set(cfg.linear_layers or ())
        body = {"layer_types": [LINEAR if i in linear else FULL for i in range(cfg.n_layers)]}
        body.update((key, getattr(cfg, ours) if linear else default) for key, (ours, default) in self.SIZES.items())
        return body


@dataclass
class GlobalLayers(Field):
    """Gemma 4's global (full_attention) layers: their head size and kv heads, as transformers 5 saves them
    (per_layer_config: {layer: {head_dim, num_key_value_heads}}) or as hub configs give them (global_head_dim,
    default 512; num_global_key_value_heads, which transformers applies only with attention_k_eq_v), and
    attention_k_eq_v <-> global_head_dim and global_kv_heads (None where they equal head_dim and n_kv_heads),
    global_k_eq_v."""

    stage = 1  # after the sizes

    def __post_init__(self):
        self.hf_keys = ("per_layer_config", "global_head_dim", "num_global_key_value_heads", "attention_k_eq_v")
        self.canonical = ("global_head_dim", "global_kv_heads", "global_k_eq_v")

    def read(self, hf, out, notes):
        k_eq_v = bool(_value(hf, "attention_k_eq_v", False))
        entries = hf.get("per_layer_config") or {}
        if not isinstance(entries, dict) or not all(isinstance(e, dict) for e in entries.values()):
            raise ConfigError(f"per_layer_config: expected an object of per-layer objects, got {str(entries)[:60]}")
        distinct = {json.dumps(e, sort_keys=True) for e in entries.values()}
        if len(distinct) > 1 or any(set(e) - {"head_dim", "num_key_value_heads"} for e in entries.values()):
            raise CapabilityError(f"per_layer_config: {str(entries)[:80]}: one head_dim and num_key_value_heads for "
                                  "every global layer is supported")
        entry = next(iter(entries.values()), {})
        head_dim = entry.get("head_dim", _value(hf, "global_head_dim", 512))
        kv = entry.get("num_key_value_heads", hf.get("num_global_key_value_heads") if k_eq_v else None)
        out["global_head_dim"] = None if head_dim == out.get("head_dim") else head_dim
        out["global_kv_heads"] = None if kv is None or kv == out.get("n_kv_heads") else kv
        out["global_k_eq_v"] = k_eq_v

    def write(self, cfg, model_type):
        if cfg.global_kv_heads is not None and not cfg.global_k_eq_v:
            raise CapabilityError(f"cannot export to {model_type}: it gives the global layers kv heads of their own "
                                  "only with attention_k_eq_v; the model has global_kv_heads without K = V")
        return {"global_head_dim": cfg.global_head_dim or cfg.head_dim, "attention_k_eq_v": cfg.global_k_eq_v,
                "num_global_key_value_heads": cfg.global_kv_heads}


@dataclass
class KVSharing(Field):
    """Gemma 4's num_kv_shared_layers (the last layers read the K/V of the last earlier layer of their type) and
    use_double_wide_mlp (their MLP twice intermediate_size) <-> kv_shared_layers and kv_shared_ffn_hidden."""

    stage = 1  # after the sizes

    def __post_init__(self):
        self.hf_keys, self.canonical = ("num_kv_shared_layers", "use_double_wide_mlp"), ("kv_shared_layers",
                                                                                          "kv_shared_ffn_hidden")

    def read(self, hf, out, notes):
        n = int(_value(hf, "num_kv_shared_layers", 0))
        out["kv_shared_layers"] = n
        double = bool(_value(hf, "use_double_wide_mlp", False)) and n > 0
        out["kv_shared_ffn_hidden"] = 2 * out["ffn_hidden"] if double and isinstance(out.get("ffn_hidden"), int) \
            else None

    def write(self, cfg, model_type):
        if cfg.kv_shared_ffn_hidden not in (None, 2 * cfg.ffn_hidden):
            raise CapabilityError(f"cannot export to {model_type}: its K/V-sharing layers' MLP is intermediate_size or "
                                  f"twice it wide, the model's is {cfg.kv_shared_ffn_hidden}")
        return {"num_kv_shared_layers": cfg.kv_shared_layers,
                "use_double_wide_mlp": cfg.kv_shared_ffn_hidden is not None}


@dataclass
class PerLayerInputs(Field):
    """Gemma 4's per-layer inputs: hidden_size_per_layer_input (default 256; 0: none) and vocab_size_per_layer_input
    (default 262144) <-> per_layer_dim and per_layer_vocab (None where it equals vocab_size)."""

    stage = 1  # after the sizes

    def __post_init__(self):
        self.hf_keys = ("hidden_size_per_layer_input", "vocab_size_per_layer_input")
        self.canonical = ("per_layer_dim", "per_layer_vocab")

    def read(self, hf, out, notes):
        dim = int(_value(hf, "hidden_size_per_layer_input", 256))
        vocab = _value(hf, "vocab_size_per_layer_input", 262144)
        out["per_layer_dim"] = dim
        out["per_layer_vocab"] = vocab if dim and vocab != out.get("vocab_size") else None

    def write(self, cfg, model_type):
        return {"hidden_size_per_layer_input": cfg.per_layer_dim,
                "vocab_size_per_layer_input": cfg.per_layer_vocab or cfg.vocab_size}


@dataclass
class ProportionalRope(LayerTypeRope):
    """Gemma 4's RoPE per layer type: LayerTypeRope, with the class default where config.json has none (sliding:
    plain, base 10000; full: proportional over a quarter of the pairs, base 1000000)."""

    def read(self, hf, out, notes):
        if hf.get("rope_parameters") is None and hf.get("rope_scaling") is None:
            hf = {**hf, "rope_parameters": {
                SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
                FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0}}}
        super().read(hf, out, notes)

    def write(self, cfg, model_type):
        """rope_parameters alone: transformers 4, which read rope_scaling, has no Gemma 4 (and 5 takes a
        rope_scaling over rope_parameters)."""
        body = super().write(cfg, model_type)
        return {"rope_parameters": body["rope_parameters"]}


class ConfigMap(Protocol):
    """config.json <-> ModelConfig for one architecture (what Architecture.config holds)."""

    def read(self, hf: Mapping[str, Any], name: str = "") -> tuple[ModelConfig, list[str]]: ...

    def write(self, cfg: ModelConfig, model_type: str) -> dict[str, Any]: ...


@dataclass(frozen=True)
class ConfigSpec:
    """The declarative ConfigMap of the dense architectures (a family record's keys and traits: family.py); `read`
    and `write` are each other's inverse. (The native mixtures' are converters/hf/moe_family.py's.)"""

    fields: tuple[Field, ...]
    fixed: Mapping[str, Any] = field(default_factory=dict)

    def covered(self) -> set[str]:
        """Canonical fields this spec reads or fixes (tests check it covers every dense field)."""
        out = set(self.fixed)
        for f in self.fields:
            out.update(f.canonical)
        return out

    def read(self, hf: Mapping[str, Any], name: str = "") -> tuple[ModelConfig, list[str]]:
        """config.json dict -> (ModelConfig, notes about accepted-but-unmodelled features). A value
        of the wrong type or range is a ConfigError naming the config.json key."""
        out: dict[str, Any] = dict(self.fixed)
        notes: list[str] = []
        for f in sorted(self.fields, key=lambda f: f.stage):
            with wrong_values(hf, f.hf_keys or f.canonical):
                f.read(hf, out, notes)
        out["name"] = name
        hf_key = {c: f.hf_keys[0] for f in self.fields if f.hf_keys for c in f.canonical}
        return model_config(out, hf_key), notes


    def write(self, cfg: ModelConfig, model_type: str) -> dict[str, Any]:
        """ModelConfig -> config.json entries for `model_type`; capability errors before any I/O."""
        if cfg.is_mixture:
            raise CapabilityError(f"cannot export to {model_type}: the model is a mixture "
                                  f"(ffn_experts={cfg.ffn_experts}, attn_experts={cfg.attn_experts}); "
                                  "a dense architecture holds one FFN and one attention per layer")
        for fname, want in self.fixed.items():
            have = getattr(cfg, fname)
            if have != want:
                raise CapabilityError(f"cannot export to {model_type}: it needs {fname}={want!r}, "
                                      f"the model has {have!r}")
        body: dict[str, Any] = {}
        for f in self.fields:
            body.update(f.write(cfg, model_type))
        return body


def model_config(fields: dict[str, Any], hf_key: Mapping[str, str]) -> ModelConfig:
    """ModelConfig(**fields); its errors name the config.json key: 'num_attention_heads (n_heads): ...'."""
    try:
        return ModelConfig(**fields)
    except ConfigError as e:
        field_name, sep, rest = str(e).partition(":")
        if sep and field_name in hf_key and hf_key[field_name] != field_name:
            raise ConfigError(f"{hf_key[field_name]} ({field_name}):{rest}") from None
        raise


@contextmanager
def wrong_values(hf: Mapping[str, Any], keys: tuple[str, ...]):
    """Turn a type or value error while reading `keys` (e.g. float("abc"), a list where a name
    belongs) into a ConfigError naming the keys and the values found."""
    try:
        yield
    except (ConfigError, CapabilityError):
        raise
    except (TypeError, ValueError, ArithmeticError, AttributeError, KeyError) as e:
        found = {k: hf[k] for k in keys if k in hf} or dict.fromkeys(keys)
        shown = ", ".join(f"{k}={str(v)[:60]!r}" if isinstance(v, str) else f"{k}={str(v)[:60]}"
                          for k, v in found.items())
        raise ConfigError(f"{', '.join(found)}: wrong type or value ({shown}: {type(e).__name__})") from None


def hf_to_model_config(hf: Mapping[str, Any], spec: ConfigSpec, name: str = "") -> tuple[ModelConfig, list[str]]:
    return spec.read(hf, name)


def model_config_to_hf(cfg: ModelConfig, spec: ConfigSpec, model_type: str) -> dict[str, Any]:
    return spec.write(cfg, model_type)
