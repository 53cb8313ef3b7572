"""The native mixture formats (converters/hf/families.py has one record each): the trunk they compute, the
config.json entries they write alike, the checks of reading one back, and the ways they differ, as mechanisms.

Each is a sequential block with RMSNorm (no bias), half-split RoPE over the whole head (any scaled RoPE, read and
written by config_map.Rope like the dense families), dense GQA attention and SwiGLU FFN experts behind a linear
router, a final norm and an unscaled head. They differ in the trunk's norms (the record's traits qk_norm and
norm_position: norms before the sublayers or after them, no QK-norm, a per-head or a full-width one) and in how they
gate, which biases they hold and whether they have a shared expert:
  RenormalizedMoe   top-k gates always renormalized, no biases, no shared expert
  SharedExpertMoe   a shared expert beside the routed ones and q/k/v biases, always (zeros for a model without either:
                    converters/native_moe.py), the top-k renormalized when norm_topk_prob
  AttentionBiasMoe  q/k/v and o biases together (attention_bias), the top-k renormalized when norm_topk_prob
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable, Mapping

from bam_surgery.runtime.config import ConfigError, ModelConfig

from ..base import CapabilityError
from ..carry import SIZES, TRAINING, Carry, Column, anything, rule, values
from .config_map import ConfigSpec, Rope, model_config, wrong_values

Problems = list[tuple[str, str]]  # (what the architecture needs, what the model has)

# canonical field -> config.json key, the same in Mixtral and Qwen2-MoE; each adds its expert count and width keys
TRUNK_FIELDS: dict[str, str] = {
    "vocab_size": "vocab_size", "d_model": "hidden_size", "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads", "head_dim": "head_dim",
    "norm_eps": "rms_norm_eps", "max_positions": "max_position_embeddings", "tie_embeddings": "tie_word_embeddings",
    "ffn_top_k": "num_experts_per_tok", "lb_coef": "router_aux_loss_coef",
}


_QK_NORMS = {"none": "no QK-norm", "head": "a per-head QK-norm", "full": "a full-width QK-norm"}
_NORM_POSITIONS = {"pre": "norms before attention and FFN", "post": "norms after attention and FFN",
                   "sandwich": "norms before and after attention and FFN"}


def _trunk_text(qk_norm: str, norm_position: str, other_position: str) -> str:
    """A trunk's QK-norm, and its norm position where the other trunk's differs."""
    qk = _QK_NORMS[qk_norm]
    return qk if norm_position == other_position else f"{qk} and {_NORM_POSITIONS[norm_position]}"


def trunk_rows(qk_norm: str = "none", norm_position: str = "pre") -> tuple[Carry, ...]:
    """What the Llama-family mixture trunk with this QK-norm and norm position carries (the column's rows). Which
    formats do carry a model refused here, converters/export.py:check_export adds to the refusal."""
    return (
        values("activation", ("swiglu",), "SwiGLU FFNs", "activation {}"),
        values("attn_experts", (0,), "dense attention", "{} attention experts"),
        rule("ffn_experts", lambda cfg: cfg.ffn_experts >= 2, "FFN experts", "a dense FFN (ffn_experts=0)", ">= 2"),
        values("norm", ("rmsnorm",), "RMSNorm", "norm {}"),
        values("norm_bias", (False,), "norms without bias", "norm biases"),
        values("block", ("sequential",), "sequential blocks", "block {}"),
        rule(("qk_norm", "norm_position"), lambda cfg: (cfg.qk_norm, cfg.norm_position) == (qk_norm, norm_position),
             lambda cfg: _trunk_text(qk_norm, norm_position, cfg.norm_position),
             lambda cfg: _trunk_text(cfg.qk_norm, cfg.norm_position, norm_position),
             {"qk_norm": qk_norm, "norm_position": norm_position}),
        values("position", ("rope",), "RoPE", "position {}"),
        rule("nope_layers", lambda cfg: not cfg.nope_layers, "RoPE in every layer", "no RoPE in layers {}", "None"),
        values("rope_interleaved", (False,), "half-split RoPE", "interleaved RoPE"),
        values("rotary_fraction", (1.0,), "RoPE over the whole head", "rotary_fraction {}"),
        values("logit_scale", (1.0,), "unscaled logits", "logit_scale {}"),
        values("router", ("linear",), "linear routers", "router {}"),
        values("final_norm", (True,), "a final norm", "no final norm"),
        *feature_rows(), *hybrid_rows(),
        *anything(*SIZES, "rope_theta", "tie_embeddings", "ffn_top_k"),
        *anything("scaled_rope", shown="any (config_map.Rope)"),
        *anything("attn_window_layers", "window_rope_theta", shown="None (no window)"),
        *anything("attn_top_k", "kv_mode", "attn_router", shown="any (no attention experts)"),
        *anything("router_hidden", "router_temperature", shown="any (linear routers)"),
        *anything(*TRAINING, shown="any (training only)"),
    )


def feature_rows() -> tuple[Carry, ...]:
    """The newer families' features (Gemma's, the windowed ones'), which no Llama-family trunk (nor llama.cpp's
    llama) computes: sliding windows, (1 + w) norms, scaled embeddings, a query_pre_attn_scalar, soft-capping."""
    return (
        values("attn_window", (None,), "attention over the whole prefix", "a sliding window of {}"),
        values("norm_unit_offset", (False,), "norms scaling by w", "(1 + w) norms"),
        values("scale_embeddings", (False,), "unscaled embeddings", "embeddings times sqrt(d_model)"),
        rule("attn_scale_dim", lambda cfg: cfg.attn_scale_dim in (None, cfg.head_dim),
             "attention scaled by 1/sqrt(head_dim)", "attention scaled by 1/sqrt({})", "None, head_dim"),
        rule(("attn_softcap", "final_softcap"), lambda cfg: cfg.attn_softcap is None and cfg.final_softcap is None,
             "no soft-capping", "soft-capped logits", "None"),
    )


def hybrid_rows() -> tuple[Carry, ...]:
    """Qwen3.5's and Gemma 4's features, which only their own formats carry: Gated DeltaNet layers, a gated attention
    output, global layers of their own geometry, the value norm, K/V read from other layers, per-layer inputs and the
    block scale."""
    return (
        rule("linear_layers", lambda cfg: not cfg.linear_layers, "softmax attention in every layer",
             "Gated DeltaNet layers", "None"),
        *anything("linear_key_heads", "linear_value_heads", "linear_key_dim", "linear_value_dim", "linear_conv",
                  "linear_experts", shown="0 (no Gated DeltaNet layers)"),
        values("attn_output_gate", (False,), "an ungated attention output", "a gated attention output"),
        rule(("global_head_dim", "global_kv_heads", "global_k_eq_v"),
             lambda cfg: cfg.global_head_dim is None and cfg.global_kv_heads is None and not cfg.global_k_eq_v,
             "one attention geometry in every layer", "global layers with their own head size, kv heads or K = V",
             {"global_head_dim": "None", "global_kv_heads": "None", "global_k_eq_v": "False"}),
        values("v_norm", (False,), "unnormed values", "RMS-normed values"),
        rule(("kv_shared_layers", "kv_shared_ffn_hidden"), lambda cfg: not cfg.kv_shared_layers,
             "K/V of its own in every layer", "layers reading earlier layers' K/V",
             {"kv_shared_layers": "0", "kv_shared_ffn_hidden": "None"}),
        rule(("per_layer_dim", "per_layer_vocab"), lambda cfg: not cfg.per_layer_dim, "no per-layer inputs",
             "per-layer input embeddings", {"per_layer_dim": "0", "per_layer_vocab": "None"}),
        values("layer_scale", (False,), "unscaled blocks", "a learned scale on each block's output"),
    )


def shared_expert_row() -> Carry:
    """No shared FFN expert."""
    return values("ffn_shared_hidden", (0,), "no shared expert", "a shared FFN expert")


BIASES = ("qkv_bias", "o_bias", "ffn_bias", "lm_head_bias")
_BIAS_NAMES = dict(zip(BIASES, ("q/k/v", "o", "ffn", "lm_head")))


def bias_row(allowed: tuple[str, ...], needs: str) -> Carry:
    """No biases but `allowed` (of q/k/v, o, ffn, lm_head)."""
    def outside(cfg) -> list[str]:
        return [_BIAS_NAMES[b] for b in BIASES if getattr(cfg, b) and _BIAS_NAMES[b] not in allowed]
    return rule(BIASES, lambda cfg: not outside(cfg), needs, lambda cfg: f"{', '.join(outside(cfg))} biases",
                {b: "any" if _BIAS_NAMES[b] in allowed else "False" for b in BIASES})


def attention_bias_rows() -> tuple[Carry, ...]:
    """The biases an `attention_bias` architecture (q/k/v and o together) carries."""
    return (bias_row(("q/k/v", "o"), "no biases but on attention (q/k/v and o)"),
            rule(("qkv_bias", "o_bias"), lambda cfg: cfg.qkv_bias == cfg.o_bias,
                 "q/k/v and o biases together (attention_bias)",
                 lambda cfg: "q/k/v biases without an o bias" if cfg.qkv_bias else "an o bias without q/k/v biases",
                 "equal to each other"))


def raise_problems(problems: Problems, subject: str, recipe: str | None, tail: str = "") -> None:
    """CapabilityError (one line) listing every problem, when there is one: `SUBJECT needs A and B; recipe R has
    a, b` and `tail` (e.g. the formats that do carry the model)."""
    if problems:
        who = f"recipe {recipe}" if recipe else "the model"
        raise CapabilityError(f"{subject} needs {' and '.join(n for n, _ in problems)}; "
                              f"{who} has {', '.join(h for _, h in problems)}{tail}")


def reader_of(hf: Mapping[str, Any], defaults: Mapping[str, Any]) -> Callable[[str], Any]:
    """get(key): config.json's value, else the config class's default, else a ConfigError naming the key."""
    def get(key: str) -> Any:
        if key in hf:
            return hf[key]
        if key in defaults:
            return defaults[key]
        raise ConfigError(f"{key}: required key is missing from config.json")
    return get


def check_trunk_keys(hf: Mapping[str, Any], get: Callable[[str], Any], architecture: str, model_type: str) -> None:
    """The checks of reading a Llama-family mixture's config.json: its architectures entry, silu experts, no sliding
    window shorter than the context."""
    arch = hf.get("architectures") or [architecture]
    if architecture not in arch:
        raise CapabilityError(f"architectures={arch} is not supported for model_type {model_type!r} "
                              f"(supported: {architecture})")
    if get("hidden_act") != "silu":
        raise CapabilityError(f"hidden_act {get('hidden_act')!r} is not supported (the experts use silu)")
    window = hf.get("sliding_window") if hf.get("use_sliding_window", True) else None
    if window is not None and not (isinstance(window, int) and isinstance(get("max_position_embeddings"), int)):
        raise ConfigError(f"sliding_window, max_position_embeddings: expected integers, got {window!r}, "
                          f"{get('max_position_embeddings')!r}")
    if window is not None and window < get("max_position_embeddings"):
        raise CapabilityError(f"sliding_window={window} is not supported (the runtime attends to all previous "
                              "tokens)")


def every_layer_sparse(hf: Mapping[str, Any], get: Callable[[str], Any]) -> None:
    """Qwen2-MoE's and Qwen3-MoE's decoder_sparse_step and mlp_only_layers must give every layer experts."""
    if get("decoder_sparse_step") != 1 or hf.get("mlp_only_layers"):
        raise CapabilityError("decoder_sparse_step != 1 or mlp_only_layers: layers without experts are not "
                              "supported (every layer of a mixture has the same FFN)")


def sparse_entries(cfg: ModelConfig) -> dict[str, Any]:
    """The entries of an architecture that renormalizes the top-k gates when norm_topk_prob (canonical gate_norm
    topk_softmax) and may have dense layers (Qwen2-MoE, Qwen3-MoE: none here)."""
    return dict(intermediate_size=cfg.ffn_hidden,  # the dense MLP of mlp_only_layers: there are none
                norm_topk_prob=cfg.gate_norm == "topk_softmax", decoder_sparse_step=1, mlp_only_layers=[])


def gate_norm_of(get: Callable[[str], Any]) -> dict[str, Any]:
    """norm_topk_prob -> the canonical gate_norm: renormalized top-k (topk_softmax) or the softmax's p_i."""
    return {"gate_norm": "topk_softmax" if get("norm_topk_prob") else "softmax"}


def numbers(fields: dict[str, Any], keys: tuple[str, ...], hf_key: Mapping[str, str]) -> None:
    """Turn the fields `keys` into floats in place; a non-number is a ConfigError naming its config.json key."""
    for key in keys:
        if not isinstance(fields[key], (int, float)) or isinstance(fields[key], bool):
            raise ConfigError(f"{hf_key[key]}: expected a number, got {str(fields[key])[:60]}")
        fields[key] = float(fields[key])


@dataclass(frozen=True)
class MoeConfigMap:
    """config.json <-> ModelConfig for a Llama-family mixture architecture (the interface of config_map.ConfigSpec),
    from its record (converters/hf/families.py): the architecture's names, its config.json keys and class defaults,
    its trunk; a subclass is a way of gating and holding biases (module docstring)."""

    architecture: str  # config.json "architectures" entry
    model_type: str
    key_of: Mapping[str, str]  # canonical field -> config.json key
    defaults: Mapping[str, Any]  # the config class's defaults (transformers 5.23) for keys a config.json may omit
    qk_norm: str = "none"  # the trunk
    norm_position: str = "pre"
    typed_keys: tuple[str, ...] = ()  # config.json keys whose wrong type read_fields would trip on

    qkv_bias_always = False  # the architecture always has q/k/v biases (zeros are written for a model without)
    shared_expert = False  # it has a shared expert beside the routed ones
    zero_shared_expert = False  # ... always (zeros are written for a model without: SharedExpertMoe, TrunkMoe)

    @property
    def rope(self) -> Rope:
        """RoPE as every HF family reads and writes it, with this architecture's default base."""
        return Rope(default_theta=float(self.defaults["rope_theta"]))

    @cached_property
    def column(self) -> Column:
        """What the format carries (converters/carry.py): the trunk's rows, then its own."""
        return Column(self.model_type, trunk_rows(self.qk_norm, self.norm_position) + self.own_rows())

    def own_rows(self) -> tuple[Carry, ...]:
        """How the format gates and which biases it holds (a subclass's)."""
        raise NotImplementedError

    def problems(self, cfg: ModelConfig) -> Problems:
        return self.column.problems(cfg)

    def entries(self, cfg: ModelConfig) -> dict[str, Any]:
        """The architecture's own config.json entries."""
        return {}

    def read_fields(self, hf: Mapping[str, Any], get: Callable[[str], Any]) -> dict[str, Any]:
        """The canonical fields only this architecture decides (after its own checks)."""
        return {}

    def check(self, cfg: ModelConfig, recipe: str | None = None) -> None:
        """Raise CapabilityError (one line) if the architecture cannot compute exactly what this model computes."""
        raise_problems(self.problems(cfg), f"{self.model_type} export", recipe)

    def write(self, cfg: ModelConfig, model_type: str | None = None) -> dict[str, Any]:
        """The config.json entries (the exporter adds architectures, model_type, dtype and token ids)."""
        self.check(cfg)
        body: dict[str, Any] = {hf: getattr(cfg, ours) for ours, hf in self.key_of.items()}
        body.update(hidden_act="silu", **self.rope.write(cfg, self.model_type), attention_dropout=0.0,
                    output_router_logits=False, use_cache=True, initializer_range=0.02, **self.entries(cfg))
        return body

    def read(self, hf: Mapping[str, Any], name: str | None = None) -> tuple[ModelConfig, list[str]]:
        """ModelConfig from a config.json body; refuses features the runtime does not compute. A value of the wrong
        type is a ConfigError naming its config.json key."""
        with wrong_values(hf, ("rope_parameters", "rope_scaling", "rope_theta", "hidden_act", "architectures",
                               *self.typed_keys)):
            get = reader_of(hf, self.defaults)
            check_trunk_keys(hf, get, self.architecture, self.model_type)
            rope: dict[str, Any] = {}
            self.rope.read(hf, rope, [])  # rope_theta, scaled_rope
            own = self.read_fields(hf, get)
            fields = {ours: get(theirs) for ours, theirs in self.key_of.items()}
            numbers(fields, ("norm_eps", "lb_coef"), self.key_of)
            cfg = model_config(dict(
                **fields, **rope, activation="swiglu", norm="rmsnorm", position="rope", block="sequential",
                qk_norm=self.qk_norm, norm_position=self.norm_position, attn_experts=0, **own,
                z_coef=0.0,  # the architecture's training objective has no router z-loss
                name=str(hf.get("_name_or_path") or name or self.model_type),
            ), self.key_of)
        return cfg, []


@dataclass(frozen=True)
class RenormalizedMoe(MoeConfigMap):
    """Top-k gates always renormalized to sum to 1, bias-free projections, no shared expert, a sliding_window key
    (written as none) and router jitter."""

    def own_rows(self) -> tuple[Carry, ...]:
        # the top-k probabilities renormalized to sum to 1; plain softmax gates agree only when every expert is
        # selected (then the top-k probabilities already sum to 1)
        gates = rule("gate_norm", lambda cfg: cfg.ffn_experts < 2 or cfg.gate_norm == "topk_softmax"
                     or cfg.ffn_top_k == cfg.ffn_experts,
                     "top-k gates renormalized to sum to 1 (gate_norm topk_softmax)",
                     lambda cfg: f"gate_norm {cfg.gate_norm} with top-{cfg.ffn_top_k} of {cfg.ffn_experts} experts, "
                                 f"whose gates p_i do not sum to 1, so {self.display}'s outputs would differ (rebuild "
                                 "the mixture with --gate-norm topk_softmax; in a recipe or pipeline, gate_norm: "
                                 "topk_softmax)", "topk_softmax (softmax with top-k = every expert)")
        return shared_expert_row(), bias_row((), "bias-free projections"), gates

    @property
    def display(self) -> str:
        return self.architecture.removesuffix("ForCausalLM")

    def entries(self, cfg: ModelConfig) -> dict[str, Any]:
        return {"sliding_window": None, "router_jitter_noise": 0.0}

    def read_fields(self, hf: Mapping[str, Any], get) -> dict[str, Any]:
        return {"gate_norm": "topk_softmax"}


@dataclass(frozen=True)
class SharedExpertMoe(MoeConfigMap):
    """A shared expert beside the routed ones (scaled by sigmoid(x . w)) and q/k/v biases, always: a model without
    either is written with zeros that add exactly nothing (converters/native_moe.py), so every Llama/Qwen2-family FFN
    mixture has this format, a BTX of Qwen2 models (q/k/v biases, no shared expert) among them; the top-k
    renormalized when norm_topk_prob, every layer sparse, the sliding-window keys written off."""

    qkv_bias_always = shared_expert = zero_shared_expert = True

    def own_rows(self) -> tuple[Carry, ...]:
        return (*anything("ffn_shared_hidden", shown="any (an all-zero one where the model has none)"),
                bias_row(("q/k/v",), "no biases but on q/k/v"),
                *anything("gate_norm", shown="any (norm_topk_prob)"))

    def entries(self, cfg: ModelConfig) -> dict[str, Any]:
        return dict(**sparse_entries(cfg),
                    qkv_bias=True,  # transformers >= 5 reads it; older versions always have q/k/v biases
                    use_sliding_window=False, sliding_window=None, max_window_layers=cfg.n_layers)

    def read_fields(self, hf: Mapping[str, Any], get) -> dict[str, Any]:
        every_layer_sparse(hf, get)
        if not hf.get("qkv_bias", True):
            raise CapabilityError("qkv_bias false is not supported on import (export always writes q/k/v biases)")
        return {"qkv_bias": True, **gate_norm_of(get)}


@dataclass(frozen=True)
class AttentionBiasMoe(MoeConfigMap):
    """One `attention_bias` (q/k/v and o together), the top-k renormalized when norm_topk_prob, no shared expert;
    `sparse`: the architecture may have dense layers (decoder_sparse_step, mlp_only_layers: every layer sparse here)
    and sliding-window keys (written off)."""

    sparse: bool = False

    def own_rows(self) -> tuple[Carry, ...]:
        return (shared_expert_row(), *attention_bias_rows(), *anything("gate_norm", shown="any (norm_topk_prob)"))

    def entries(self, cfg: ModelConfig) -> dict[str, Any]:
        out = {"attention_bias": cfg.qkv_bias, "norm_topk_prob": cfg.gate_norm == "topk_softmax"}
        if self.sparse:
            out.update(**sparse_entries(cfg), use_sliding_window=False, sliding_window=None)
        return out

    def read_fields(self, hf: Mapping[str, Any], get) -> dict[str, Any]:
        if self.sparse:
            every_layer_sparse(hf, get)
        bias = bool(get("attention_bias"))
        return {"qkv_bias": bias, "o_bias": bias, **gate_norm_of(get)}


def spec_rows(spec: ConfigSpec, target: str, named: Mapping[str, Carry] | None = None) -> tuple[Carry, ...]:
    """What a dense family's HF format carries, as a column's rows (a format or a llama.cpp architecture built on that
    family's trunk): each trait its record fixes at that value, and each config.json key it reads where writing the
    model's values back gives the same config (the key's own refusal, in its words, where not). `named`: rows in a
    column's own words for single fields, taken where they say the same (a trait of that value, a key's field)."""
    named = named or {}
    rows = [named[f] if f in named and named[f].allowed == (v,) else values(f, (v,), f"{f} {v!r} ({target})",
                                                                             f"{f} {{}}")
            for f, v in spec.fixed.items()]
    for key in spec.fields:
        if not key.canonical:
            continue
        if all(c in named for c in key.canonical):
            rows += [named[c] for c in key.canonical]
            continue

        def reason(cfg, key=key) -> str | None:
            try:
                key.write(cfg, target)
            except CapabilityError as e:
                return str(e).removeprefix(f"cannot export to {target}: ")
            return None

        rows.append(rule(key.canonical, lambda cfg, reason=reason: reason(cfg) is None,
                         lambda cfg, reason=reason: reason(cfg) or "", (lambda cfg, key=key: ", ".join(
                             f"{c} {getattr(cfg, c)!r}" for c in key.canonical)), f"any ({target}'s {key.hf_keys[0]})"))
    return tuple(rows)


@dataclass(frozen=True)
class TrunkMoe:
    """config.json <-> ModelConfig for a family's own trunk (its dense record's config map, `trunk`: Qwen3.5's Gated
    DeltaNet and gated attention layers) with a sparse MoE block in every layer: a linear router, the softmax over
    all experts with the top-k renormalized to sum to 1, SwiGLU experts, and an always-on shared expert scaled by
    sigmoid(x . w). A mixture without a shared expert is written with one of zeros (ZERO_SHARED_HIDDEN wide), which adds exactly
    nothing (converters/native_moe.py). The interface of MoeConfigMap."""

    architecture: str  # config.json "architectures" entry
    model_type: str
    format: str  # the --format name
    trunk: ConfigSpec
    experts: Mapping[str, tuple[str, Any]]  # the MoE block's config.json key -> (canonical field, the class default)
    defaults: Mapping[str, Any]  # the config class's defaults (transformers 5.23) of the trunk's required keys

    qkv_bias_always = False
    shared_expert = True  # always: zeros where the mixture has none (zero_shared_expert)
    zero_shared_expert = True

    @property
    def qk_norm(self) -> str:
        return self.trunk.fixed.get("qk_norm", "none")

    @property
    def norm_position(self) -> str:
        return self.trunk.fixed.get("norm_position", "pre")

    @cached_property
    def column(self) -> Column:
        """The MoE block's rows, then the trunk's (spec_rows: what the dense family's format carries)."""
        gates = rule("gate_norm", lambda cfg: cfg.ffn_experts < 2 or cfg.gate_norm == "topk_softmax"
                     or cfg.ffn_top_k == cfg.ffn_experts,
                     "top-k gates renormalized to sum to 1 (rebuild the mixture with --gate-norm topk_softmax)",
                     lambda cfg: f"gate_norm {cfg.gate_norm} with top-{cfg.ffn_top_k} of {cfg.ffn_experts} experts",
                     "topk_softmax (softmax with top-k = every expert)")
        return Column(self.format, (
            values("attn_experts", (0,), "dense attention", "{} attention experts"),
            rule("ffn_experts", lambda cfg: cfg.ffn_experts >= 2, "FFN experts", "a dense FFN (ffn_experts=0)", ">= 2"),
            values("linear_experts", (0,), "one Gated DeltaNet per linear layer", "{} DeltaNet experts"),
            gates, values("router", ("linear",), "linear routers", "router {}"),
            *anything("ffn_top_k"), *anything("ffn_shared_hidden", shown="any (an all-zero one where the model has none)"),
            *anything("attn_top_k", "kv_mode", "attn_router", shown="any (no attention experts)"),
            *anything("router_hidden", "router_temperature", shown="any (linear routers)"),
            *anything(*TRAINING, shown="any (training only)"),
            *spec_rows(self.trunk, self.model_type, self.named())))

    @staticmethod
    def named() -> dict[str, Carry]:
        """The Llama-family trunk's rows, in their words, for the fields the trunk fixes alike; SwiGLU experts."""
        out = {r.fields[0]: r for r in trunk_rows() if len(r.fields) == 1 and r.allowed is not None}
        return {**out, "activation": values("activation", ("swiglu",), "SwiGLU FFNs", "activation {}")}

    def problems(self, cfg: ModelConfig) -> Problems:
        return self.column.problems(cfg)

    def check(self, cfg: ModelConfig, recipe: str | None = None) -> None:
        raise_problems(self.problems(cfg), f"{self.format} export", recipe)

    @staticmethod
    def _trunk(cfg: ModelConfig) -> ModelConfig:
        return cfg.replace(ffn_experts=0, ffn_top_k=1, ffn_shared_hidden=0, gate_norm="softmax", router="linear",
                           attn_router=None)

    def write(self, cfg: ModelConfig, model_type: str | None = None) -> dict[str, Any]:
        self.check(cfg)
        body = self.trunk.write(self._trunk(cfg), self.model_type)
        del body["intermediate_size"]  # no dense MLP
        body.update((key, getattr(cfg, ours)) for key, (ours, _) in self.experts.items())
        body["shared_expert_intermediate_size"] = cfg.ffn_shared_hidden or 1  # zeros when it has none
        return {**body, "output_router_logits": False}

    def read(self, hf: Mapping[str, Any], name: str | None = None) -> tuple[ModelConfig, list[str]]:
        width = hf.get("moe_intermediate_size", self.experts["moe_intermediate_size"][1])
        trunk, notes = self.trunk.read({**self.defaults, **hf, "intermediate_size": width}, name or "")
        moe = {ours: hf.get(key, default) for key, (ours, default) in self.experts.items()}
        fields = {**trunk.to_dict(), **moe, "gate_norm": "topk_softmax", "z_coef": 0.0, "name": name or ""}
        return model_config(fields, {ours: key for key, (ours, _) in self.experts.items()}), notes
