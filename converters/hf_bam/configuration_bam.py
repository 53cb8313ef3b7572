"""Hugging Face config for bam-surgery mixtures: every field of bam-surgery's ModelConfig, same names.

Remote code: this file is copied into every exported directory and loaded with
`AutoConfig.from_pretrained(dir, trust_remote_code=True)`. It imports only transformers, schema_bam.py (the
fields, their defaults, the supported values and the transformers range, as plain data) and config_rules.py
(the properties derived from the fields: runtime/config_rules.py, which bam-surgery's ModelConfig inherits too).

Sizes: V vocab_size, D d_model, L n_layers, H n_heads, G n_kv_heads, Dh head_dim, F ffn_hidden (per-branch
width: SwiGLU's gate and up are each [F, D]), E experts. A dense model has ffn_experts == attn_experts == 0.
"""
from __future__ import annotations

import warnings

import transformers
from transformers import PretrainedConfig

from .config_rules import ConfigRules  # the derived properties, ModelConfig's own (runtime/config_rules.py)
from .schema_bam import (FIELDS, MODEL_TYPE, SUPPORTED, TRANSFORMERS_BELOW, TRANSFORMERS_RANGE,  # noqa: F401
                         transformers_problem, version_tuple)

# The range this code is written for (schema_bam.py): refuse an older transformers in one line at load time,
# rather than fail later somewhere inside it; warn once past the range's top (not tested there).
_PROBLEM = transformers_problem(transformers.__version__)
if _PROBLEM is not None:
    raise ImportError(_PROBLEM)
if version_tuple(transformers.__version__) >= version_tuple(TRANSFORMERS_BELOW):
    warnings.warn(f"this model's remote code is tested with transformers {TRANSFORMERS_RANGE}; installed: "
                  f"{transformers.__version__}", stacklevel=2)


class BamConfig(ConfigRules, PretrainedConfig):
    """Every field of schema_bam.FIELDS as an attribute (keyword arguments, defaults from that table), plus
    use_cache; anything else goes to PretrainedConfig."""

    model_type = MODEL_TYPE
    keys_to_ignore_at_inference = ["past_key_values", "cache"]
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

    def __init__(self, use_cache: bool = True, **kwargs):
        for name, default in FIELDS.items():
            setattr(self, name, kwargs.pop(name, default))
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.head_dim is None:
            self.head_dim = self.d_model // self.n_heads
        self.use_cache = use_cache
        for fld, allowed in SUPPORTED.items():
            if getattr(self, fld) not in allowed:
                raise ValueError(f"BamConfig.{fld}={getattr(self, fld)!r} is not supported by this modeling code "
                                 f"(supported: {', '.join(map(str, allowed))})")
        # Passed up (not set here) because older transformers versions set it in their own __init__;
        # attribute_map routes it to tie_embeddings.
        super().__init__(tie_word_embeddings=self.tie_embeddings, **kwargs)
