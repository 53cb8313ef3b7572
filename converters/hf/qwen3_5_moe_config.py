"""Qwen3.5-MoE's config.json <-> ModelConfig, and what a mixture needs to be exported as it.

Qwen3_5MoeForCausalLM is Qwen3.5's trunk (its Gated DeltaNet and gated attention layers, read and written by
config_map.QWEN3_5_TEXT) with a sparse MoE block in every layer: a linear router, softmax over all experts, top-k
renormalized to sum to 1, SwiGLU experts of moe_intermediate_size, and an always-on shared expert scaled by
sigmoid(x . w). That is a BTX of Qwen3.5 models (gate_norm topk_softmax): recipe btx-shared-expert's shared expert is
its shared expert; a mixture without one is written with a shared expert whose weights are zero (width 1), which
adds exactly nothing (converters/qwen3_5_moe.py).
"""
from __future__ import annotations

from typing import Any, Mapping

from bam_surgery.runtime.config import ModelConfig

from ..base import CapabilityError
from .config_map import QWEN3_5_TEXT, model_config
from .moe_family import Problems, raise_problems

MODEL_TYPE, ARCHITECTURE = "qwen3_5_moe_text", "Qwen3_5MoeForCausalLM"
# the MoE block's keys -> canonical fields, and Qwen3_5MoeTextConfig's defaults (transformers 5.23) for them
MOE_KEYS = {"moe_intermediate_size": ("ffn_hidden", 512), "num_experts": ("ffn_experts", 256),
            "num_experts_per_tok": ("ffn_top_k", 8), "shared_expert_intermediate_size": ("ffn_shared_hidden", 512),
            "router_aux_loss_coef": ("lb_coef", 0.001)}
TRUNK_DEFAULTS = {"vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 40, "num_attention_heads": 16,
                  "num_key_value_heads": 2}


def qwen3_5_moe_problems(cfg: ModelConfig) -> Problems:
    """What of `cfg` Qwen3.5-MoE's block cannot express (the trunk is checked by writing it as Qwen3.5)."""
    if not cfg.ffn_experts:
        return [("FFN experts", "a dense FFN")]
    checks = [
        (cfg.attn_experts == 0, "dense attention", f"{cfg.attn_experts} attention experts"),
        (cfg.linear_experts == 0, "one Gated DeltaNet per linear layer", f"{cfg.linear_experts} DeltaNet experts"),
        (cfg.gate_norm == "topk_softmax" or cfg.ffn_top_k == cfg.ffn_experts,
         "top-k gates renormalized to sum to 1 (rebuild the mixture with --gate-norm topk_softmax)",
         f"gate_norm {cfg.gate_norm} with top-{cfg.ffn_top_k} of {cfg.ffn_experts} experts"),
        (cfg.ffn_router_kind == "linear", "linear routers", f"router {cfg.ffn_router_kind}"),
    ]
    return [(needs, has) for ok, needs, has in checks if not ok]


class Qwen35MoeConfigMap:
    """config.json <-> ModelConfig for Qwen3.5-MoE (the interface of config_map.ConfigSpec, plus `check`)."""

    model_type = MODEL_TYPE

    def check(self, cfg: ModelConfig, recipe: str | None = None) -> None:
        raise_problems(qwen3_5_moe_problems(cfg), "qwen3_5_moe export", recipe)
        try:
            QWEN3_5_TEXT.write(self._trunk(cfg), MODEL_TYPE)
        except CapabilityError as e:
            raise CapabilityError(f"{e} (the trunk of Qwen3.5-MoE is Qwen3.5's)") from None

    @staticmethod
    def _trunk(cfg: ModelConfig) -> ModelConfig:
        return cfg.replace(ffn_experts=0, ffn_top_k=1, ffn_shared_hidden=0, gate_norm="softmax", router="linear",
                           attn_router=None)

    def write(self, cfg: ModelConfig, model_type: str | None = None) -> dict[str, Any]:
        self.check(cfg)
        body = QWEN3_5_TEXT.write(self._trunk(cfg), MODEL_TYPE)
        del body["intermediate_size"]  # Qwen3.5-MoE has no dense MLP
        body.update((key, getattr(cfg, ours)) for key, (ours, _) in MOE_KEYS.items())
        body["shared_expert_intermediate_size"] = cfg.ffn_shared_hidden or 1  # zeros when it has none
        return {**body, "output_router_logits": False}

    def read(self, hf: Mapping[str, Any], name: str = "") -> tuple[ModelConfig, list[str]]:
        trunk_hf = {**TRUNK_DEFAULTS, **hf, "intermediate_size": hf.get("moe_intermediate_size", 512)}
        trunk, notes = QWEN3_5_TEXT.read(trunk_hf, name)
        moe = {ours: hf.get(key, default) for key, (ours, default) in MOE_KEYS.items()}
        fields = {**trunk.to_dict(), **moe, "gate_norm": "topk_softmax", "z_coef": 0.0, "name": name}
        return model_config(fields, {ours: key for key, (ours, _) in MOE_KEYS.items()}), notes


QWEN3_5_MOE = Qwen35MoeConfigMap()
