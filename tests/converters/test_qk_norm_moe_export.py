"""Qwen3-MoE and FlexOlmo exports (`--format qwen3_moe`, `--format flex_olmo`) and scaled RoPE in every native mixture
format, from random canonical mixtures (every tensor random, so a dropped norm, bias or RoPE scaling shows): logits
against transformers' own class in both gate normalizations, with and without attention biases, tied embeddings and
scaled RoPE; the round trip back to canonical is exact. (Merges of HF specialists: test_native_moe_families.py.)
Runs in the compatibility stage too, at both ends of the transformers range."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import load_hf_native, max_diff, random_state, tiny_config, tokens_for
from bam_surgery.converters import open_checkpoint
from bam_surgery.converters.base import ExportOptions
from bam_surgery.converters.export import exporter
from bam_surgery.runtime import load_model, save_checkpoint

transformers = pytest.importorskip("transformers")

TOL = 1e-4
CLASSES = {"qwen3_moe": "Qwen3MoeForCausalLM", "flex_olmo": "FlexOlmoForCausalLM", "mixtral": "MixtralForCausalLM",
           "qwen2_moe": "Qwen2MoeForCausalLM"}
TRUNK = {"qwen3_moe": dict(qk_norm="head", head_dim=16), "flex_olmo": dict(qk_norm="full", norm_position="post"), "mixtral": {},
         "qwen2_moe": dict(ffn_shared_hidden=40)}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}


def random_mixture(tmp_path, fmt, **overrides):
    cfg = tiny_config(**{"n_kv_heads": 2, "norm_eps": 1e-6, "rope_theta": 5000.0, "max_positions": 64,
                         "ffn_experts": 3, "ffn_top_k": 2, "gate_norm": "topk_softmax", **TRUNK[fmt], **overrides})
    return cfg, save_checkpoint(random_state(cfg, seed=11), cfg, tmp_path / "mix.safetensors")


@pytest.mark.parametrize("fmt, overrides", [
    ("qwen3_moe", {}), ("qwen3_moe", {"gate_norm": "softmax"}), ("qwen3_moe", {"qkv_bias": True, "o_bias": True}),
    ("qwen3_moe", {"tie_embeddings": True, "scaled_rope": YARN}),
    ("flex_olmo", {}), ("flex_olmo", {"gate_norm": "softmax", "qkv_bias": True, "o_bias": True}),
    ("flex_olmo", {"scaled_rope": LLAMA3}),
    ("mixtral", {"scaled_rope": LLAMA3}), ("qwen2_moe", {"scaled_rope": YARN}),
])
def test_logits_equal_transformers_and_round_trip(tmp_path, fmt, overrides):
    cfg, path = random_mixture(tmp_path, fmt, **overrides)
    with open_checkpoint(path) as reader:
        exporter(fmt).write(reader, tmp_path / "hf", ExportOptions(generation={"eos_token_id": 0}))
    body = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert body["model_type"] == fmt and body["architectures"] == [CLASSES[fmt]]
    hf = load_hf_native(CLASSES[fmt], tmp_path / "hf")
    ours = load_model(path).eval()
    x = tokens_for(cfg, length=24)  # past original_max_position_embeddings
    with torch.no_grad():
        assert max_diff(ours(x).logits, hf(x).logits) <= TOL
    with open_checkpoint(tmp_path / "hf") as back:
        # qwen2_moe always writes q/k/v biases (zeros for a model without); the rest comes back as it was
        assert back.config == cfg.replace(z_coef=0.0, name=back.config.name, qkv_bias=cfg.qkv_bias or fmt == "qwen2_moe")
        with open_checkpoint(path) as source:
            for name in source.names():
                assert torch.equal(back.get(name), source.get(name)), name


def test_scaled_rope_is_not_plain_rope(tmp_path):
    """Control: the same weights with plain RoPE give other logits, so the checks above see a dropped scaling."""
    cfg, path = random_mixture(tmp_path, "qwen3_moe", scaled_rope=YARN)
    scaled, x = load_model(path).eval(), tokens_for(cfg, length=24)
    plain = type(scaled)(cfg.replace(scaled_rope=None)).eval()
    plain.load_state_dict(scaled.state_dict())
    with torch.no_grad():
        assert max_diff(plain(x).logits, scaled(x).logits) > 1e-2
