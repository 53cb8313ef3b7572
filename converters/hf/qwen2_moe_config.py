"""Qwen2-MoE's config.json <-> ModelConfig, and what a mixture needs to be exported as Qwen2-MoE.

Qwen2MoeForCausalLM computes, per layer: a sequential pre-norm block with RMSNorm, dense (GQA) attention with
biases on q/k/v (none on o) and no QK-norm, half-split RoPE (any scaled RoPE) over the whole head, and a sparse MoE block of SwiGLU experts
(softmax over all experts, top-k, renormalized when `norm_topk_prob`) plus an always-on shared SwiGLU expert
whose output is scaled by sigmoid(shared_expert_gate(x)). That is our runtime with `ffn_shared_hidden` > 0
(recipe btx-shared-expert), and, with that shared expert all zeros, every BTX or upcycled mixture of this trunk;
`qwen2_moe_problems` lists what a model lacks, from the config alone. What a model lacks of Qwen2-MoE's layout (q/k/v
biases, a shared expert) is written as zeros, which add exactly nothing (converters/qwen2_moe.py).
"""
from __future__ import annotations

from typing import Any, Mapping

from bam_surgery.runtime.config import ModelConfig

from ..base import CapabilityError
from .moe_family import (TRUNK_FIELDS, MoeConfigMap, Problems, bias_problem, every_layer_sparse, gate_norm_of,
                          sparse_entries, trunk_problems)

ARCHITECTURE = "Qwen2MoeForCausalLM"
MODEL_TYPE = "qwen2_moe"

# canonical field -> Qwen2MoeConfig field (read runs it backwards)
CONFIG_FIELDS: dict[str, str] = {**TRUNK_FIELDS, "ffn_hidden": "moe_intermediate_size", "ffn_experts": "num_experts",
                                  "ffn_shared_hidden": "shared_expert_intermediate_size"}
# Qwen2MoeConfig's defaults (transformers 5.23) for fields a config.json may leave out.
QWEN2_MOE_DEFAULTS: dict[str, Any] = {
    "vocab_size": 151936, "hidden_size": 2048, "moe_intermediate_size": 1408, "num_hidden_layers": 24,
    "num_attention_heads": 16, "num_key_value_heads": 16, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768,
    "tie_word_embeddings": False, "num_experts": 60, "num_experts_per_tok": 4,
    "shared_expert_intermediate_size": 5632, "router_aux_loss_coef": 0.001, "hidden_act": "silu",
    "rope_theta": 10000.0, "norm_topk_prob": False, "decoder_sparse_step": 1, "head_dim": None,
    "sliding_window": 4096, "use_sliding_window": False,
}


def qwen2_moe_problems(cfg: ModelConfig) -> list[tuple[str, str]]:
    """(what Qwen2-MoE needs, what this model has) for every feature Qwen2-MoE cannot express."""
    return trunk_problems(cfg) + bias_problem(cfg, ("q/k/v",), "no biases but on q/k/v")


class Qwen2MoeConfigMap(MoeConfigMap):
    architecture, model_type, key_of, defaults = ARCHITECTURE, MODEL_TYPE, CONFIG_FIELDS, QWEN2_MOE_DEFAULTS
    typed_keys = ("mlp_only_layers", "decoder_sparse_step", "norm_topk_prob")

    def problems(self, cfg: ModelConfig) -> Problems:
        return qwen2_moe_problems(cfg)

    def entries(self, cfg: ModelConfig) -> dict[str, Any]:
        return dict(**sparse_entries(cfg),
                    qkv_bias=True,  # transformers >= 5 reads it; older versions always have q/k/v biases
                    use_sliding_window=False, sliding_window=None, max_window_layers=cfg.n_layers)

    def read_fields(self, hf: Mapping[str, Any], get) -> dict[str, Any]:
        every_layer_sparse(hf, get)
        if not hf.get("qkv_bias", True):
            raise CapabilityError("qkv_bias false is not supported on import (export always writes q/k/v biases)")
        return {"qkv_bias": True, **gate_norm_of(get)}


QWEN2_MOE = Qwen2MoeConfigMap()


def check_qwen2_moe(cfg: ModelConfig, recipe: str | None = None) -> None:
    """Raise CapabilityError (one line) if Qwen2-MoE cannot compute exactly what this model computes."""
    QWEN2_MOE.check(cfg, recipe)
