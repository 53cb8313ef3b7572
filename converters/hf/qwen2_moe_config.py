"""Qwen2-MoE's config.json <-> ModelConfig, and what a mixture needs to be exported as Qwen2-MoE.

Qwen2MoeForCausalLM computes, per layer: a sequential pre-norm block with RMSNorm, dense (GQA) attention with
biases on q/k/v (none on o), half-split RoPE over the whole head, and a sparse MoE block of SwiGLU experts
(softmax over all experts, top-k, renormalized when `norm_topk_prob`) plus an always-on shared SwiGLU expert
whose output is scaled by sigmoid(shared_expert_gate(x)). That is our runtime with `ffn_shared_hidden` > 0
(recipe btx-shared-expert); `qwen2_moe_problems` lists what a model lacks, from the config alone. Our models
without q/k/v biases are written with zero biases (converters/qwen2_moe.py), which Qwen2-MoE adds exactly.
"""
from __future__ import annotations

from typing import Any, Mapping

from bam_surgery.runtime.config import ConfigError, ModelConfig

from ..base import CapabilityError
from .config_map import model_config, wrong_values

ARCHITECTURE = "Qwen2MoeForCausalLM"
MODEL_TYPE = "qwen2_moe"

# canonical field -> Qwen2MoeConfig field (read runs it backwards)
CONFIG_FIELDS: dict[str, str] = {
    "vocab_size": "vocab_size",
    "d_model": "hidden_size",
    "ffn_hidden": "moe_intermediate_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "norm_eps": "rms_norm_eps",
    "max_positions": "max_position_embeddings",
    "tie_embeddings": "tie_word_embeddings",
    "ffn_experts": "num_experts",
    "ffn_top_k": "num_experts_per_tok",
    "ffn_shared_hidden": "shared_expert_intermediate_size",
    "lb_coef": "router_aux_loss_coef",
}
# Qwen2MoeConfig's defaults (transformers 5.23) for fields a config.json may leave out.
QWEN2_MOE_DEFAULTS: dict[str, Any] = {
    "vocab_size": 151936, "hidden_size": 2048, "moe_intermediate_size": 1408, "num_hidden_layers": 24,
    "num_attention_heads": 16, "num_key_value_heads": 16, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768,
    "tie_word_embeddings": False, "num_experts": 60, "num_experts_per_tok": 4,
    "shared_expert_intermediate_size": 5632, "router_aux_loss_coef": 0.001, "hidden_act": "silu",
    "rope_theta": 10000.0, "norm_topk_prob": False, "decoder_sparse_step": 1, "head_dim": None,
}


def qwen2_moe_problems(cfg: ModelConfig) -> list[tuple[str, str]]:
    """(what Qwen2-MoE needs, what this model has) for every feature Qwen2-MoE cannot express."""
    out: list[tuple[str, str]] = []

    def need(ok: bool, needs: str, has: str) -> None:
        if not ok:
            out.append((needs, has))

    need(cfg.activation == "swiglu", "SwiGLU FFNs", f"activation {cfg.activation}")
    need(cfg.attn_experts == 0, "dense attention", f"{cfg.attn_experts} attention experts")
    need(cfg.ffn_experts >= 2, "FFN experts", "a dense FFN (ffn_experts=0)")
    need(cfg.ffn_shared_hidden > 0, "a shared expert (recipe btx-shared-expert; without one use --format mixtral)",
         "no shared expert")
    need(cfg.norm == "rmsnorm", "RMSNorm", f"norm {cfg.norm}")
    need(not cfg.norm_bias, "norms without bias", "norm biases")
    need(cfg.block == "sequential", "sequential blocks", f"block {cfg.block}")
    need(cfg.position == "rope", "RoPE", f"position {cfg.position}")
    need(not cfg.rope_interleaved, "half-split RoPE", "interleaved RoPE")
    need(cfg.rotary_fraction == 1.0, "RoPE over the whole head", f"rotary_fraction {cfg.rotary_fraction}")
    biases = [n for n, on in (("o", cfg.o_bias), ("ffn", cfg.ffn_bias), ("lm_head", cfg.lm_head_bias)) if on]
    need(not biases, "no biases but on q/k/v", f"{', '.join(biases)} biases")
    need(cfg.logit_scale == 1.0, "unscaled logits", f"logit_scale {cfg.logit_scale}")
    need(cfg.ffn_router_kind == "linear", "linear routers", f"router {cfg.ffn_router_kind}")
    need(cfg.final_norm, "a final norm", "no final norm")
    return out


def check_qwen2_moe(cfg: ModelConfig, recipe: str | None = None) -> None:
    """Raise CapabilityError (one line) if Qwen2-MoE cannot compute exactly what this model computes."""
    problems = qwen2_moe_problems(cfg)
    if problems:
        who = f"recipe {recipe}" if recipe else "the model"
        raise CapabilityError(f"qwen2_moe export needs {' and '.join(n for n, _ in problems)}; "
                              f"{who} has {', '.join(h for _, h in problems)}")


class Qwen2MoeConfigMap:
    """config.json <-> ModelConfig for Qwen2MoeForCausalLM (the interface of config_map.ConfigSpec)."""

    def write(self, cfg: ModelConfig, model_type: str = MODEL_TYPE) -> dict[str, Any]:
        """The config.json entries (the exporter adds architectures, model_type, dtype and token ids)."""
        check_qwen2_moe(cfg)
        body: dict[str, Any] = {hf: getattr(cfg, ours) for ours, hf in CONFIG_FIELDS.items()}
        body.update(
            intermediate_size=cfg.ffn_hidden,  # the dense MLP of mlp_only_layers: there are none
            hidden_act="silu",
            norm_topk_prob=cfg.gate_norm == "topk_softmax",
            decoder_sparse_step=1,
            mlp_only_layers=[],
            qkv_bias=True,  # transformers >= 5 reads it; older versions always have q/k/v biases
            # transformers >= 5 reads rope_parameters; older readers read rope_theta.
            rope_parameters={"rope_theta": float(cfg.rope_theta), "rope_type": "default"},
            rope_theta=float(cfg.rope_theta),
            use_sliding_window=False,
            sliding_window=None,
            max_window_layers=cfg.n_layers,
            attention_dropout=0.0,
            output_router_logits=False,
            use_cache=True,
            initializer_range=0.02,
        )
        return body

    def read(self, hf: Mapping[str, Any], name: str = MODEL_TYPE) -> tuple[ModelConfig, list[str]]:
        """ModelConfig from a Qwen2-MoE config.json body; refuses what the runtime does not compute."""
        with wrong_values(hf, ("rope_parameters", "rope_scaling", "rope_theta", "hidden_act", "architectures",
                               "mlp_only_layers", "decoder_sparse_step", "norm_topk_prob")):
            return self._read(hf, name)

    def _read(self, hf: Mapping[str, Any], name: str) -> tuple[ModelConfig, list[str]]:
        def get(key: str) -> Any:
            if key in hf:
                return hf[key]
            if key in QWEN2_MOE_DEFAULTS:
                return QWEN2_MOE_DEFAULTS[key]
            raise ConfigError(f"{key}: required key is missing from config.json")

        arch = hf.get("architectures") or [ARCHITECTURE]
        if ARCHITECTURE not in arch:
            raise CapabilityError(f"architectures={arch} is not supported for model_type {MODEL_TYPE!r} "
                                  f"(supported: {ARCHITECTURE})")
        if get("hidden_act") != "silu":
            raise CapabilityError(f"hidden_act {get('hidden_act')!r} is not supported (Qwen2-MoE experts use silu)")
        if get("decoder_sparse_step") != 1 or hf.get("mlp_only_layers"):
            raise CapabilityError("decoder_sparse_step != 1 or mlp_only_layers: layers without experts are not "
                                  "supported (every layer of a mixture has the same FFN)")
        if not hf.get("qkv_bias", True):
            raise CapabilityError("qkv_bias false is not supported on import (export always writes q/k/v biases)")
        if hf.get("use_sliding_window"):
            raise CapabilityError("use_sliding_window is not supported (the runtime attends to all previous tokens)")
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        if not isinstance(rope, dict):
            raise ConfigError(f"rope_parameters: expected an object, got {str(rope)[:60]}")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise CapabilityError(f"rope_type {rope_type!r} is not supported (only default RoPE)")
        fields = {ours: get(theirs) for ours, theirs in CONFIG_FIELDS.items()}
        for key in ("norm_eps", "lb_coef"):
            if not isinstance(fields[key], (int, float)) or isinstance(fields[key], bool):
                raise ConfigError(f"{CONFIG_FIELDS[key]}: expected a number, got {str(fields[key])[:60]}")
            fields[key] = float(fields[key])
        cfg = model_config(dict(
            **fields,
            rope_theta=float(rope.get("rope_theta", get("rope_theta"))),
            activation="swiglu", norm="rmsnorm", position="rope", block="sequential", qkv_bias=True,
            gate_norm="topk_softmax" if get("norm_topk_prob") else "softmax", attn_experts=0,
            z_coef=0.0,  # Qwen2-MoE's training objective has no router z-loss
            name=str(hf.get("_name_or_path") or name),
        ), CONFIG_FIELDS)
        return cfg, []


QWEN2_MOE = Qwen2MoeConfigMap()
