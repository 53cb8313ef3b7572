"""Mixtral's config.json <-> ModelConfig, and what a mixture needs to be exported as Mixtral.

A mixture exports to Mixtral only if Mixtral computes exactly what our runtime computes: a
sequential pre-norm block, RMSNorm, no QK-norm, half-split RoPE (any scaled RoPE) over the whole head in
every layer, dense (GQA) attention, SwiGLU experts, no biases, and top-k gates renormalized to sum to 1. `mixtral_problems` lists what
is missing, from the config alone. The weights go through the Mixtral table in architectures.py
(a stack/unstack op per expert tensor), like every other HF architecture.
"""
from __future__ import annotations

from typing import Any, Mapping

from bam_surgery.runtime.config import ModelConfig

from .moe_family import (TRUNK_FIELDS, MoeConfigMap, Problems, bias_problem, shared_expert_problem,
                          trunk_problems)

ARCHITECTURE = "MixtralForCausalLM"
MODEL_TYPE = "mixtral"

# canonical field -> MixtralConfig field (read runs it backwards)
CONFIG_FIELDS: dict[str, str] = {**TRUNK_FIELDS, "ffn_hidden": "intermediate_size", "ffn_experts": "num_local_experts"}
# MixtralConfig's defaults (transformers 5.23) for fields a config.json may leave out.
MIXTRAL_DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-5, "max_position_embeddings": 4096 * 32, "tie_word_embeddings": False,
    "num_local_experts": 8, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.001,
    "hidden_act": "silu", "rope_theta": 1e6, "head_dim": None, "num_key_value_heads": None,
}


def mixtral_problems(cfg: ModelConfig) -> list[tuple[str, str]]:
    """(what Mixtral needs, what this model has) for every feature Mixtral cannot express."""
    out = trunk_problems(cfg) + shared_expert_problem(cfg)
    out += bias_problem(cfg, (), "bias-free projections")
    # Mixtral renormalizes the top-k probabilities to sum to 1. Plain softmax gates agree only
    # when every expert is selected (then the top-k probabilities already sum to 1).
    if cfg.ffn_experts >= 2 and cfg.gate_norm != "topk_softmax" and cfg.ffn_top_k != cfg.ffn_experts:
        out.append(("top-k gates renormalized to sum to 1 (gate_norm topk_softmax)",
                    f"gate_norm {cfg.gate_norm} with top-{cfg.ffn_top_k} of {cfg.ffn_experts} experts, "
                    "whose gates p_i do not sum to 1, so Mixtral's outputs would differ "
                    "(rebuild the mixture with --gate-norm topk_softmax; in a recipe or pipeline, gate_norm: topk_softmax)"))
    return out


class MixtralConfigMap(MoeConfigMap):
    architecture, model_type, key_of, defaults = ARCHITECTURE, MODEL_TYPE, CONFIG_FIELDS, MIXTRAL_DEFAULTS

    def problems(self, cfg: ModelConfig) -> Problems:
        return mixtral_problems(cfg)

    def entries(self, cfg: ModelConfig) -> dict[str, Any]:
        return {"sliding_window": None, "router_jitter_noise": 0.0}

    def read_fields(self, hf: Mapping[str, Any], get) -> dict[str, Any]:
        return {"gate_norm": "topk_softmax"}  # Mixtral renormalizes the top-k gates


MIXTRAL = MixtralConfigMap()


def check_mixtral(cfg: ModelConfig, recipe: str | None = None) -> None:
    """Raise CapabilityError (one line) if Mixtral cannot compute exactly what this model computes."""
    MIXTRAL.check(cfg, recipe)
