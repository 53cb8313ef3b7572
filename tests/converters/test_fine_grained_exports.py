"""Fine-grained mixtures (merge --ffn-granularity G) in the native formats that carry an expert width of their own:
Mixtral (its intermediate_size), Qwen3-MoE and Qwen2-MoE (moe_intermediate_size). A fresh fine-grained upcycle of a
dense seed, written by `merge --format`, computes the dense seed in transformers' own class (the step-0 identity in
the client) and the runtime's logits; a fine-grained BTX with the seed as a shared expert (Qwen2-MoE) computes its
coarse BTX; the round trip back to canonical is exact. Runs in the compatibility stage at both ends of the
transformers range and in vLLM's venv."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import branched_family, load_hf_native, max_diff, merge, save_family, tiny_config, tokens_for
from bam_surgery.converters import open_checkpoint
from bam_surgery.runtime import load_model

transformers = pytest.importorskip("transformers")

TOL = 1e-4
LLAMA = dict(block="sequential", norm="rmsnorm", activation="swiglu", n_kv_heads=2, norm_eps=1e-6,
             rope_theta=5000.0, max_positions=64)
CLASSES = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}
WIDTH_KEY = {"mixtral": "intermediate_size", "qwen3_moe": "moe_intermediate_size", "qwen2_moe": "moe_intermediate_size"}


def _hf_logits(fmt, folder, x):
    with torch.no_grad():
        return load_hf_native(CLASSES[fmt], folder)(x).logits


@pytest.mark.parametrize("fmt, trunk, G", [("mixtral", {}, 4), ("qwen3_moe", dict(qk_norm="head", head_dim=16), 2)])
def test_fine_grained_upcycle_is_the_dense_seed_in_the_client(tmp_path, fmt, trunk, G):
    cfg = tiny_config(**LLAMA, **trunk)
    seed = save_family(tmp_path, cfg, branched_family(cfg, 1))[0]
    args = ("--recipe", "upcycle", "--seed", seed, "--ffn-granularity", G, "--router-std", "0.5")
    merge(*args, "--format", fmt, "--out", tmp_path / "hf")
    merge(*args, "--out", tmp_path / "mix.safetensors")
    body = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert body[WIDTH_KEY[fmt]] == cfg.ffn_hidden // G and body["num_experts_per_tok"] == 2 * G
    assert body.get("num_local_experts", body.get("num_experts")) == 4 * G
    x = tokens_for(cfg, length=12)
    theirs = _hf_logits(fmt, tmp_path / "hf", x)
    with torch.no_grad():
        dense, ours = load_model(seed)(x).logits, load_model(tmp_path / "mix.safetensors")(x).logits
    assert max_diff(theirs, dense) <= TOL and max_diff(theirs, ours) <= TOL
    with open_checkpoint(tmp_path / "hf") as back, open_checkpoint(tmp_path / "mix.safetensors") as source:
        assert back.config.ffn_hidden == cfg.ffn_hidden // G
        for name in source.names():
            assert torch.equal(back.get(name), source.get(name)), name


@pytest.mark.parametrize("gate_norm", ["topk_softmax", "softmax"])
def test_fine_grained_btx_with_a_shared_expert_as_qwen2_moe(tmp_path, gate_norm):
    cfg = tiny_config(**LLAMA)
    paths = save_family(tmp_path, cfg, branched_family(cfg, 4, share_attention=True))
    args = ("--recipe", "btx-shared-expert", "--seed", paths[0], "--experts", ",".join(map(str, paths[1:])),
            "--gate-norm", gate_norm, "--router-std", "0.5")
    merge(*args, "--ffn-granularity", 2, "--format", "qwen2_moe", "--out", tmp_path / "hf")
    merge(*args, "--ffn-granularity", 2, "--out", tmp_path / "fine.safetensors")
    merge(*args, "--out", tmp_path / "coarse.safetensors")
    body = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert body["moe_intermediate_size"] == cfg.ffn_hidden // 2
    assert body["shared_expert_intermediate_size"] == cfg.ffn_hidden  # the shared expert keeps its width
    x = tokens_for(cfg, length=12)
    with torch.no_grad():
        fine, coarse = (load_model(tmp_path / f"{n}.safetensors")(x).logits for n in ("fine", "coarse"))
    assert max_diff(_hf_logits("qwen2_moe", tmp_path / "hf", x), fine) <= TOL
    if gate_norm == "topk_softmax":  # renormalized gates: the fine-grained mixture is its coarse one
        assert max_diff(fine, coarse) <= TOL
