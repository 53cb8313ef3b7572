"""Mixtral's config.json <-> ModelConfig, and what a mixture needs to be exported as Mixtral.

A mixture exports to Mixtral only if Mixtral computes exactly what our runtime computes: a
sequential pre-norm block, RMSNorm, half-split RoPE over the whole head, dense (GQA) attention,
SwiGLU experts, no biases, and top-k gates renormalized to sum to 1. `mixtral_problems` lists what
is missing, from the config alone. The weights go through the Mixtral table in architectures.py
(a stack/unstack op per expert tensor), like every other HF architecture.
"""
from __future__ import annotations

from typing import Any, Mapping

from bam_surgery.runtime.config import ConfigError, ModelConfig

from ..base import CapabilityError
from .config_map import model_config, wrong_values

ARCHITECTURE = "MixtralForCausalLM"
MODEL_TYPE = "mixtral"

# canonical field -> MixtralConfig field (read runs it backwards)
CONFIG_FIELDS: dict[str, str] = {
    "vocab_size": "vocab_size",
    "d_model": "hidden_size",
    "ffn_hidden": "intermediate_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "norm_eps": "rms_norm_eps",
    "max_positions": "max_position_embeddings",
    "tie_embeddings": "tie_word_embeddings",
    "ffn_experts": "num_local_experts",
    "ffn_top_k": "num_experts_per_tok",
    "lb_coef": "router_aux_loss_coef",
}
# MixtralConfig's defaults (transformers 5.23) for fields a config.json may leave out.
MIXTRAL_DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-5, "max_position_embeddings": 4096 * 32, "tie_word_embeddings": False,
    "num_local_experts": 8, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.001,
    "hidden_act": "silu", "rope_theta": 1e6, "head_dim": None, "num_key_value_heads": None,
}


def mixtral_problems(cfg: ModelConfig) -> list[tuple[str, str]]:
    """(what Mixtral needs, what this model has) for every feature Mixtral cannot express."""
    out: list[tuple[str, str]] = []

    def need(ok: bool, needs: str, has: str) -> None:
        if not ok:
            out.append((needs, has))

    need(cfg.activation == "swiglu", "SwiGLU FFNs", f"activation {cfg.activation}")
    need(cfg.attn_experts == 0, "dense attention", f"{cfg.attn_experts} attention experts")
    need(cfg.ffn_experts >= 2, "FFN experts", "a dense FFN (ffn_experts=0)")
    need(not cfg.ffn_shared_hidden, "no shared expert (--format qwen2_moe carries one)", "a shared FFN expert")
    need(cfg.norm == "rmsnorm", "RMSNorm", f"norm {cfg.norm}")
    need(not cfg.norm_bias, "norms without bias", "norm biases")
    need(cfg.block == "sequential", "sequential blocks", f"block {cfg.block}")
    need(cfg.position == "rope", "RoPE", f"position {cfg.position}")
    need(not cfg.rope_interleaved, "half-split RoPE", "interleaved RoPE")
    need(cfg.rotary_fraction == 1.0, "RoPE over the whole head", f"rotary_fraction {cfg.rotary_fraction}")
    biases = [n for n, on in (("q/k/v", cfg.qkv_bias), ("o", cfg.o_bias), ("ffn", cfg.ffn_bias),
                              ("lm_head", cfg.lm_head_bias)) if on]
    need(not biases, "bias-free projections", f"{', '.join(biases)} biases")
    need(cfg.logit_scale == 1.0, "unscaled logits", f"logit_scale {cfg.logit_scale}")
    need(cfg.ffn_router_kind == "linear", "linear routers", f"router {cfg.ffn_router_kind}")
    need(cfg.final_norm, "a final norm", "no final norm")
    # Mixtral renormalizes the top-k probabilities to sum to 1. Plain softmax gates agree only
    # when every expert is selected (then the top-k probabilities already sum to 1).
    if cfg.ffn_experts >= 2 and cfg.gate_norm != "topk_softmax" and cfg.ffn_top_k != cfg.ffn_experts:
        out.append(("top-k gates renormalized to sum to 1 (gate_norm topk_softmax)",
                    f"gate_norm {cfg.gate_norm} with top-{cfg.ffn_top_k} of {cfg.ffn_experts} experts, "
                    "whose gates p_i do not sum to 1, so Mixtral's outputs would differ "
                    "(rebuild the mixture with gate_norm: topk_softmax)"))
    return out


def check_mixtral(cfg: ModelConfig, recipe: str | None = None) -> None:
    """Raise CapabilityError (one line) if Mixtral cannot compute exactly what this model computes."""
    problems = mixtral_problems(cfg)
    if problems:
        who = f"recipe {recipe}" if recipe else "the model"
        raise CapabilityError(f"mixtral export needs {' and '.join(n for n, _ in problems)}; "
                              f"{who} has {', '.join(h for _, h in problems)}")


class MixtralConfigMap:
    """config.json <-> ModelConfig for MixtralForCausalLM (the interface of config_map.ConfigSpec)."""

    def write(self, cfg: ModelConfig, model_type: str = MODEL_TYPE) -> dict[str, Any]:
        """The config.json entries (the exporter adds architectures, model_type, dtype and token ids)."""
        check_mixtral(cfg)
        body: dict[str, Any] = {hf: getattr(cfg, ours) for ours, hf in CONFIG_FIELDS.items()}
        body.update(
            hidden_act="silu",
            # transformers >= 5 reads rope_parameters; older readers read rope_theta.
            rope_parameters={"rope_theta": float(cfg.rope_theta), "rope_type": "default"},
            rope_theta=float(cfg.rope_theta),
            sliding_window=None,
            attention_dropout=0.0,
            router_jitter_noise=0.0,
            output_router_logits=False,
            use_cache=True,
            initializer_range=0.02,
        )
        return body

    def read(self, hf: Mapping[str, Any], name: str = MODEL_TYPE) -> tuple[ModelConfig, list[str]]:
        """ModelConfig from a Mixtral config.json body; refuses features the runtime does not compute.
        A value of the wrong type is a ConfigError naming its config.json key."""
        with wrong_values(hf, ("rope_parameters", "rope_scaling", "rope_theta", "hidden_act", "architectures")):
            return self._read(hf, name)

    def _read(self, hf: Mapping[str, Any], name: str) -> tuple[ModelConfig, list[str]]:
        def get(key: str) -> Any:
            if key in hf:
                return hf[key]
            if key in MIXTRAL_DEFAULTS:
                return MIXTRAL_DEFAULTS[key]
            raise ConfigError(f"{key}: required key is missing from config.json")

        arch = hf.get("architectures") or [ARCHITECTURE]
        if ARCHITECTURE not in arch:
            raise CapabilityError(f"architectures={arch} is not supported for model_type {MODEL_TYPE!r} "
                                  f"(supported: {ARCHITECTURE})")
        if get("hidden_act") != "silu":
            raise CapabilityError(f"hidden_act {get('hidden_act')!r} is not supported (Mixtral experts use silu)")
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        if not isinstance(rope, dict):
            raise ConfigError(f"rope_parameters: expected an object, got {str(rope)[:60]}")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise CapabilityError(f"rope_type {rope_type!r} is not supported (only default RoPE)")
        window = hf.get("sliding_window")
        if window is not None and not (isinstance(window, int) and isinstance(get("max_position_embeddings"), int)):
            raise ConfigError(f"sliding_window, max_position_embeddings: expected integers, got {window!r}, "
                              f"{get('max_position_embeddings')!r}")
        if window is not None and window < get("max_position_embeddings"):
            raise CapabilityError(f"sliding_window={window} is not supported (the runtime attends to all "
                                  "previous tokens)")
        fields = {ours: get(theirs) for ours, theirs in CONFIG_FIELDS.items()}
        for key in ("norm_eps", "lb_coef"):
            if not isinstance(fields[key], (int, float)) or isinstance(fields[key], bool):
                raise ConfigError(f"{CONFIG_FIELDS[key]}: expected a number, got {str(fields[key])[:60]}")
            fields[key] = float(fields[key])
        cfg = model_config(dict(
            **fields,
            rope_theta=float(rope.get("rope_theta", get("rope_theta"))),
            activation="swiglu", norm="rmsnorm", position="rope", block="sequential",
            gate_norm="topk_softmax", attn_experts=0,
            z_coef=0.0,  # Mixtral's training objective has no router z-loss
            name=str(hf.get("_name_or_path") or name),
        ), CONFIG_FIELDS)
        return cfg, []


MIXTRAL = MixtralConfigMap()
