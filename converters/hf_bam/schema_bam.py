"""What the HF BAM remote code accepts, in plain Python: the config fields with their defaults, the values
modeling_bam.py implements, the model type, and the transformers versions it runs under.

Remote code: shipped into every export next to configuration_bam.py (which builds BamConfig from this table)
and modeling_bam.py. It imports nothing, so the exporter reads it without transformers installed: writing an
export never needs transformers, only loading one does.
"""

MODEL_TYPE = "bam_mixture"

# transformers versions the remote code is written for and tested with (make test-compat runs the export checks
# at both ends and at the version the main test environment pins). Below MIN, configuration_bam.py refuses to
# load in one line; from BELOW on, it warns once: not tested there.
TRANSFORMERS_MIN = "4.57.6"
TRANSFORMERS_BELOW = "6"
TRANSFORMERS_TESTED = ("4.57.6", "5.23.0", "5.24.0")
TRANSFORMERS_RANGE = f">={TRANSFORMERS_MIN},<{TRANSFORMERS_BELOW}"

# ---- generated from runtime/config.py ModelConfig (converters/hf_bam/export.py:schema_text; a test holds it equal)
# Every field of bam-surgery's ModelConfig, same names, order and defaults; None for n_kv_heads / head_dim
# means n_heads / d_model // n_heads. The sizes ModelConfig requires get placeholders: an export always sets
# every field.
FIELDS = {
    # ---- dense architecture ----
    "vocab_size": 256,
    "d_model": 64,
    "n_layers": 2,
    "n_heads": 4,
    "ffn_hidden": 128,
    "n_kv_heads": None,
    "head_dim": None,
    "activation": "swiglu",
    "norm": "rmsnorm",
    "norm_bias": False,
    "norm_eps": 1e-05,
    "qkv_bias": False,
    "o_bias": False,
    "ffn_bias": False,
    "lm_head_bias": False,
    "position": "rope",
    "rope_theta": 10000.0,
    "rotary_fraction": 1.0,
    "rope_interleaved": False,
    "max_positions": 2048,
    "block": "sequential",
    "tie_embeddings": False,
    "logit_scale": 1.0,
    "final_norm": True,
    "scaled_rope": None,
    "nope_layers": None,
    "qk_norm": "none",
    "norm_position": "pre",
    "norm_unit_offset": False,
    "scale_embeddings": False,
    "attn_window": None,
    "attn_window_layers": None,
    "window_rope_theta": None,
    "attn_scale_dim": None,
    "attn_softcap": None,
    "final_softcap": None,
    "embedding_multiplier": 1.0,
    "residual_multiplier": 1.0,
    "attn_scale": None,
    "attn_temperature": None,
    "attn_temperature_length": None,
    "linear_layers": None,
    "linear_key_heads": 0,
    "linear_value_heads": 0,
    "linear_key_dim": 0,
    "linear_value_dim": 0,
    "linear_conv": 0,
    "attn_output_gate": False,
    "global_head_dim": None,
    "global_kv_heads": None,
    "global_k_eq_v": False,
    "v_norm": False,
    "kv_shared_layers": 0,
    "kv_shared_ffn_hidden": None,
    "per_layer_dim": 0,
    "per_layer_vocab": None,
    "layer_scale": False,
    # ---- mixture ----
    "ffn_experts": 0,
    "ffn_top_k": 1,
    "gate_norm": "softmax",
    "ffn_shared_hidden": 0,
    "attn_experts": 0,
    "attn_top_k": None,
    "kv_mode": "expert",
    "linear_experts": 0,
    "router": "linear",
    "attn_router": None,
    "router_hidden": None,
    "router_temperature": 0.1,
    "key_store_alpha": 0.01,
    "key_store_beta": 0.005,
    "key_store_delta": 0.001,
    "key_store_theta_percentile": 0.05,
    "key_store_ema_decay": 0.99,
    "lb_coef": 0.01,
    "z_coef": 0.001,
    "name": "",
}

# What modeling_bam.py implements, per config field of a fixed set of values. The exporter refuses configs
# outside it (export.py:check_hf_bam), and so does BamConfig when a config.json is edited by hand.
SUPPORTED = {
    "activation": ("swiglu", "gelu", "gelu_tanh", "relu", "silu", "geglu_tanh"),
    "norm": ("layernorm", "rmsnorm"),
    "position": ("rope", "learned", "none"),
    "block": ("sequential", "parallel", "parallel_two_norms"),
    "qk_norm": ("none", "head", "full"),
    "norm_position": ("pre", "post", "sandwich"),
    "gate_norm": ("softmax", "topk_softmax"),
    "kv_mode": ("expert", "shared"),
    "router": ("linear", "mlp", "attention", "expert_embedding", "key_store"),
    "attn_router": (None, "linear", "mlp", "attention", "expert_embedding"),
}
# ---- end of the generated part


def version_tuple(version: str) -> tuple[int, ...]:
    """'5.24.0' -> (5, 24, 0); '4.57.0.dev0' or '5.0.0rc1' -> their numeric release part (4, 57, 0), (5, 0, 0)."""
    out = []
    for part in version.split("+")[0].split("."):
        digits = ""
        for ch in part:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        out.append(int(digits))
        if len(digits) != len(part):
            break
    return tuple(out)


def transformers_problem(installed: str) -> str | None:
    """One line when the installed transformers is older than the remote code needs, else None."""
    if version_tuple(installed) < version_tuple(TRANSFORMERS_MIN):
        return (f"this model's remote code needs transformers {TRANSFORMERS_RANGE} (tested: "
                f"{', '.join(TRANSFORMERS_TESTED)}); installed: {installed}. pip install -U 'transformers{TRANSFORMERS_RANGE}'")
    return None
