"""The `qwen3_moe` and `flex_olmo` formats: BTX mixtures (dense attention, FFN experts, a linear router) of Qwen3
models as HF Qwen3-MoE, and of OLMo 2 models as HF FlexOlmo, loaded natively (`Qwen3MoeForCausalLM`,
`FlexOlmoForCausalLM`, no remote code).

On disk (what `save_pretrained` writes for both in transformers 5.x, and what 4.x holds in memory):

    model.layers.{i}.mlp.gate.weight                            [E, D]   router
    model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight          expert e
    model.layers.{i}.self_attn.{q,k}_norm.weight                [Dh] (Qwen3-MoE) or [H*Dh], [Hkv*Dh] (FlexOlmo)
    model.layers.{i}.{post_attention,post_feedforward}_layernorm.weight  FlexOlmo's norms after attention and FFN

The weight tables are in hf/architectures.py (the Qwen3 and OLMo 2 tables with their FFN rows turned into experts),
the config.json maps and the capability checks in hf/qk_norm_moe_config.py. Read back, each folder is one more HF
architecture: `convert X --out canon.safetensors`, or `open_checkpoint(X)`.
"""
from __future__ import annotations

from .mixtral import NativeMixtureExporter


class Qwen3MoeExporter(NativeMixtureExporter):
    name, model_type = "qwen3_moe", "qwen3_moe"
    summary = "HF Qwen3-MoE directory, btx/upcycle of Qwen3 inputs"


class FlexOlmoExporter(NativeMixtureExporter):
    name, model_type = "flex_olmo", "flex_olmo"
    summary = "HF FlexOlmo directory, btx/upcycle of OLMo 2 inputs"
