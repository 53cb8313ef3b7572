"""Qwen3-MoE's and FlexOlmo's config.json <-> ModelConfig, and what a mixture needs to be exported as either.

Qwen3MoeForCausalLM is Qwen2-MoE's block without the shared expert and with Qwen3's attention: an RMS norm per head
on q and k (before RoPE), biases on q/k/v and o together (`attention_bias`), softmax over all experts, top-k,
renormalized when `norm_topk_prob`. That is a BTX mixture of Qwen3 models (canonical qk_norm "head"). A Llama-family
mixture without QK-norm is refused: Qwen3-MoE always normalizes q and k, so it would compute another function
(Mixtral carries it).

FlexOlmoForCausalLM is OLMo 2's trunk (no norm before attention or FFN: each sublayer's output is RMS-normed before
the residual add; an RMS QK-norm over the full q and k width) with the same router and SwiGLU experts: a BTX mixture
of OLMo 2 models (canonical qk_norm "full", norm_position "post").

Both carry the canonical gate_norm through norm_topk_prob (true: topk_softmax, false: softmax) and any scaled RoPE;
`problems` lists what they cannot express, from the config alone.
"""
from __future__ import annotations

from typing import Any, Mapping

from bam_surgery.runtime.config import ModelConfig

from .moe_family import (TRUNK_FIELDS, MoeConfigMap, Problems, attention_bias_problems, every_layer_sparse, gate_norm_of,
                         shared_expert_problem, sparse_entries, trunk_problems)


class AttentionBiasMoeConfigMap(MoeConfigMap):
    """A mixture architecture with one `attention_bias` (q/k/v and o), norm_topk_prob and no shared expert."""

    def problems(self, cfg: ModelConfig) -> Problems:
        return (trunk_problems(cfg, self.qk_norm, self.norm_position) + shared_expert_problem(cfg)
                + attention_bias_problems(cfg))

    def entries(self, cfg: ModelConfig) -> dict[str, Any]:
        return {"attention_bias": cfg.qkv_bias, "norm_topk_prob": cfg.gate_norm == "topk_softmax"}

    def read_fields(self, hf: Mapping[str, Any], get) -> dict[str, Any]:
        bias = bool(get("attention_bias"))
        return {"qkv_bias": bias, "o_bias": bias, **gate_norm_of(get)}


class Qwen3MoeConfigMap(AttentionBiasMoeConfigMap):
    architecture, model_type, qk_norm = "Qwen3MoeForCausalLM", "qwen3_moe", "head"
    key_of = {**TRUNK_FIELDS, "ffn_hidden": "moe_intermediate_size", "ffn_experts": "num_experts"}
    # Qwen3MoeConfig's defaults (transformers 5.23) for fields a config.json may leave out.
    defaults = {
        "vocab_size": 151936, "hidden_size": 2048, "moe_intermediate_size": 768, "num_hidden_layers": 24,
        "num_attention_heads": 32, "num_key_value_heads": 4, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768,
        "tie_word_embeddings": False, "num_experts": 128, "num_experts_per_tok": 8, "router_aux_loss_coef": 0.001,
        "hidden_act": "silu", "rope_theta": 10000.0, "norm_topk_prob": False, "decoder_sparse_step": 1,
        "head_dim": None, "attention_bias": False, "sliding_window": 4096, "use_sliding_window": False,
    }
    typed_keys = ("mlp_only_layers", "decoder_sparse_step", "norm_topk_prob", "attention_bias")

    def entries(self, cfg: ModelConfig) -> dict[str, Any]:
        return {**super().entries(cfg), **sparse_entries(cfg), "use_sliding_window": False, "sliding_window": None}

    def read_fields(self, hf: Mapping[str, Any], get) -> dict[str, Any]:
        every_layer_sparse(hf, get)
        return super().read_fields(hf, get)


class FlexOlmoConfigMap(AttentionBiasMoeConfigMap):
    architecture, model_type, qk_norm, norm_position = "FlexOlmoForCausalLM", "flex_olmo", "full", "post"
    key_of = {**TRUNK_FIELDS, "ffn_hidden": "intermediate_size", "ffn_experts": "num_experts"}
    # FlexOlmoConfig's defaults (transformers 5.23) for fields a config.json may leave out.
    defaults = {
        "vocab_size": 100352, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": None, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
        "tie_word_embeddings": False, "num_experts": 7, "num_experts_per_tok": 5, "router_aux_loss_coef": 0.01,
        "hidden_act": "silu", "rope_theta": 500000.0, "norm_topk_prob": False, "head_dim": None,
        "attention_bias": False,
    }
    typed_keys = ("norm_topk_prob", "attention_bias")


QWEN3_MOE, FLEX_OLMO = Qwen3MoeConfigMap(), FlexOlmoConfigMap()
