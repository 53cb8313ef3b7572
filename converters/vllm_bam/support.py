"""What the vLLM model (model.py) implements of an HF BAM export's config, in plain Python (no vLLM, no
transformers): vLLM's column of the table of what runs where (converters/carry.py, converters/targets.py), and the
one-line refusal at load time of any value outside it.

A field maps to the values the vLLM model runs (a tuple), or to ANY: every value is served as the runtime
computes it, or the field matters only to training (losses, the key store's update rules) or to labels. A field of
the export (converters/hf_bam/schema_bam.py FIELDS) not listed here is served at its default only: a field added to
the export is refused by vLLM until it is decided here.
"""
from __future__ import annotations

from ..base import CapabilityError
from ..carry import Column, anything, rule, values
from ..hf_bam import schema_bam

ANY = None
# CPU attention head sizes of vLLM 0.32's CPU backend (CPUAttentionBackend.get_supported_head_sizes); other
# backends have their own lists and vLLM refuses a size it does not run when the engine starts
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)

SUPPORTED: dict[str, tuple | None] = {
    # ---- dense architecture ----
    "vocab_size": ANY, "d_model": ANY, "n_layers": ANY, "n_heads": ANY, "ffn_hidden": ANY,
    "n_kv_heads": ANY, "head_dim": ANY,
    "activation": ("swiglu", "gelu", "gelu_tanh", "relu", "silu"),
    "norm": ("layernorm", "rmsnorm"), "norm_bias": ANY, "norm_eps": ANY,
    "qkv_bias": ANY, "o_bias": ANY, "ffn_bias": ANY, "lm_head_bias": ANY,
    "position": ("rope", "learned", "none"), "rope_theta": ANY, "rotary_fraction": ANY, "rope_interleaved": ANY,
    "max_positions": ANY, "block": ("sequential", "parallel", "parallel_two_norms"), "tie_embeddings": ANY,
    "logit_scale": ANY, "final_norm": ANY,
    # the newer families' trunk features (scaled RoPE, QK-norm, post and sandwich norms, layers without RoPE, Gemma's
    # norms, embeddings, attention scale and soft-caps, sliding windows): not in the vLLM model yet, refused at load
    "scaled_rope": (None,), "nope_layers": (None,), "qk_norm": ("none",), "norm_position": ("pre",),
    "norm_unit_offset": (False,), "scale_embeddings": (False,), "attn_window": (None,), "attn_window_layers": (None,),
    "window_rope_theta": (None,), "attn_scale_dim": (None,), "attn_softcap": (None,), "final_softcap": (None,),
    # Qwen3.5's Gated DeltaNet layers and gated attention, Gemma 4's per-layer geometry, shared K/V layers and
    # per-layer inputs: not in the vLLM model, refused at load (its native qwen3_5 / gemma4 models serve the
    # native exports)
    "linear_layers": (None,), "linear_key_heads": ANY, "linear_value_heads": ANY, "linear_key_dim": ANY,
    "linear_value_dim": ANY, "linear_conv": ANY, "attn_output_gate": (False,), "global_head_dim": (None,),
    "global_kv_heads": (None,), "global_k_eq_v": (False,), "v_norm": (False,), "kv_shared_layers": (0,),
    "kv_shared_ffn_hidden": ANY, "per_layer_dim": (0,), "per_layer_vocab": ANY, "layer_scale": (False,),
    # ---- mixture ----
    "ffn_experts": ANY, "ffn_top_k": ANY, "gate_norm": ("softmax", "topk_softmax"), "ffn_shared_hidden": ANY,
    "attn_experts": ANY, "attn_top_k": ANY, "kv_mode": ("expert", "shared"), "linear_experts": (0,),
    "router": ("linear", "mlp", "attention", "expert_embedding", "key_store"),
    "attn_router": (None, "linear", "mlp", "attention", "expert_embedding"),
    "router_hidden": ANY, "router_temperature": ANY,
    # training only: the key store's update rules and the router losses; a label
    "key_store_alpha": ANY, "key_store_beta": ANY, "key_store_delta": ANY, "key_store_theta_percentile": ANY,
    "key_store_ema_decay": ANY, "lb_coef": ANY, "z_coef": ANY, "name": ANY,
}


# vLLM's fused-MoE layer computes act(gate x) * (up x) for SiLU and GELU (model.py runs ungated experts through it
# with a constant gate), and has no gated ReLU
_RELU_EXPERTS = rule(("ffn_experts", "activation"), lambda cfg: not (cfg.ffn_experts and cfg.activation == "relu"),
                     "FFN experts with activation relu (its fused-MoE layer has no ReLU experts)", "",
                     "no ReLU experts")
COLUMN = Column("vllm", (*[anything(f)[0] if allowed is ANY else values(f, allowed)
                           for f, allowed in SUPPORTED.items()], _RELU_EXPERTS))


def vllm_problems(cfg) -> list[str]:
    """What of `cfg` (anything with the export's config fields: BamConfig, ModelConfig) the vLLM model does not
    implement, one phrase each; empty when it serves the model as the runtime computes it."""
    problems = []
    for row in COLUMN.failures(cfg, schema_bam.FIELDS):
        if row.allowed is None:
            problems.append(row.needs_text(cfg))
        else:
            name = row.fields[0]
            problems.append(f"{name}={getattr(cfg, name)!r} (it runs {', '.join(map(str, row.allowed))})")
    return problems


def check_vllm(cfg) -> None:
    """CapabilityError (one line) naming everything of `cfg` the vLLM model does not implement."""
    problems = vllm_problems(cfg)
    if problems:
        raise CapabilityError(f"bam-surgery's vLLM model does not implement {'; '.join(problems)}")
