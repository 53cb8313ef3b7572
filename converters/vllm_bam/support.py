"""What the vLLM model (model.py) implements of an HF BAM export's config, declared as data in plain Python (no vLLM,
no transformers): vLLM's column of the table of what runs where (converters/carry.py, converters/targets.py), and the
one-line refusal at load time of anything outside it.

The declaration:
  SUPPORTED     per config field of the export (converters/hf_bam/schema_bam.py FIELDS): the values the vLLM model
                runs (a tuple), or ANY: every value is served as the runtime computes it, or the field matters only to
                training (losses, the key store's update rules) or to labels. A field of the export not listed here
                is served at its default only: a field added to the export is refused by vLLM until it is decided here;
  COMBINATIONS  values served alone but not together: rules of the column (converters/carry.py `rule`);
  LENGTHS       scaled RoPE types whose result vLLM matches only up to a length: rope_type -> (the config's limit as
                a function of it, the limit's name, why). The engine's max_model_len must not pass it (checked when
                vLLM builds the model, where the length is known).
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
    "activation": ("swiglu", "gelu", "gelu_tanh", "relu", "silu", "geglu_tanh"),
    "norm": ("layernorm", "rmsnorm"), "norm_bias": ANY, "norm_eps": ANY,
    "qkv_bias": ANY, "o_bias": ANY, "ffn_bias": ANY, "lm_head_bias": ANY,
    "position": ("rope", "learned", "none"), "rope_theta": ANY, "rotary_fraction": ANY, "rope_interleaved": ANY,
    "max_positions": ANY, "block": ("sequential", "parallel", "parallel_two_norms"), "tie_embeddings": ANY,
    "logit_scale": ANY, "final_norm": ANY,
    # the newer families' trunks: every scaled RoPE type (vLLM's get_rope; LENGTHS bounds three of them), layers
    # without RoPE, QK-norm per head and over the full width, post and sandwich norms, (1 + w) norms, scaled
    # embeddings, the attention scale, attention and final soft-caps, sliding windows with their own RoPE base
    "scaled_rope": ANY, "nope_layers": ANY, "qk_norm": ("none", "head", "full"),
    "norm_position": ("pre", "post", "sandwich"), "norm_unit_offset": ANY, "scale_embeddings": ANY,
    "attn_window": ANY, "attn_window_layers": ANY, "window_rope_theta": ANY, "attn_scale_dim": ANY,
    "attn_softcap": ANY, "final_softcap": ANY,
    # Granite's multipliers and attention scale of its own; queries scaled by position (Ministral 3)
    "embedding_multiplier": ANY, "residual_multiplier": ANY, "attn_scale": ANY, "attn_temperature": ANY,
    "attn_temperature_length": ANY,
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


def _rope_type(cfg) -> str | None:
    return None if cfg.scaled_rope is None or cfg.position != "rope" else cfg.scaled_rope["rope_type"]


SERVED_ROPE = ("linear", "dynamic", "yarn", "longrope", "llama3")  # model.py rope_parameters: vLLM's get_rope types

COMBINATIONS = (
    # Gemma 4's proportional RoPE is not in the plugin's get_rope dictionaries (model.py rope_parameters)
    rule("scaled_rope", lambda cfg: _rope_type(cfg) in (None, *SERVED_ROPE),
         lambda cfg: f"scaled_rope of type {_rope_type(cfg)} (it runs {', '.join(SERVED_ROPE)})", "", "no proportional"),
    # vLLM's fused-MoE layer computes act(gate x) * (up x) for SiLU and GELU (model.py runs ungated experts through it
    # with a constant gate), and has no gated ReLU
    rule(("ffn_experts", "activation"), lambda cfg: not (cfg.ffn_experts and cfg.activation == "relu"),
         "FFN experts with activation relu (its fused-MoE layer has no ReLU experts)", "", "no ReLU experts"),
    rule(("scaled_rope", "rope_interleaved"), lambda cfg: not (_rope_type(cfg) == "longrope" and cfg.rope_interleaved),
         "longrope with rope_interleaved (vLLM's longrope rotates half-split pairs only)", "",
         {"scaled_rope": "longrope not with rope_interleaved", "rope_interleaved": "true or false; not with longrope"}),
)


def _yarn_cover(cfg) -> int:
    s = cfg.scaled_rope
    original = s["original_max_position_embeddings"]
    return int(original * (s.get("factor") or cfg.max_positions / original))


LENGTHS = {
    # transformers (and the runtime) switch to the long factors once a sequence passes the original length, and keep
    # the keys cached before the switch as they were; vLLM cannot rotate one sequence two ways in its paged cache, so
    # it picks the long factors for every position whenever max_model_len passes the original length
    "longrope": (lambda cfg: cfg.scaled_rope["original_max_position_embeddings"], "original_max_position_embeddings",
                 "vLLM then rotates every position with the long factors, where transformers and the runtime use "
                 "the short ones until a sequence passes that length"),
    # transformers' dynamic NTK base grows with the longest sequence of each forward past max_positions; vLLM's table
    # is fixed when the engine starts (within max_positions both are plain RoPE)
    "dynamic": (lambda cfg: cfg.max_positions, "max_positions",
                "past it transformers' dynamic NTK base grows with each forward's longest sequence, which vLLM's "
                "fixed RoPE table cannot follow"),
    "yarn": (_yarn_cover, "original_max_position_embeddings x factor",
             "vLLM's YaRN table covers that many positions"),
}
# the table's words for scaled_rope: every type, three of them up to a length
_SCALED_ROPE = (f"{', '.join(SERVED_ROPE)} (longrope up to original_max_position_embeddings, dynamic up to "
                "max_positions, yarn up to original x factor: the engine's --max-model-len)")
COLUMN = Column("vllm", (*[(anything(f, shown=_SCALED_ROPE) if f == "scaled_rope" else anything(f))[0]
                           if allowed is ANY else values(f, allowed) for f, allowed in SUPPORTED.items()],
                         *COMBINATIONS))


def vllm_problems(cfg, max_model_len: int | None = None) -> list[str]:
    """What of `cfg` (anything with the export's config fields: BamConfig, ModelConfig) the vLLM model does not
    implement, one phrase each; empty when it serves the model as the runtime computes it. max_model_len: the
    engine's longest sequence (None: not known yet, LENGTHS unchecked)."""
    problems = []
    for row in COLUMN.failures(cfg, schema_bam.FIELDS):
        if row.allowed is None:
            problems.append(row.needs_text(cfg))
        else:
            name = row.fields[0]
            problems.append(f"{name}={getattr(cfg, name)!r} (it runs {', '.join(map(str, row.allowed))})")
    kind = _rope_type(cfg)
    if max_model_len is not None and kind in LENGTHS:
        limit, name, why = LENGTHS[kind]
        if max_model_len > limit(cfg):
            problems.append(f"scaled_rope {kind} at max_model_len {max_model_len}, past {name}={limit(cfg)} ({why}; "
                            f"serve with --max-model-len {limit(cfg)} or less)")
    return problems


def check_vllm(cfg, max_model_len: int | None = None) -> None:
    """CapabilityError (one line) naming everything of `cfg` the vLLM model does not implement."""
    problems = vllm_problems(cfg, max_model_len)
    if problems:
        raise CapabilityError(f"bam-surgery's vLLM model does not implement {'; '.join(problems)}")
