"""Hugging Face config for bam-surgery mixtures: every field of bam-surgery's ModelConfig, same names.

Remote code: this file is copied into every exported directory and loaded with
`AutoConfig.from_pretrained(dir, trust_remote_code=True)`. It imports only transformers.

Sizes: V vocab_size, D d_model, L n_layers, H n_heads, G n_kv_heads, Dh head_dim, F ffn_hidden (per-branch
width: SwiGLU's gate and up are each [F, D]), E experts. A dense model has ffn_experts == attn_experts == 0.
"""
from __future__ import annotations

from transformers import PretrainedConfig

# What modeling_bam.py implements, per config field. The exporter refuses configs outside this table
# (converters/hf_bam/export.py:check_hf_bam), and so does this config when a config.json is edited by hand.
SUPPORTED = {
    "activation": ("swiglu", "gelu", "gelu_tanh", "relu", "silu"),
    "norm": ("layernorm", "rmsnorm"),
    "position": ("rope", "learned", "none"),
    "block": ("sequential", "parallel", "parallel_two_norms"),
    "gate_norm": ("softmax", "topk_softmax"),
    "kv_mode": ("expert", "shared"),
    "router": ("linear", "mlp", "attention", "expert_embedding", "key_store"),
    "attn_router": (None, "linear", "mlp", "attention", "expert_embedding"),
}


class BamConfig(PretrainedConfig):
    model_type = "bam_mixture"
    keys_to_ignore_at_inference = ["past_key_values"]
    # Standard names used by transformers utilities, read through to ours. num_key_value_heads is left
    # out on purpose: an expert-KV block caches E * G heads, not G (see modeling_bam.py, "KV cache").
    attribute_map = {
        "hidden_size": "d_model",
        "num_hidden_layers": "n_layers",
        "num_attention_heads": "n_heads",
        "intermediate_size": "ffn_hidden",
        "max_position_embeddings": "max_positions",
        "tie_word_embeddings": "tie_embeddings",
    }

    def __init__(
        self,
        # ---- dense architecture (defaults: bam-surgery's "tiny" preset; an export always sets all) ----
        vocab_size: int = 256,
        d_model: int = 64,
        n_layers: int = 2,
        n_heads: int = 4,
        ffn_hidden: int = 128,
        n_kv_heads: int | None = None,
        head_dim: int | None = None,
        activation: str = "swiglu",
        norm: str = "rmsnorm",
        norm_bias: bool = False,
        norm_eps: float = 1e-5,
        qkv_bias: bool = False,
        o_bias: bool = False,
        ffn_bias: bool = False,
        lm_head_bias: bool = False,
        position: str = "rope",
        rope_theta: float = 10000.0,
        rotary_fraction: float = 1.0,
        rope_interleaved: bool = False,
        max_positions: int = 2048,
        block: str = "sequential",
        tie_embeddings: bool = False,
        logit_scale: float = 1.0,
        final_norm: bool = True,
        # ---- mixture ----
        ffn_experts: int = 0,
        ffn_top_k: int = 1,
        gate_norm: str = "softmax",
        attn_experts: int = 0,
        attn_top_k: int | None = None,
        kv_mode: str = "expert",
        router: str = "linear",
        attn_router: str | None = None,
        router_hidden: int | None = None,
        router_temperature: float = 0.1,
        key_store_alpha: float = 0.01,
        key_store_beta: float = 0.005,
        key_store_delta: float = 0.001,
        key_store_theta_percentile: float = 0.05,
        key_store_ema_decay: float = 0.99,
        lb_coef: float = 0.01,
        z_coef: float = 0.001,
        name: str = "",
        # ---- inference ----
        use_cache: bool = True,
        **kwargs,
    ):
        self.vocab_size, self.d_model, self.n_layers = vocab_size, d_model, n_layers
        self.n_heads, self.ffn_hidden = n_heads, ffn_hidden
        self.n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        self.head_dim = d_model // n_heads if head_dim is None else head_dim
        self.activation, self.norm, self.norm_bias, self.norm_eps = activation, norm, norm_bias, norm_eps
        self.qkv_bias, self.o_bias, self.ffn_bias, self.lm_head_bias = qkv_bias, o_bias, ffn_bias, lm_head_bias
        self.position, self.rope_theta, self.rotary_fraction = position, rope_theta, rotary_fraction
        self.rope_interleaved, self.max_positions, self.block = rope_interleaved, max_positions, block
        self.logit_scale, self.final_norm = logit_scale, final_norm
        self.ffn_experts, self.ffn_top_k, self.gate_norm = ffn_experts, ffn_top_k, gate_norm
        self.attn_experts, self.attn_top_k, self.kv_mode = attn_experts, attn_top_k, kv_mode
        self.router, self.lb_coef, self.z_coef, self.name = router, lb_coef, z_coef, name
        self.attn_router, self.router_hidden, self.router_temperature = attn_router, router_hidden, router_temperature
        # key_store: the update rules' knobs only matter to training; kept so that a config.json read back gives
        # the same model config
        self.key_store_alpha, self.key_store_beta, self.key_store_delta = key_store_alpha, key_store_beta, key_store_delta
        self.key_store_theta_percentile, self.key_store_ema_decay = key_store_theta_percentile, key_store_ema_decay
        self.use_cache = use_cache
        for fld, allowed in SUPPORTED.items():
            if getattr(self, fld) not in allowed:
                raise ValueError(f"BamConfig.{fld}={getattr(self, fld)!r} is not supported by this modeling code "
                                 f"(supported: {', '.join(allowed)})")
        # Passed up (not set here) because older transformers versions set it in their own __init__;
        # attribute_map routes it to tie_embeddings.
        super().__init__(tie_word_embeddings=tie_embeddings, **kwargs)

    @property
    def ffn_router_kind(self) -> str:
        return self.router

    @property
    def attn_router_kind(self) -> str:
        """Same rule as bam-surgery's ModelConfig: attn_router, or router when it is None."""
        return self.attn_router or self.router

    @property
    def rotary_dim(self) -> int:
        """RoPE rotates the first rotary_dim dims of each head (same rounding as bam-surgery's runtime)."""
        return int(round(self.head_dim * self.rotary_fraction))
