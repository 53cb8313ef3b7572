"""Qwen2-MoE export (`--format qwen2_moe`): logits against transformers' Qwen2MoeForCausalLM, with and without q/k/v
biases, with a shared expert (recipe btx-shared-expert) and without (BTX: an all-zero shared expert, whose
contribution is exactly 0), in both gate normalizations; the round trip back to canonical; one-line refusals of what
Qwen2-MoE cannot express, each naming the formats that do carry the model."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import (cli_error_line, dense_family, load_hf_native, max_diff, merge_family, random_state,
                      seed_and_experts, tiny_config, tokens_for)
from bam_surgery.converters import open_checkpoint
from bam_surgery.converters.export import exporter
from bam_surgery.converters.hf.architectures import ARCHITECTURES
from bam_surgery.converters.base import CapabilityError
from bam_surgery.converters.native_moe import ZERO_SHARED_HIDDEN
from bam_surgery.runtime import load_model, save_checkpoint
from bam_surgery.runtime.model import Model

transformers = pytest.importorskip("transformers")

LLAMA = dict(block="sequential", norm="rmsnorm", activation="swiglu", n_kv_heads=2, norm_eps=1e-6,
             rope_theta=5000.0)


def hf_qwen2_moe(path):
    return load_hf_native("Qwen2MoeForCausalLM", path)


def random_shared_mixture(tmp_path, **overrides):
    """A random canonical btx-shared-expert-shaped mixture (every tensor random, the shared gate too)."""
    cfg = tiny_config(**{**LLAMA, "ffn_experts": 3, "ffn_top_k": 2, "ffn_shared_hidden": 40,
                         "gate_norm": "topk_softmax", **overrides})
    state = random_state(cfg, seed=11)
    return cfg, save_checkpoint(state, cfg, tmp_path / "mix.safetensors")


BTX = {"ffn_shared_hidden": 0}  # a mixture without a shared expert: written with an all-zero one


@pytest.mark.parametrize("overrides", [{}, {"gate_norm": "softmax", "ffn_top_k": 1}, {"qkv_bias": True},
                                       {"tie_embeddings": True}, {**BTX, "qkv_bias": True},
                                       {**BTX, "qkv_bias": True, "gate_norm": "softmax", "ffn_top_k": 1}])
def test_logits_equal_transformers_qwen2_moe(tmp_path, overrides):
    cfg, path = random_shared_mixture(tmp_path, **overrides)
    out = tmp_path / "hf"
    with open_checkpoint(path) as reader:
        exporter("qwen2_moe").write(reader, out, exporter_options())
    body = json.loads((out / "config.json").read_text())
    assert body["model_type"] == "qwen2_moe" and body["architectures"] == ["Qwen2MoeForCausalLM"]
    assert body["norm_topk_prob"] == (cfg.gate_norm == "topk_softmax")
    hf = hf_qwen2_moe(out)
    ours = load_model(path).eval()
    x = tokens_for(cfg, length=12)
    with torch.no_grad():
        assert max_diff(ours(x).logits, hf(x).logits) <= 1e-5
    # back to canonical: the same model (biases, and a BTX's shared expert: the zeros the export wrote)
    with open_checkpoint(out) as back:
        assert back.config.qkv_bias and back.config.ffn_shared_hidden == (cfg.ffn_shared_hidden or ZERO_SHARED_HIDDEN)
        state = {n: back.get(n) for n in back.names()}
        again = Model(back.config)
        again.load_state_dict(state)
    with torch.no_grad():
        assert max_diff(again.eval()(x).logits, ours(x).logits) <= 1e-6


def test_a_zero_shared_expert_adds_exactly_nothing_in_transformers(tmp_path):
    """A BTX mixture's all-zero shared expert: transformers' Qwen2MoeSparseMoeBlock computes it and its gate on every
    token, and the logits are the same bits whatever that gate is (its output is exactly 0)."""
    cfg, path = random_shared_mixture(tmp_path, **BTX, qkv_bias=True)
    with open_checkpoint(path) as reader:
        exporter("qwen2_moe").write(reader, tmp_path / "hf", exporter_options())
    hf = hf_qwen2_moe(tmp_path / "hf")
    assert hf.config.shared_expert_intermediate_size == ZERO_SHARED_HIDDEN
    x = tokens_for(cfg, length=12)
    with torch.no_grad():
        before = hf(x).logits
        for layer in hf.model.layers:
            assert not any(p.any() for p in layer.mlp.shared_expert.parameters())
            layer.mlp.shared_expert_gate.weight.normal_(0, 3.0)
        assert torch.equal(hf(x).logits, before)


def exporter_options():
    from bam_surgery.converters.base import ExportOptions
    return ExportOptions(generation={"eos_token_id": 0})


def test_merge_format_qwen2_moe_from_the_command_line(tmp_path):
    cfg = tiny_config(**LLAMA)
    paths = seed_and_experts(tmp_path, cfg, names=("seed", "code", "law", "math"))
    merge_family(paths, tmp_path / "q", "--recipe", "btx-shared-expert", "--format", "qwen2_moe",
                 "--gate-norm", "topk_softmax")
    merge_family(paths, tmp_path / "mix.safetensors", "--recipe", "btx-shared-expert", "--gate-norm", "topk_softmax")
    hf = hf_qwen2_moe(tmp_path / "q")
    ours = load_model(tmp_path / "mix.safetensors").eval()
    x = tokens_for(cfg)
    with torch.no_grad():
        assert max_diff(ours(x).logits, hf(x).logits) <= 1e-5
    assert hf.config.num_experts == 3 and hf.config.shared_expert_intermediate_size == cfg.ffn_hidden


def test_refusals_are_one_line(tmp_path):
    cfg = tiny_config(**LLAMA)
    paths = seed_and_experts(tmp_path, cfg)
    line = cli_error_line("merge", "--seed", paths[0], "--experts", f"{paths[1]},{paths[2]}", "--recipe", "bam",
                          "--format", "qwen2_moe", "--out", tmp_path / "o")
    assert "dense attention" in line and "attention experts" in line and line.endswith(
        "; the hf or onnx formats carry it")
    line = cli_error_line("merge", "--seed", paths[0], "--experts", f"{paths[1]},{paths[2]}", "--recipe",
                          "btx-shared-expert", "--format", "mixtral", "--gate-norm", "topk_softmax", "--out",
                          tmp_path / "o")
    assert line.endswith("mixtral export needs no shared expert; recipe btx-shared-expert has a shared FFN expert; the "
                         "qwen2_moe, hf or onnx formats carry it"), line
    assert not (tmp_path / "o").exists()
    with pytest.raises(CapabilityError, match="interleaved RoPE"):
        ARCHITECTURES["qwen2_moe"].config.check(tiny_config(**LLAMA, ffn_experts=2, ffn_shared_hidden=8,
                                                            rope_interleaved=True))


def test_btx_of_qwen2_models_goes_to_qwen2_moe_and_mixtral_says_so(tmp_path):
    """Every Qwen2 model has q/k/v biases, which Mixtral cannot carry: a BTX of them is refused by --format mixtral in
    one line naming qwen2_moe, and --format qwen2_moe writes it (a zero shared expert), with the merge's logits."""
    cfg = tiny_config(**LLAMA, qkv_bias=True)
    paths = seed_and_experts(tmp_path, cfg)
    line = cli_error_line("merge", "--seed", paths[0], "--experts", f"{paths[1]},{paths[2]}", "--recipe", "btx",
                          "--format", "mixtral", "--out", tmp_path / "o")
    assert line.startswith("bam-surgery: error: mixtral export needs bias-free projections; recipe btx has q/k/v "
                           "biases; the qwen2_moe, hf, onnx or gguf formats carry it"), line
    assert not (tmp_path / "o").exists()
    merge_family(paths, tmp_path / "q", "--recipe", "btx", "--format", "qwen2_moe")
    merge_family(paths, tmp_path / "mix.safetensors", "--recipe", "btx")
    hf = hf_qwen2_moe(tmp_path / "q")
    ours = load_model(tmp_path / "mix.safetensors").eval()
    x = tokens_for(cfg)
    with torch.no_grad():
        assert max_diff(ours(x).logits, hf(x).logits) <= 1e-5
    assert hf.config.norm_topk_prob and hf.config.num_experts == 3


def test_specialists_differing_in_attention_are_averaged_like_btx(tmp_path):
    """The recipe averages attention over the specialists (the seed is the shared expert, not a member)."""
    cfg = tiny_config(**LLAMA)
    family = dense_family(cfg, 3, seed=9)
    paths = [save_checkpoint(s, cfg, tmp_path / f"m{i}.safetensors") for i, s in enumerate(family)]
    merge_family(paths, tmp_path / "mix.safetensors", "--recipe", "btx-shared-expert")
    state = load_model(tmp_path / "mix.safetensors").state_dict()
    q = "layers.0.attn.q.weight"
    assert max_diff(state[q], (family[1][q] + family[2][q]) / 2) <= 1e-6
    assert max_diff(state["layers.0.ffn_shared.up.weight"], family[0]["layers.0.ffn.up.weight"]) == 0
