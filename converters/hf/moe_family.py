"""What the Llama-family mixture architectures (Mixtral, Qwen2-MoE, Qwen3-MoE, FlexOlmo) share: the trunk they
compute, the config.json entries they write alike, and the checks of reading one back.

Each is a sequential block with RMSNorm (no bias), half-split RoPE over the whole head (any scaled RoPE, read and
written by config_map.Rope like the dense families), dense GQA attention and SwiGLU FFN experts behind a linear
router, a final norm and an unscaled head. They differ in the trunk's norms (`TRUNKS`: Mixtral and Qwen2-MoE have
no QK-norm and norms before the sublayers, Qwen3-MoE a per-head QK-norm, FlexOlmo OLMo 2's full-width QK-norm and
norms after the sublayers) and in what mixtral_config.py, qwen2_moe_config.py and qwen3_moe_config.py add
(biases, gate normalization, the shared expert).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

from bam_surgery.runtime.config import ConfigError, ModelConfig

from ..base import CapabilityError
from .config_map import Rope, model_config, wrong_values

Problems = list[tuple[str, str]]  # (what the architecture needs, what the model has)

# canonical field -> config.json key, the same in Mixtral and Qwen2-MoE; each adds its expert count and width keys
TRUNK_FIELDS: dict[str, str] = {
    "vocab_size": "vocab_size", "d_model": "hidden_size", "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads", "head_dim": "head_dim",
    "norm_eps": "rms_norm_eps", "max_positions": "max_position_embeddings", "tie_embeddings": "tie_word_embeddings",
    "ffn_top_k": "num_experts_per_tok", "lb_coef": "router_aux_loss_coef",
}


# (qk_norm, norm_position) of each mixture trunk -> the format that carries it (the formats say so when they refuse)
TRUNKS: dict[tuple[str, str], str] = {("none", "pre"): "mixtral", ("head", "pre"): "qwen3_moe",
                                      ("full", "post"): "flex_olmo"}
_QK_NORMS = {"none": "no QK-norm", "head": "a per-head QK-norm", "full": "a full-width QK-norm"}
_NORM_POSITIONS = {"pre": "norms before attention and FFN", "post": "norms after attention and FFN",
                   "sandwich": "norms before and after attention and FFN"}


def _trunk_text(qk_norm: str, norm_position: str, other_position: str) -> str:
    """A trunk's QK-norm, and its norm position where the other trunk's differs."""
    qk = _QK_NORMS[qk_norm]
    return qk if norm_position == other_position else f"{qk} and {_NORM_POSITIONS[norm_position]}"


def trunk_problems(cfg: ModelConfig, qk_norm: str = "none", norm_position: str = "pre") -> Problems:
    """Every feature of `cfg` the Llama-family mixture trunk with this QK-norm and norm position cannot express (from
    the config alone). A model whose trunk another format has is told to use it (`TRUNKS`)."""
    elsewhere = TRUNKS.get((cfg.qk_norm, cfg.norm_position))
    hint = f" (use --format {elsewhere})" if elsewhere else ""
    checks = [
        (cfg.activation == "swiglu", "SwiGLU FFNs", f"activation {cfg.activation}"),
        (cfg.attn_experts == 0, "dense attention", f"{cfg.attn_experts} attention experts"),
        (cfg.ffn_experts >= 2, "FFN experts", "a dense FFN (ffn_experts=0)"),
        (cfg.norm == "rmsnorm", "RMSNorm", f"norm {cfg.norm}"),
        (not cfg.norm_bias, "norms without bias", "norm biases"),
        (cfg.block == "sequential", "sequential blocks", f"block {cfg.block}"),
        ((cfg.qk_norm, cfg.norm_position) == (qk_norm, norm_position),
         _trunk_text(qk_norm, norm_position, cfg.norm_position),
         _trunk_text(cfg.qk_norm, cfg.norm_position, norm_position) + hint),
        (cfg.position == "rope", "RoPE", f"position {cfg.position}"),
        (not cfg.nope_layers, "RoPE in every layer", f"no RoPE in layers {cfg.nope_layers}"),
        (not cfg.rope_interleaved, "half-split RoPE", "interleaved RoPE"),
        (cfg.rotary_fraction == 1.0, "RoPE over the whole head", f"rotary_fraction {cfg.rotary_fraction}"),
        (cfg.logit_scale == 1.0, "unscaled logits", f"logit_scale {cfg.logit_scale}"),
        (cfg.ffn_router_kind == "linear", "linear routers", f"router {cfg.ffn_router_kind}"),
        (cfg.final_norm, "a final norm", "no final norm"),
    ]
    return [(needs, has) for ok, needs, has in checks if not ok] + gemma_problems(cfg) + hybrid_problems(cfg)


def hybrid_problems(cfg: ModelConfig) -> Problems:
    """Qwen3.5's and Gemma 4's features, which only their own formats carry: Gated DeltaNet layers, a gated
    attention output, global layers of their own geometry, the value norm, K/V read from other layers, per-layer
    inputs and the block scale."""
    global_geometry = cfg.global_head_dim is None and cfg.global_kv_heads is None and not cfg.global_k_eq_v
    checks = [
        (not cfg.linear_layers, "softmax attention in every layer", "Gated DeltaNet layers"),
        (not cfg.attn_output_gate, "an ungated attention output", "a gated attention output"),
        (global_geometry, "one attention geometry in every layer", "global layers with their own head size, kv "
                                                                     "heads or K = V"),
        (not cfg.v_norm, "unnormed values", "RMS-normed values"),
        (not cfg.kv_shared_layers, "K/V of its own in every layer", "layers reading earlier layers' K/V"),
        (not cfg.per_layer_dim, "no per-layer inputs", "per-layer input embeddings"),
        (not cfg.layer_scale, "unscaled blocks", "a learned scale on each block's output"),
    ]
    return [(needs, has) for ok, needs, has in checks if not ok]


def gemma_problems(cfg: ModelConfig) -> Problems:
    """Gemma's and the windowed families' features, which no Llama-family trunk (nor llama.cpp's llama) computes:
    sliding windows, (1 + w) norms, scaled embeddings, a query_pre_attn_scalar, soft-capping."""
    checks = [
        (cfg.attn_window is None, "attention over the whole prefix", f"a sliding window of {cfg.attn_window}"),
        (not cfg.norm_unit_offset, "norms scaling by w", "(1 + w) norms"),
        (not cfg.scale_embeddings, "unscaled embeddings", "embeddings times sqrt(d_model)"),
        (cfg.attn_scale_dim in (None, cfg.head_dim), "attention scaled by 1/sqrt(head_dim)",
         f"attention scaled by 1/sqrt({cfg.attn_scale_dim})"),
        (cfg.attn_softcap is None and cfg.final_softcap is None, "no soft-capping", "soft-capped logits"),
    ]
    return [(needs, has) for ok, needs, has in checks if not ok]


def shared_expert_problem(cfg: ModelConfig) -> Problems:
    """A shared FFN expert, which only Qwen2-MoE carries."""
    return [("no shared expert (--format qwen2_moe carries one)", "a shared FFN expert")] if cfg.ffn_shared_hidden else []


def attention_bias_problems(cfg: ModelConfig) -> Problems:
    """The biases an `attention_bias` architecture (q/k/v and o together, Qwen3-MoE, FlexOlmo) cannot carry."""
    out = bias_problem(cfg, ("q/k/v", "o"), "no biases but on attention (q/k/v and o)")
    if cfg.qkv_bias != cfg.o_bias:
        out.append(("q/k/v and o biases together (attention_bias)",
                    "q/k/v biases without an o bias" if cfg.qkv_bias else "an o bias without q/k/v biases"))
    return out


def bias_problem(cfg: ModelConfig, allowed: tuple[str, ...], needs: str) -> Problems:
    """The biases of `cfg` outside `allowed` (of q/k/v, o, ffn, lm_head), as one problem."""
    biases = [n for n, on in (("q/k/v", cfg.qkv_bias), ("o", cfg.o_bias), ("ffn", cfg.ffn_bias),
                              ("lm_head", cfg.lm_head_bias)) if on and n not in allowed]
    return [(needs, f"{', '.join(biases)} biases")] if biases else []


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


class MoeConfigMap:
    """config.json <-> ModelConfig for a Llama-family mixture architecture (the interface of config_map.ConfigSpec).
    A subclass names the architecture and says what it adds: its problems, its config.json entries, and the
    canonical fields it reads (checking what only it has)."""

    architecture: str  # config.json "architectures" entry
    model_type: str
    key_of: Mapping[str, str]  # canonical field -> config.json key
    defaults: Mapping[str, Any]  # the config class's defaults (transformers 5.23) for keys a config.json may omit
    typed_keys: tuple[str, ...] = ()  # config.json keys whose wrong type read_fields would trip on
    qk_norm, norm_position = "none", "pre"  # the trunk (TRUNKS)

    @property
    def rope(self) -> Rope:
        """RoPE as every HF family reads and writes it, with this architecture's default base."""
        return Rope(default_theta=float(self.defaults["rope_theta"]))

    def problems(self, cfg: ModelConfig) -> Problems:
        raise NotImplementedError

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
