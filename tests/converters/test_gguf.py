"""GGUF export (converters/gguf_export.py, bam-surgery export-gguf, --format gguf), checked by llama.cpp itself.

Two kinds of test:
* the writer (wherever the `gguf` package is installed): metadata, tensor names and types, the Q/K permutation,
  the byte and BPE vocabularies, the card, refusals from the config alone, one-line errors, atomic writes, --force;
* llama.cpp (llama-cpp-python, installed by `make test-compat` into .venv-compat/gguf, where BAM_COMPAT_STAGE=1
  makes its absence a failure; skipped elsewhere): it loads each file, its logits for a prompt equal the runtime's
  (f32 within F32_TOL, f16 within F16_TOL; the KV cache in f32 so that only the weights' type differs), q8_0 is
  measured as a perplexity delta on held-out text (of a model fitted a little to CORPUS), its greedy tokens equal
  runtime.generate's, and its tokenizer encodes text to the runtime's ids: a dense Llama with a byte-level BPE
  tokenizer.json (built here with train/bpe.py), a dense model with the byte tokenizer, a BTX mixture merged by
  `merge --recipe btx --gate-norm topk_softmax --format gguf`, Qwen2- and bias-carrying shapes, and BPEs with
  Llama 3's and Qwen2's pre-tokenizers; a shared-expert mixture (`merge --recipe btx-shared-expert --format gguf`
  from HF Llama folders with a BPE tokenizer.json: llama.cpp's qwen2moe) with the softmax gates it computes, with
  trained shared gates and in other shapes, and the topk_softmax one it would compute as softmax (hence refused);
  the families (FAMILIES): Llama with llama3 / linear / yarn RoPE, qwen3 (also with yarn and q/k/v biases), olmo2,
  phi3 with longrope in both of llama.cpp's regimes (context within the original length: short factors; past it: long
  factors, compared on a prompt longer than the original, where the runtime takes them too), smollm3 and a qwen3moe
  mixture, at positions past the RoPE original length; gemma2 and gemma3 past their windows (GEGLU_TOL: llama.cpp's f16
  GELU table; without the FFN output within F32_TOL, prefilled and decoded from the cache).
"""
from __future__ import annotations

import json
import math
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from bam_surgery.converters.base import CapabilityError, ExportOptions
from bam_surgery.converters.gguf_export import GGUFOptions
from bam_surgery.converters.export import check_export, exporter
from bam_surgery.runtime import Model, generate, load_model, save_model
from bam_surgery.runtime.checkpoint import save_checkpoint
from bam_surgery.runtime.config import ModelConfig
from bam_surgery.runtime.reader import StateReader
from conftest import WrappedReader, cli_error_line, error_line, merge_family, random_state, run_cli, seed_and_experts

gguf = pytest.importorskip("gguf")
from bam_surgery.converters import gguf_export as ge  # noqa: E402  (needs gguf for every write)
from bam_surgery.converters import gguf_tokenizer as gt  # noqa: E402
from bam_surgery.converters.gguf_table import rope_pairs  # noqa: E402

F32_TOL = 1e-4  # max |logit difference|, f32 weights (measured 1.4e-6 to 1.9e-5)
F16_TOL = 5e-2  # f16 weights (measured 5.9e-3)
Q8_PPL_REL_TOL = 0.05  # q8_0: |perplexity delta| / perplexity on held-out text (measured +0.06%: 30.973 vs 30.954)

CORPUS = [
    "The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs on.",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "Merging dense checkpoints into a mixture of experts: the experts are branched from one seed.",
    "Numbers 1234 and 56789, prices $3.50 and 12%, dates 2024-01-31 and times 10:45.",
    "Tokenizers split text into words, then merge the most frequent pairs of symbols, again and again.",
] * 6
HELD_OUT = ("The fox and the dog merge their experts; numbers 42 and 2024 follow the seed.\n"
            "    return the most frequent pairs of symbols, again.")
TRICKY = ["Hello, world!  \n\n  trailing   ", "café naïve — 日本語 🦙🦙 x", "it's I'll we'VE 3.14159 100000",
          "\t\tdef f():\n\treturn 1\r\n", "<|endoftext|> after the end", "a\x00b"]


def llama_config(**overrides) -> ModelConfig:
    """A tiny Llama-shaped model with GQA; widths multiples of 32 so that q8_0 quantizes every matrix."""
    fields = dict(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128,
                  max_positions=128, rope_theta=10000.0, norm_eps=1e-6, name="tiny-llama")
    return ModelConfig(**{**fields, **overrides})


def shared_config(**overrides) -> ModelConfig:
    """A tiny mixture with a shared expert (btx-shared-expert's shape): 3 routed experts, top-2 of the softmax."""
    return llama_config(**{"ffn_experts": 3, "ffn_top_k": 2, "ffn_shared_hidden": 96, "gate_norm": "softmax",
                           **overrides})


LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=32)  # wavelengths of head_dim 16 fall on both sides of 32 / 4 ... 32
LONGROPE = dict(rope_type="longrope", original_max_position_embeddings=256,  # llama.cpp's context is 256 at least
                short_factor=[1.0 + 0.05 * i for i in range(8)], long_factor=[1.5 + 0.7 * i for i in range(8)])


EXAONE4 = dict(qk_norm="head", norm_position="post", head_dim=16)
GEMMA = dict(norm_position="sandwich", norm_unit_offset=True, scale_embeddings=True, activation="geglu_tanh",
             tie_embeddings=True)
# llama.cpp's CPU GeGLU reads GELU from an f16 table (ggml's GGML_GELU_FP16: the gate rounded to f16, the GELU
# rounded to f16), which the runtime (and transformers) compute in f32: Gemma's logits differ by that much (measured
# 6.6e-3 on gemma2, 1.2e-2 on gemma3); with the FFNs' output zeroed, everything else within F32_TOL (test below).
GEGLU_TOL = 5e-2


# Qwen3.5 (conftest FAMILY_CASES "qwen3.5" as the HF reader maps it): Gated DeltaNet layers 0-2 (full_attention_interval
# 4), two value heads per key head (llama.cpp's tiled order: gguf_table's LINEAR section), gated attention with a
# quarter of each head rotated, (1 + w) norms; qwen35moe: a BTX of it with the seed's FFN as the shared expert
QWEN35 = dict(n_layers=4, head_dim=32, rotary_fraction=0.25, rope_theta=1e7, qk_norm="head", norm_unit_offset=True,
              attn_output_gate=True, linear_layers=[0, 1, 2], linear_key_heads=2, linear_value_heads=4,
              linear_key_dim=16, linear_value_dim=16, linear_conv=4, max_positions=256)


def family_config(family: str) -> ModelConfig:
    """A tiny model of each family llama.cpp has (FAMILIES), its features as the converters read them from the
    real configs (tests/conftest.py FAMILY_CASES), RoPE's original length short enough to pass it in a test."""
    return llama_config(**FAMILIES[family][0])


FAMILIES = {  # family: (config overrides, llama.cpp's architecture)
    "llama3": (dict(scaled_rope=LLAMA3, max_positions=256, tie_embeddings=True), "llama"),
    "llama-linear": (dict(scaled_rope=dict(rope_type="linear", factor=4.0)), "llama"),
    "llama-yarn": (dict(scaled_rope=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32,
                                         attention_factor=1.25), max_positions=256, rope_theta=1e6), "llama"),
    "qwen3": (dict(qk_norm="head", head_dim=32, tie_embeddings=True, rope_theta=1e6), "qwen3"),
    "qwen3-yarn": (dict(qk_norm="head", qkv_bias=True, max_positions=256, rope_theta=1e6,
                        scaled_rope=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32)), "qwen3"),
    "olmo2": (dict(qk_norm="full", norm_position="post", rope_theta=5e5), "olmo2"),
    "phi3": (dict(scaled_rope=LONGROPE, max_positions=1024, n_kv_heads=4), "phi3"),
    "smollm3": (dict(n_layers=4, nope_layers=[3], rope_theta=5e6), "smollm3"),
    "qwen3moe": (dict(qk_norm="head", head_dim=32, ffn_experts=3, ffn_top_k=2, gate_norm="topk_softmax"),
                 "qwen3moe"),
    "qwen35": (QWEN35, "qwen35"),
    # Gemma 4 (conftest FAMILY_CASES "gemma4"): windows of 5 in layers 0, 2, 4; global layers of head size 64, one kv
    # head and K = V, proportional RoPE over a quarter; layers 4 and 5 read layers 2 and 3's K/V, their MLPs
    # double-wide; per-layer inputs of 16; a final soft-cap
    "gemma4": (dict(GEMMA, norm_unit_offset=False, n_layers=6, qk_norm="head", head_dim=32, attn_scale_dim=1,
                    attn_window=5, attn_window_layers=[0, 2, 4], window_rope_theta=10000.0, rope_theta=1e6,
                    max_positions=256, scaled_rope=dict(rope_type="proportional", partial_rotary_factor=0.25),
                    global_head_dim=64, global_kv_heads=1, global_k_eq_v=True, v_norm=True, kv_shared_layers=2,
                    kv_shared_ffn_hidden=256, per_layer_dim=16, layer_scale=True, final_softcap=30.0), "gemma4"),
    "qwen35moe": (dict(QWEN35, ffn_experts=3, ffn_top_k=2, gate_norm="topk_softmax", ffn_shared_hidden=96), "qwen35moe"),
    # Gemma (conftest FAMILY_CASES "gemma2" / "gemma3" as the HF reader maps them), windows of 5 tokens: gemma2's
    # layers 0 and 2 slide (llama.cpp's default pattern, no key), gemma3's too (not its default: the pattern array)
    "gemma2": (dict(GEMMA, n_layers=3, attn_softcap=5.0, final_softcap=3.0, attn_window=5, attn_window_layers=[0, 2]),
               "gemma2"),
    "gemma3": (dict(GEMMA, n_layers=3, qk_norm="head", head_dim=32, n_kv_heads=1, attn_window=5,
                    attn_window_layers=[0, 2], window_rope_theta=10000.0, rope_theta=1e6, max_positions=256,
                    scaled_rope=dict(rope_type="linear", factor=8.0)), "gemma3"),
    # Granite's multipliers (embedding, residual, attention scale, logit divisor) with Llama 3's RoPE and attention
    # biases; EXAONE 4 (post-norms, per-head QK-norm) without windows (RoPE everywhere), and with llama.cpp's only
    # windowed shape: 64 layers, three of four sliding, RoPE only there (at another block count llama.cpp has none)
    "granite": (dict(embedding_multiplier=12.0, residual_multiplier=0.22, attn_scale=0.0625, logit_scale=0.125,
                     qkv_bias=True, o_bias=True, scaled_rope=LLAMA3, max_positions=256), "granite"),
    "exaone4": (dict(EXAONE4, n_layers=64, d_model=32, n_heads=2, n_kv_heads=1, ffn_hidden=32, attn_window=5,
                     attn_window_layers=[i for i in range(64) if i % 4 < 3], nope_layers=list(range(3, 64, 4)),
                     scaled_rope=LLAMA3, max_positions=256), "exaone4"),
    "exaone4-global": (dict(EXAONE4, tie_embeddings=True, rope_theta=1e6), "exaone4"),
}


def family_state(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """random_state, as a trained model of the family holds it: Qwen3.5's (1 + w) scales near 1 (random_state's
    1 + N(1, 0.1) would double every norm), Gemma 4's QK-norm weights near 1/2 (its attention logits are not scaled
    by 1/sqrt(head_dim): with weights near 1 every softmax is one-hot and float32 rounding decides it)."""
    state = random_state(cfg, seed)
    if cfg.linear_layers:
        state = {n: v - 1.0 if n.endswith("norm.weight") and ".linear." not in n else v for n, v in state.items()}
    if cfg.v_norm:
        state = {n: v * 0.5 if n.endswith(("q_norm.weight", "k_norm.weight")) else v for n, v in state.items()}
    return state


def write(cfg: ModelConfig, state, out: Path, gguf_dtype: str | None = None, **options) -> Path:
    return exporter("gguf").write(StateReader(state, cfg), out, ExportOptions(own=GGUFOptions(gguf_dtype), **options))


def fields(path: Path) -> dict:
    reader = gguf.GGUFReader(str(path))
    return {k: f.contents() for k, f in reader.fields.items()}


def tensors(path: Path) -> dict:
    return {t.name: t for t in gguf.GGUFReader(str(path)).tensors}


# ---- the writer ---------------------------------------------------------------------------------------------
def test_metadata_names_and_types(tmp_path):
    cfg = llama_config(head_dim=24)
    out = write(cfg, random_state(cfg), tmp_path / "m.gguf", gguf_dtype="f16")
    f = fields(out)
    assert f["general.architecture"] == "llama" and f["general.name"] == "m" and f["general.file_type"] == 1
    expected = {"context_length": 128, "embedding_length": 64, "block_count": 2, "feed_forward_length": 128,
                "attention.head_count": 4, "attention.head_count_kv": 2, "attention.key_length": 24,
                "attention.value_length": 24, "rope.dimension_count": 24, "vocab_size": 256}
    assert {k: f[f"llama.{k}"] for k in expected} == expected
    assert f["llama.rope.freq_base"] == 10000.0 and math.isclose(f["llama.attention.layer_norm_rms_epsilon"], 1e-6,
                                                                 rel_tol=1e-6)
    assert ModelConfig.from_dict(json.loads(f["bam_surgery.config"])) == cfg
    assert f["bam_surgery.format"] == "bam-surgery/1"
    t = tensors(out)
    names = {"token_embd.weight", "output_norm.weight", "output.weight"} | {
        f"blk.{i}.{n}.weight" for i in range(2) for n in ("attn_norm", "ffn_norm", "attn_q", "attn_k", "attn_v",
                                                           "attn_output", "ffn_gate", "ffn_up", "ffn_down")}
    assert set(t) == names
    assert t["blk.0.attn_norm.weight"].tensor_type.name == "F32" and t["blk.0.attn_q.weight"].tensor_type.name == "F16"
    assert list(t["blk.0.attn_q.weight"].shape) == [64, 4 * 24]  # ggml order: [in, out]


def test_rope_rows_permuted_for_llama_only(tmp_path):
    cfg = llama_config()
    state = random_state(cfg)
    t = tensors(write(cfg, state, tmp_path / "llama.gguf"))
    q = torch.from_numpy(np.array(t["blk.1.attn_q.weight"].data)).reshape(cfg.q_dim, cfg.d_model)
    k = torch.from_numpy(np.array(t["blk.1.attn_k.weight"].data)).reshape(cfg.kv_dim, cfg.d_model)
    assert torch.equal(q, rope_pairs(state["layers.1.attn.q.weight"], 4))
    assert torch.equal(k, rope_pairs(state["layers.1.attn.k.weight"], 2))
    assert not torch.equal(q, state["layers.1.attn.q.weight"])
    # pairs already (rope_interleaved), or qwen2 (rotates halves): rows as they are
    for shape, arch in ((dict(rope_interleaved=True), "llama"), (dict(qkv_bias=True), "qwen2")):
        c = llama_config(**shape)
        s = random_state(c)
        out = write(c, s, tmp_path / f"{arch}-{len(shape)}.gguf")
        assert fields(out)["general.architecture"] == arch
        q = np.array(tensors(out)["blk.0.attn_q.weight"].data)
        assert np.array_equal(q, s["layers.0.attn.q.weight"].numpy())


def test_rope_pairs_is_a_row_permutation_per_head():
    w = torch.arange(2 * 8, dtype=torch.float32)[:, None]  # 2 heads of head_dim 8
    rows = rope_pairs(w, 2)[:, 0].long().tolist()
    assert rows == [0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15]  # (i, i + Dh/2) become neighbours


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_architecture_tensors_and_keys(tmp_path, family):
    cfg = family_config(family)
    state = random_state(cfg)
    out = write(cfg, state, tmp_path / f"{family}.gguf")
    f, t = fields(out), tensors(out)
    arch = FAMILIES[family][1]
    assert f["general.architecture"] == arch

    def data(name: str) -> np.ndarray:
        return np.array(t[name].data)

    def norm(name: str) -> np.ndarray:  # a (1 + w) norm is stored as 1 + w, which llama.cpp multiplies by
        return (state[name] + 1.0 if cfg.norm_unit_offset else state[name]).numpy()

    if cfg.qk_norm != "none":  # per head [Dh] (qwen3), over the full width [H*Dh] (olmo2); qwen35's attention: layer 3
        a = 3 if cfg.linear_layers else 1
        assert list(t[f"blk.{a}.attn_q_norm.weight"].shape) == [cfg.layer_head_dim(a) if cfg.qk_norm == "head"
                                                                else cfg.q_dim]
        assert np.array_equal(data(f"blk.{a}.attn_k_norm.weight"), norm(f"layers.{a}.attn.k_norm.weight"))
    if cfg.linear_layers:  # gguf_table's LINEAR section: ssm_a = -exp(a_log), value heads tiled, the gate per head
        assert f[f"{arch}.full_attention_interval"] == 4 and f[f"{arch}.ssm.time_step_rank"] == 4
        assert f[f"{arch}.rope.dimension_count"] == 8 and f[f"{arch}.rope.dimension_sections"] == [11, 11, 10, 0]
        a_log = state["layers.0.linear.a_log.weight"]
        assert np.allclose(data("blk.0.ssm_a"), -torch.exp(a_log[[0, 2, 1, 3]]).numpy())
        assert np.array_equal(data("blk.0.ssm_norm.weight"), state["layers.0.linear.norm.weight"].numpy())  # as w
        q, gate = state["layers.3.attn.q.weight"], state["layers.3.attn.gate.weight"]
        assert np.array_equal(data("blk.3.attn_q.weight")[32:64], gate[:32].numpy())  # head 0's gate after its query
        assert np.array_equal(data("blk.3.attn_q.weight")[64:96], q[32:64].numpy())
    if cfg.norm_position == "sandwich":
        for ours, theirs in (("attn_norm", "attn_norm"), ("attn_post_norm", "post_attention_norm"),
                             ("ffn_norm", "ffn_norm"), ("ffn_post_norm", "post_ffw_norm")):
            assert np.array_equal(data(f"blk.2.{theirs}.weight"), norm(f"layers.2.{ours}.weight"))
        assert np.array_equal(data("output_norm.weight"), norm("final_norm.weight"))
        assert f[f"{arch}.attention.sliding_window"] == 5 and f[f"{arch}.rope.freq_base_swa"] == 10000.0
        # layers 0 and 2 slide: gemma2's default (every other layer, no key), not gemma3's (five of six)
        assert f.get(f"{arch}.attention.sliding_window_pattern") == (
            None if arch == "gemma2" else [True, False] * 3 if arch == "gemma4" else [True, False, True])
        assert (f.get(f"{arch}.attn_logit_softcapping"), f.get(f"{arch}.final_logit_softcapping")) == (
            (5.0, 3.0) if arch == "gemma2" else (None, 30.0) if arch == "gemma4" else (None, None))
    if arch == "gemma4":  # gguf_table's GEMMA4 section: the global layers' geometry, per-layer arrays, rope_freqs
        assert (f["gemma4.attention.key_length"], f["gemma4.attention.key_length_swa"]) == (64, 32)
        assert f["gemma4.attention.head_count_kv"] == [2, 1] * 3 and f["gemma4.attention.shared_kv_layers"] == 2
        assert f["gemma4.feed_forward_length"] == [128] * 4 + [256] * 2
        assert (f["gemma4.rope.dimension_count"], f["gemma4.rope.dimension_count_swa"]) == (64, 32)
        assert np.array_equal(data("rope_freqs.weight"), np.float32([1.0] * 8 + [1e30] * 24))
        assert "blk.1.attn_v.weight" not in t and "blk.4.attn_k.weight" not in t  # K = V; K/V of layer 2
        assert np.array_equal(data("blk.3.layer_output_scale.weight"), state["layers.3.layer_scale.weight"].numpy())
        assert np.array_equal(data("per_layer_token_embd.weight"), state["ple_embed.weight"].numpy())
    if cfg.norm_position == "post":
        assert np.array_equal(data("blk.1.post_attention_norm.weight"), state["layers.1.attn_post_norm.weight"].numpy())
        assert np.array_equal(data("blk.1.post_ffw_norm.weight"), state["layers.1.ffn_post_norm.weight"].numpy())
        assert "blk.1.attn_norm.weight" not in t and "blk.1.ffn_norm.weight" not in t
    if arch == "phi3":  # fused: attn_qkv [q; k; v], ffn_up [gate; up]
        s = state
        assert np.array_equal(data("blk.1.attn_qkv.weight"), torch.cat(
            [s[f"layers.1.attn.{c}.weight"] for c in "qkv"]).numpy())
        assert np.array_equal(data("blk.1.ffn_up.weight"), torch.cat(
            [s["layers.1.ffn.gate.weight"], s["layers.1.ffn.up.weight"]]).numpy())
        assert not {"blk.1.attn_q.weight", "blk.1.ffn_gate.weight"} & set(t)
        assert np.array_equal(data("rope_factors_long.weight"), np.float32(LONGROPE["long_factor"]))
        assert np.array_equal(data("rope_factors_short.weight"), np.float32(LONGROPE["short_factor"]))
        assert f["phi3.rope.scaling.original_context_length"] == 256
        assert math.isclose(f["phi3.rope.scaling.attn_factor"], math.sqrt(1 + math.log(4) / math.log(256)),
                            rel_tol=1e-6)
    if arch == "olmo2" or cfg.tie_embeddings and arch != "olmo2":  # olmo2 loads output.weight; the others tie
        assert ("output.weight" in t) == (arch == "olmo2" or not cfg.tie_embeddings)
    if cfg.ffn_experts:
        assert f[f"{arch}.expert_feed_forward_length"] == cfg.ffn_hidden and f[f"{arch}.expert_count"] == 3
    kind = (cfg.scaled_rope or {}).get("rope_type")
    assert f.get(f"{arch}.rope.scaling.type") == {"linear": "linear", "yarn": "yarn", "longrope": "longrope"}.get(kind)
    if kind == "yarn":  # llama.cpp multiplies its own 0.1 ln(factor) + 1 (transformers' default) into attn_factor
        assert f[f"{arch}.rope.scaling.factor"] == 4.0 and f[f"{arch}.rope.scaling.original_context_length"] == 32
        scale = cfg.scaled_rope.get("attention_factor", 0.1 * math.log(4) + 1)
        assert math.isclose(f[f"{arch}.rope.scaling.attn_factor"], scale / (0.1 * math.log(4) + 1), rel_tol=1e-6)
    assert ("rope_freqs.weight" in t) == (kind in ("llama3", "proportional"))  # Gemma 4's: its GEMMA4 section
    assert ModelConfig.from_dict(json.loads(f["bam_surgery.config"])) == cfg


def test_llama3_frequency_factors_give_the_runtime_s_frequencies():
    from bam_surgery.converters.gguf_table import llama3_factors
    from bam_surgery.runtime.blocks import rope_frequencies

    cfg = family_config("llama3")
    factors = torch.from_numpy(llama3_factors(cfg.rope_theta, cfg.rotary_dim, LLAMA3))
    plain, _ = rope_frequencies(cfg.replace(scaled_rope=None), torch.device("cpu"))
    scaled, _ = rope_frequencies(cfg, torch.device("cpu"))
    assert factors[0] == 1 and factors[-1] == 8 and 1 < factors[1] < 8  # kept, scaled, and one on the ramp
    torch.testing.assert_close(plain / factors, scaled, rtol=1e-6, atol=0)
    # Llama 3.1's parameters: the same rule at head_dim 128 (kept, ramp, scaled; never decreasing)
    real = torch.from_numpy(llama3_factors(500000.0, 128, dict(LLAMA3, original_max_position_embeddings=8192)))
    cfg31 = ModelConfig(vocab_size=8, d_model=128, n_layers=1, n_heads=1, ffn_hidden=8, rope_theta=500000.0,
                        max_positions=131072, scaled_rope=dict(LLAMA3, original_max_position_embeddings=8192))
    plain, _ = rope_frequencies(cfg31.replace(scaled_rope=None), torch.device("cpu"))
    torch.testing.assert_close(plain / real, rope_frequencies(cfg31, torch.device("cpu"))[0], rtol=1e-6, atol=0)
    assert bool((real[1:] >= real[:-1]).all()) and ((real > 1) & (real < 8)).any()


@pytest.mark.parametrize("overrides, needle", [
    (dict(scaled_rope=dict(rope_type="dynamic", factor=2.0)), "rope_type 'dynamic'"),
    (dict(qk_norm="head", scaled_rope=LLAMA3), "qwen3 applies (linear, yarn)"),
    (dict(scaled_rope=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32, beta_fast=16)),
     "beta_fast 16"),
    (dict(n_layers=4, nope_layers=[1]), "no RoPE in layers [1]"),
    (dict(qk_norm="head", ffn_experts=3, ffn_top_k=2, gate_norm="softmax"), "--gate-norm topk_softmax"),
    (dict(qk_norm="full", norm_position="post", head_dim=24), "4 heads of 24 in d_model 64"),
    (dict(scaled_rope=LONGROPE, max_positions=1024, o_bias=True), "o biases"),
    (dict(qk_norm="full", norm_position="post", ffn_experts=2, gate_norm="topk_softmax"),
     "none has norms after attention and FFN"),
    (dict(qk_norm="head", rope_interleaved=True), "interleaved RoPE"),
    (dict(FAMILIES["gemma2"][0], attn_window=None, attn_window_layers=None), "no sliding-window layers"),
    (dict(FAMILIES["gemma2"][0], attn_softcap=None), "attention soft-capping (llama.cpp's gemma2)"),
    (dict(FAMILIES["gemma2"][0], tie_embeddings=False), "an lm_head of its own"),
    (dict(FAMILIES["gemma2"][0], attn_scale_dim=24), "attention scaled by 1/sqrt(16) (llama.cpp's gemma2)"),
    (dict(FAMILIES["gemma3"][0], attn_softcap=5.0), "no attention soft-capping (llama.cpp's gemma3)"),
    (dict(FAMILIES["gemma3"][0], window_rope_theta=None), "sliding layers with the global RoPE scaling"),
    (dict(FAMILIES["gemma3"][0], scaled_rope=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32)),
     "gemma3 applies (linear)"),
    (dict(FAMILIES["gemma3"][0], ffn_experts=3, ffn_top_k=2, gate_norm="topk_softmax"),
     "none has norms before and after attention and FFN"),
    (dict(scale_embeddings=True), "unscaled embeddings (llama.cpp's llama)"),
    (dict(attn_window=8), "attention over the whole prefix (llama.cpp's llama)"),
])
def test_family_features_refused_from_config_alone(overrides, needle):
    with pytest.raises(CapabilityError) as e:
        check_export("gguf", llama_config(**overrides))
    assert needle in str(e.value) and "\n" not in str(e.value) and "llama.cpp" in str(e.value)


def test_q8_0_keeps_vectors_and_routers_f32_and_odd_rows_f16(tmp_path):
    cfg = llama_config(ffn_hidden=48, ffn_experts=2, ffn_top_k=2, gate_norm="topk_softmax")
    lines = []
    out = write(cfg, random_state(cfg), tmp_path / "q.gguf", gguf_dtype="q8_0", log=lines.append)
    t = tensors(out)
    assert t["blk.0.ffn_gate_inp.weight"].tensor_type.name == "F32"
    assert t["blk.0.ffn_norm.weight"].tensor_type.name == "F32"
    assert t["blk.0.attn_q.weight"].tensor_type.name == "Q8_0"
    assert t["blk.0.ffn_down_exps.weight"].tensor_type.name == "F16"  # rows of 48 values: not blocks of 32
    assert t["blk.0.ffn_up_exps.weight"].tensor_type.name == "Q8_0"
    assert list(t["blk.0.ffn_up_exps.weight"].shape) == [64, 48, 2]
    f = fields(out)
    assert f["llama.expert_count"] == 2 and f["llama.expert_used_count"] == 2 and f["general.file_type"] == 7
    assert any("f16" in line for line in lines)


def test_shared_expert_mixture_as_qwen2moe(tmp_path):
    cfg = shared_config(tie_embeddings=True)
    state = random_state(cfg)
    state["layers.0.ffn_shared_gate.weight"].zero_()  # as btx-shared-expert merges it
    out = write(cfg, state, tmp_path / "s.gguf")
    f, t = fields(out), tensors(out)
    assert f["general.architecture"] == "qwen2moe"
    expected = {"expert_count": 3, "expert_used_count": 2, "expert_feed_forward_length": 128,
                "expert_shared_feed_forward_length": 96, "feed_forward_length": 128, "attention.head_count": 4,
                "attention.head_count_kv": 2, "rope.dimension_count": 16}
    assert {k: f[f"qwen2moe.{k}"] for k in expected} == expected
    layer = ("attn_norm", "ffn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate_inp", "ffn_gate_exps",
             "ffn_up_exps", "ffn_down_exps", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp", "ffn_gate_inp_shexp")
    assert set(t) == {"token_embd.weight", "output_norm.weight", "output.weight"} | {
        f"blk.{i}.{n}.weight" for i in range(2) for n in layer} | {f"blk.{i}.attn_{c}.bias" for i in range(2)
                                                                   for c in "qkv"}

    def data(name: str) -> np.ndarray:
        return np.array(t[name].data)

    for c, width in (("q", cfg.q_dim), ("k", cfg.kv_dim), ("v", cfg.kv_dim)):  # zeros: the model has no biases
        assert data(f"blk.1.attn_{c}.bias").shape == (width,) and not data(f"blk.1.attn_{c}.bias").any()
    assert np.array_equal(data("blk.1.attn_q.weight"), state["layers.1.attn.q.weight"].numpy())  # halves: as is
    assert np.array_equal(data("blk.1.ffn_up_shexp.weight"), state["layers.1.ffn_shared.up.weight"].numpy())
    assert np.array_equal(data("blk.1.ffn_down_exps.weight"), state["layers.1.ffn_experts.down.weight"].numpy())
    assert list(t["blk.1.ffn_gate_inp_shexp.weight"].shape) == [64, 1]
    assert np.array_equal(data("blk.1.ffn_gate_inp_shexp.weight").reshape(1, 64),
                          state["layers.1.ffn_shared_gate.weight"].numpy())
    # all zeros: llama.cpp's silu(y) / y would be 0 / 0; a tiny constant gives the same sigmoid 1/2
    assert np.array_equal(data("blk.0.ffn_gate_inp_shexp.weight"), np.full((1, 64), ge.SHEXP_GATE_EPS, np.float32))
    assert np.array_equal(data("output.weight"), data("token_embd.weight"))  # tied: qwen2moe loads output.weight
    assert ModelConfig.from_dict(json.loads(f["bam_surgery.config"])) == cfg.replace(qkv_bias=True)
    assert "shared expert" in f["general.description"] and "zeros" in f["general.description"]
    t = tensors(write(cfg, state, tmp_path / "q.gguf", gguf_dtype="q8_0"))
    assert t["blk.0.ffn_gate_inp_shexp.weight"].tensor_type.name == "F32"
    assert t["blk.0.ffn_gate_inp.weight"].tensor_type.name == "F32"
    assert t["blk.0.ffn_up_shexp.weight"].tensor_type.name == "Q8_0"
    assert t["output.weight"].tensor_type.name == "Q8_0"
    cfg = shared_config(qkv_bias=True)  # biases of its own: written as they are, no zeros described
    state = random_state(cfg)
    f, t = fields(out := write(cfg, state, tmp_path / "b.gguf")), tensors(out)
    assert np.array_equal(np.array(t["blk.0.attn_k.bias"].data), state["layers.0.attn.k.bias"].numpy())
    assert "output.weight" in t and "zeros" not in f["general.description"]


def test_shared_expert_topk_softmax_refused_in_one_line(tmp_path):
    paths = seed_and_experts(tmp_path, llama_config(), names=("seed", "code", "law", "math"))
    args = ("--recipe", "btx-shared-expert", "--gate-norm", "topk_softmax", "--ffn-top-k", "2", "--format", "gguf")
    line = error_line(merge_family(paths, tmp_path / "s.gguf", *args, code=2), "recipe btx-shared-expert",
                      "not renormalized over the top-k", "--gate-norm softmax",
                      "gate_norm topk_softmax with top-2 of 3", "qwen2_moe")
    assert "llama.cpp" in line
    assert not (tmp_path / "s.gguf").exists()
    # top-k over every expert: renormalizing changes nothing, so it is written
    check_export("gguf", shared_config(gate_norm="topk_softmax", ffn_top_k=3))


def test_byte_vocabulary_is_gpt2_bytes_and_end_of_text(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    cfg = llama_config(vocab_size=300)
    f = fields(write(cfg, random_state(cfg), tmp_path / "b.gguf"))
    tokens, types = f["tokenizer.ggml.tokens"], f["tokenizer.ggml.token_type"]
    assert len(tokens) == 300 and tokens[0] == "<|endoftext|>" and types[0] == gguf.TokenType.CONTROL
    assert tokens[ord(" ")] == "Ġ" and tokens[ord("\n")] == "Ċ" and tokens[ord("a")] == "a"
    assert set(tokens[1:256]) | {ge.byte_symbols()[0]} == set(tokenizers.pre_tokenizers.ByteLevel.alphabet())
    assert tokens[256:] == [f"[PAD{i}]" for i in range(256, 300)] and set(types[256:]) == {gguf.TokenType.UNUSED}
    assert f["tokenizer.ggml.merges"] == []
    assert f["tokenizer.ggml.eos_token_id"] == f["tokenizer.ggml.bos_token_id"] == 0
    assert f["tokenizer.ggml.model"] == "gpt2" and f["tokenizer.ggml.pre"] == "gpt-2"
    assert f["tokenizer.ggml.add_bos_token"] is False


def test_byte_tokenizer_rule_is_train_s():
    from bam_surgery.train import provenance, tokenize

    assert (ge.BYTES, ge.BYTE_VOCAB, ge.BYTE_FALLBACK_MAX_VOCAB) == (
        tokenize.BYTES, tokenize.BYTE_VOCAB, tokenize.BYTE_FALLBACK_MAX_VOCAB)
    assert ge.TOKENIZER_KEY == provenance.TOKENIZER_KEY and ge.EOS_CANDIDATES == tokenize.EOS_CANDIDATES


def save_bpe(folder: Path, vocab_size: int = 300, pre_tokenizer=None, ignore_merges: bool = False) -> Path:
    """tokenizer.json and tokenizer_config.json of a byte-level BPE learnt from CORPUS (train/bpe.py's kind, or
    another pre-tokenizer)."""
    tokenizers = pytest.importorskip("tokenizers")
    from bam_surgery.train.bpe import EOS_TOKEN, build_bpe

    folder.mkdir(parents=True, exist_ok=True)
    if pre_tokenizer is None:
        tok = build_bpe(CORPUS, vocab_size)
    else:
        tok = tokenizers.Tokenizer(tokenizers.models.BPE(ignore_merges=ignore_merges))
        tok.pre_tokenizer = pre_tokenizer
        tok.decoder = tokenizers.decoders.ByteLevel()
        trainer = tokenizers.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN], show_progress=False,
                                                 initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(CORPUS, trainer=trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS_TOKEN, "bos_token": EOS_TOKEN,
                                                              "chat_template": "{{ messages }}"}))
    return folder / "tokenizer.json"


def write_bpe(cfg: ModelConfig, state, out: Path, **options) -> Path:
    """A GGUF embedding the BPE of save_bpe (learnt once per folder, in OUT's folder / tok)."""
    folder = out.parent / "tok"
    path = folder / "tokenizer.json" if (folder / "tokenizer.json").is_file() else save_bpe(folder)
    return write(cfg, state, out, tokenizer_files=(path, folder / "tokenizer_config.json"), **options)


def test_bpe_vocabulary_from_tokenizer_json(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    path = save_bpe(tmp_path / "tok")
    tok = tokenizers.Tokenizer.from_file(str(path))
    cfg = llama_config(vocab_size=310)
    out = write_bpe(cfg, random_state(cfg), tmp_path / "bpe.gguf")
    f = fields(out)
    assert f["tokenizer.ggml.tokens"][:300] == [tok.id_to_token(i) for i in range(300)]
    assert f["tokenizer.ggml.tokens"][300:] == [f"[PAD{i}]" for i in range(300, 310)]
    body = json.loads(path.read_text())
    assert f["tokenizer.ggml.merges"] == [m if isinstance(m, str) else " ".join(m) for m in body["model"]["merges"]]
    assert f["tokenizer.ggml.pre"] == "gpt-2" and f["tokenizer.ggml.eos_token_id"] == 0
    assert f["tokenizer.ggml.token_type"][0] == gguf.TokenType.CONTROL
    assert f["tokenizer.chat_template"] == "{{ messages }}"


def test_pre_tokenizers_llama_cpp_implements():
    tokenizers = pytest.importorskip("tokenizers")
    pre = tokenizers.pre_tokenizers

    def as_json(p) -> dict:
        tok = tokenizers.Tokenizer(tokenizers.models.BPE())
        tok.pre_tokenizer = p
        return json.loads(tok.to_str())["pre_tokenizer"]

    assert ge.pre_tokenizer_name(as_json(pre.ByteLevel(add_prefix_space=False)), "t") == "gpt-2"
    for regex, name in ((gt.LLAMA3_REGEX, "llama-bpe"), (gt.QWEN2_REGEX, "qwen2")):
        split = pre.Sequence([pre.Split(tokenizers.Regex(regex), behavior="isolated"),
                              pre.ByteLevel(add_prefix_space=False, use_regex=False)])
        assert ge.pre_tokenizer_name(as_json(split), "t") == name
    smollm = pre.Sequence([pre.Digits(individual_digits=True), pre.ByteLevel(add_prefix_space=False)])
    assert ge.pre_tokenizer_name(as_json(smollm), "t") == "smollm"
    for other in (pre.ByteLevel(add_prefix_space=True), pre.Whitespace(), pre.Metaspace(),
                  pre.Sequence([pre.Digits(individual_digits=False), pre.ByteLevel(add_prefix_space=False)])):
        with pytest.raises(CapabilityError, match="pre-tokenizer"):
            ge.pre_tokenizer_name(as_json(other), "t")


def test_canonical_folder_carries_its_tokenizer(tmp_path):
    cfg = llama_config(vocab_size=300)
    folder = save_checkpoint(random_state(cfg), cfg, tmp_path / "ckpt")
    save_bpe(folder)
    run_cli("export-gguf", folder, "--out", tmp_path / "c.gguf")
    f = fields(tmp_path / "c.gguf")
    assert len(f["tokenizer.ggml.merges"]) > 0 and f["tokenizer.ggml.pre"] == "gpt-2"
    assert f["general.base_model.0.name"] == str(folder)


# ---- refusals, errors, atomic writes ---------------------------------------------------------------------
@pytest.mark.parametrize("overrides, needle", [
    (dict(attn_experts=2, ffn_experts=2), "attention experts"),
    (dict(activation="gelu"), "activation gelu"),
    (dict(norm="layernorm"), "norm layernorm"),
    (dict(block="parallel"), "block parallel"),
    (dict(rotary_fraction=0.5), "rotary_fraction 0.5"),
    (dict(position="learned"), "position learned"),
    # softmax gates go to qwen2moe (a zero shared expert), which needs n_heads * head_dim = d_model: llama's refusal
    (dict(ffn_experts=3, ffn_top_k=1, gate_norm="softmax", head_dim=24), "gate_norm softmax"),
    (dict(ffn_experts=2, gate_norm="topk_softmax", router="mlp"), "router mlp"),
    (dict(ffn_experts=2, gate_norm="topk_softmax", ffn_shared_hidden=32), "--gate-norm softmax"),
    (dict(ffn_experts=2, ffn_shared_hidden=32, head_dim=24), "4 heads of 24 in d_model 64"),
    (dict(ffn_experts=2, ffn_shared_hidden=32, o_bias=True), "o biases"),
    (dict(ffn_experts=2, ffn_shared_hidden=32, rope_interleaved=True), "interleaved RoPE"),
])
def test_capability_refused_from_config_alone(overrides, needle):
    cfg = llama_config(**overrides)
    with pytest.raises(CapabilityError) as e:
        check_export("gguf", cfg, recipe="bam")
    message = str(e.value)
    assert needle in message and "\n" not in message
    assert message.endswith(("; the hf or onnx formats carry it", "; the qwen2_moe, hf or onnx formats carry it",
                             "; --format onnx carries it")), message


def test_a_logit_scale_goes_to_granite():
    """llama.cpp's granite divides the logits (logit_scale key): a Llama-shaped model with a logit scale is carried
    there, its other multipliers at 1 (llama.cpp's llama has none)."""
    cfg = llama_config(logit_scale=0.5)
    check_export("gguf", cfg)
    assert ge.gguf_architecture(cfg) == "granite" and ge.gguf_architecture(llama_config()) == "llama"


class NoReads(WrappedReader):
    source_dir = None

    def get(self, name):
        raise AssertionError(f"read {name}")


def test_refusal_reads_no_tensor(tmp_path):
    cfg = llama_config(attn_experts=2, ffn_experts=2)
    reader = NoReads(StateReader(random_state(cfg), cfg))
    with pytest.raises(CapabilityError, match="attention experts"):
        exporter("gguf").write(reader, tmp_path / "x.gguf", ExportOptions())
    cfg = llama_config(vocab_size=1000)  # no tokenizer: refused before reading too
    with pytest.raises(CapabilityError, match="no tokenizer.json"):
        exporter("gguf").write(NoReads(StateReader(random_state(cfg), cfg)), tmp_path / "x.gguf", ExportOptions())
    assert list(tmp_path.iterdir()) == []


def test_bam_mixture_refused_in_one_line(tmp_path):
    paths = seed_and_experts(tmp_path, llama_config())
    line = error_line(merge_family(paths, tmp_path / "bam.gguf", "--format", "gguf", code=2), "attention experts",
                      "recipe bam", "; the hf or onnx formats carry it")
    assert "llama.cpp" in line
    merge_family(paths, tmp_path / "bam.safetensors")
    cli_error_line("export-gguf", tmp_path / "bam.safetensors", "--out", tmp_path / "b.gguf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bam.safetensors", "code.safetensors", "math.safetensors",
                                                          "seed.safetensors"]


def test_one_line_errors_and_force(tmp_path):
    cfg = llama_config()
    ckpt = save_checkpoint(random_state(cfg), cfg, tmp_path / "d.safetensors")
    out = tmp_path / "d.gguf"
    cli_error_line("export-gguf", ckpt, "--out", tmp_path / "d.bin")
    cli_error_line("export-gguf", ckpt, "--out", out, "--dtype", "q4_0")
    cli_error_line("export-gguf", tmp_path / "missing.safetensors", "--out", out)
    assert error_line(run_cli("convert", ckpt, "--out", tmp_path / "c", "--format", "gguf", code=2), ".gguf")
    run_cli("export-gguf", ckpt, "--out", out)
    first = out.read_bytes()
    assert "already exists" in cli_error_line("export-gguf", ckpt, "--out", out)
    run_cli("export-gguf", ckpt, "--out", out, "--force", "--dtype", "f16")  # our own file: replaced
    assert out.read_bytes() != first and fields(out)["general.file_type"] == 1
    foreign = tmp_path / "foreign.gguf"
    w = gguf.GGUFWriter(str(foreign), "llama")  # a GGUF file someone else wrote
    w.add_tensor("x", np.zeros(4, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    before = foreign.read_bytes()
    assert "did not write" in cli_error_line("export-gguf", ckpt, "--out", foreign, "--force")
    assert foreign.read_bytes() == before


class FailsLate(WrappedReader):
    source_dir = None

    def get(self, name):
        if name.startswith("layers.1."):
            raise OSError(5, "Input/output error", "d.safetensors")
        return self._r.get(name)


def test_nothing_half_written(tmp_path):
    cfg = llama_config()
    with pytest.raises(OSError):
        exporter("gguf").write(FailsLate(StateReader(random_state(cfg), cfg)), tmp_path / "x.gguf", ExportOptions())
    assert list(tmp_path.iterdir()) == []


def test_missing_gguf_package_is_one_line(tmp_path, monkeypatch):
    cfg = llama_config()
    ckpt = save_checkpoint(random_state(cfg), cfg, tmp_path / "d.safetensors")
    monkeypatch.setitem(sys.modules, "gguf", None)
    line = cli_error_line("export-gguf", ckpt, "--out", tmp_path / "d.gguf")
    assert "'gguf'" in line and "pip install gguf" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.safetensors"]


def test_merge_format_gguf_card(tmp_path):
    paths = seed_and_experts(tmp_path, llama_config())
    merge_family(paths, tmp_path / "btx.gguf", "--recipe", "btx", "--gate-norm", "topk_softmax", "--ffn-top-k", "2",
                 "--format", "gguf")
    f = fields(tmp_path / "btx.gguf")
    assert f["llama.expert_count"] == 3 and f["llama.expert_used_count"] == 2
    assert [f[f"general.base_model.{i}.name"] for i in range(3)] == ["seed", "code", "math"]
    assert "recipe btx" in f["general.description"]
    assert json.loads(f["bam_surgery.provenance"])["recipe"]["name"] == "btx"


# ---- llama.cpp itself ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama_cpp():
    """llama-cpp-python: skipped where it is not installed, but a failure in make test-compat, which installs it."""
    if os.environ.get("BAM_COMPAT_STAGE") == "1":
        import llama_cpp

        return llama_cpp
    return pytest.importorskip("llama_cpp")


def llama(llama_cpp, path: Path, **kw):
    """The file loaded by llama.cpp, its KV cache in f32 (so that only the weights' type differs from the runtime)."""
    options = dict(logits_all=True, n_ctx=128, n_threads=1, n_threads_batch=1, type_k=llama_cpp.GGML_TYPE_F32,
                   type_v=llama_cpp.GGML_TYPE_F32, verbose=False)
    return llama_cpp.Llama(model_path=str(path), **{**options, **kw})


def llama_logits(llm, ids: list[int]) -> np.ndarray:
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[:len(ids)], dtype=np.float64)


def runtime_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].double().numpy()


def llama_greedy(llm, ids: list[int], n: int) -> list[int]:
    out = []
    for token in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
        out.append(token)
        if len(out) == n:
            return out
    return out


def cfg_vocab(model) -> int:
    return model.config.vocab_size


def perplexity(logits: np.ndarray, ids: list[int]) -> float:
    logp = torch.log_softmax(torch.from_numpy(logits[:-1]), -1)
    return math.exp(-logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].mean().item())


def check_against_runtime(llm, model, prompt: list[int], tol: float, n_new: int = 12) -> float:
    """llama.cpp's logits for prompt within tol of the runtime's, and the same greedy tokens; the largest difference."""
    diff = float(np.abs(llama_logits(llm, prompt) - runtime_logits(model, prompt)).max())
    assert diff <= tol, diff
    expected = generate(model, torch.tensor([prompt]), n_new)[0].tolist()
    assert llama_greedy(llm, prompt, n_new) == expected
    return diff


def trained(cfg: ModelConfig, ids: list[int], steps: int = 60, seed: int = 3) -> Model:
    """A model fitted for a few steps to `ids` (windows of 48 tokens), so that held-out perplexity means something
    and the q8_0 delta is measured on a model that predicts, not on a uniform guess."""
    torch.manual_seed(seed)
    model = Model(cfg)
    model.load_state_dict(random_state(cfg, seed))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = torch.tensor(ids)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, len(ids) - 49, (8,), generator=gen)
        batch = torch.stack([data[s:s + 49] for s in starts.tolist()])
        logits = model(batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab_size), batch[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


@pytest.fixture(scope="module")
def bpe_llama(tmp_path_factory, one_thread):
    """A dense Llama (fitted a little to CORPUS) as an HF folder (convert --format hf) with a byte-level BPE
    tokenizer.json, exported in each dtype; and the runtime's model."""
    tokenizers = pytest.importorskip("tokenizers")
    root = tmp_path_factory.mktemp("bpe")
    cfg = llama_config(vocab_size=300)
    save_bpe(root / "tok")
    tok = tokenizers.Tokenizer.from_file(str(root / "tok" / "tokenizer.json"))
    with torch.random.fork_rng():  # trained() seeds torch's generator for Model's init; the tests' stays as it was
        model = trained(cfg, tok.encode("\n".join(CORPUS)).ids)
    canonical = save_model(model, root / "llama.safetensors")
    run_cli("convert", canonical, "--out", root / "hf", "--format", "hf", "--architecture", "llama")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(root / "tok" / name, root / "hf" / name)
    for dtype in ("f32", "f16", "q8_0"):
        run_cli("export-gguf", root / "hf", "--out", root / f"llama-{dtype}.gguf", "--dtype", dtype)
    return root, load_model(canonical)


@pytest.mark.slow
def test_llama_cpp_bpe_llama_logits_greedy_and_tokens(llama_cpp, bpe_llama, one_thread):
    tokenizers = pytest.importorskip("tokenizers")
    root, model = bpe_llama
    tok = tokenizers.Tokenizer.from_file(str(root / "tok" / "tokenizer.json"))
    llm = llama(llama_cpp, root / "llama-f32.gguf")
    for text in TRICKY + [HELD_OUT]:  # the runtime's encoding (cli/generate.py: tokenizers' encode)
        assert llm.tokenize(text.encode(), add_bos=True, special=True) == tok.encode(text).ids, text
    prompt = tok.encode("The quick brown fox merges the experts").ids
    diff32 = check_against_runtime(llm, model, prompt, F32_TOL)
    f16 = llama(llama_cpp, root / "llama-f16.gguf")
    diff16 = float(np.abs(llama_logits(f16, prompt) - runtime_logits(model, prompt)).max())
    assert diff16 <= F16_TOL, diff16
    held = tok.encode(HELD_OUT).ids
    ppl = perplexity(runtime_logits(model, held), held)
    q8 = llama_logits(llama(llama_cpp, root / "llama-q8_0.gguf"), held)
    ppl_f16, ppl_q8 = perplexity(llama_logits(f16, held), held), perplexity(q8, held)
    diff8 = float(np.abs(q8 - runtime_logits(model, held)).max())
    print(f"\nbpe llama: max|dlogit| f32 {diff32:.2e}, f16 {diff16:.2e}, q8_0 {diff8:.2e}; perplexity on {len(held)} "
          f"held-out tokens: runtime {ppl:.4f}, f16 {ppl_f16:.4f} ({ppl_f16 - ppl:+.4f}), q8_0 {ppl_q8:.4f} "
          f"(delta {ppl_q8 - ppl:+.4f}, {(ppl_q8 / ppl - 1):+.3%})")
    assert ppl < 0.5 * cfg_vocab(model)  # the model predicts: far below a uniform guess
    assert abs(ppl_q8 / ppl - 1) <= Q8_PPL_REL_TOL


@pytest.mark.slow
def test_llama_cpp_byte_tokenizer_model(llama_cpp, tmp_path, one_thread):
    from bam_surgery.train.tokenize import ByteTokenizer

    cfg = llama_config(rope_theta=1e6, norm_eps=1e-5)  # Mistral's RoPE base: llama in llama.cpp too
    ckpt = save_checkpoint(random_state(cfg, 5), cfg, tmp_path / "bytes.safetensors")
    run_cli("export-gguf", ckpt, "--out", tmp_path / "bytes.gguf")
    llm = llama(llama_cpp, tmp_path / "bytes.gguf")
    runtime_tok = ByteTokenizer()
    for text in TRICKY + [HELD_OUT]:  # special=False: the byte tokenizer spells <|endoftext|> out in bytes
        ids = [int(i) for i in runtime_tok.encode_batch([text])[0]]
        assert llm.tokenize(text.encode(), add_bos=True, special=False) == ids, text
        assert llm.detokenize(ids) == text.replace("\x00", "").encode()
    prompt = [int(i) for i in runtime_tok.encode_batch(["def fib(n):"])[0]]
    diff = check_against_runtime(llm, load_model(ckpt), prompt, F32_TOL, n_new=16)
    print(f"\nbyte tokenizer: max|dlogit| f32 {diff:.2e}")


@pytest.mark.slow
def test_llama_cpp_btx_mixture(llama_cpp, tmp_path, one_thread):
    paths = seed_and_experts(tmp_path, llama_config())
    btx = ("--recipe", "btx", "--gate-norm", "topk_softmax", "--ffn-top-k", "2", "--router-std", "0.5")
    merge_family(paths, tmp_path / "btx.gguf", *btx, "--format", "gguf")
    merge_family(paths, tmp_path / "btx.safetensors", *btx)
    model = load_model(tmp_path / "btx.safetensors")
    prompt = list(range(40, 60))
    with torch.no_grad():  # the routers spread tokens over all experts
        chosen = next(iter(model(torch.tensor([prompt])).routing.values())).probs.topk(2, -1).indices
    assert chosen.unique().numel() == 3
    diff = check_against_runtime(llama(llama_cpp, tmp_path / "btx.gguf"), model, prompt, F32_TOL)
    print(f"\nbtx mixture: max|dlogit| f32 {diff:.2e}")


@pytest.mark.slow
@pytest.mark.parametrize("case", [
    # BTX's top-2 renormalized gates: llama.cpp's llama (Mixtral's graph), which adds the q/k/v biases of a Qwen2 model
    # (and an o bias)
    ("llama", dict(qkv_bias=True, o_bias=True), ("--gate-norm", "topk_softmax", "--ffn-top-k", "2")),
    # the paper's top-1 softmax gates, which llama's graph would renormalize: qwen2moe with an all-zero shared expert
    ("qwen2moe", dict(qkv_bias=True), ("--gate-norm", "softmax", "--ffn-top-k", "1")),
], ids=["topk-softmax-llama", "softmax-qwen2moe"])
def test_llama_cpp_btx_of_qwen2_models(llama_cpp, tmp_path, case, one_thread):
    """A BTX of Qwen2-shaped models (q/k/v biases) runs in llama.cpp with the runtime's logits and greedy tokens."""
    arch, shape, gates = case
    paths = seed_and_experts(tmp_path, llama_config(**shape))
    btx = ("--recipe", "btx", *gates, "--router-std", "0.5")
    merge_family(paths, tmp_path / "btx.gguf", *btx, "--format", "gguf")
    merge_family(paths, tmp_path / "btx.safetensors", *btx)
    f = fields(tmp_path / "btx.gguf")
    assert f["general.architecture"] == arch and "blk.0.attn_q.bias" in tensors(tmp_path / "btx.gguf")
    if arch == "qwen2moe":
        assert "shared expert of 32 hidden units written as zeros" in f["general.description"]
        assert not tensors(tmp_path / "btx.gguf")["blk.1.ffn_down_shexp.weight"].data.any()
    model = load_model(tmp_path / "btx.safetensors")
    prompt = list(range(40, 60))
    with torch.no_grad():  # the routers spread tokens over all experts
        chosen = next(iter(model(torch.tensor([prompt])).routing.values())).topk
    assert chosen.unique().numel() >= 2
    diff = check_against_runtime(llama(llama_cpp, tmp_path / "btx.gguf"), model, prompt, F32_TOL)
    print(f"\nbtx of qwen2 models as {arch}: max|dlogit| f32 {diff:.2e}")


@pytest.fixture(scope="module")
def shared_family(tmp_path_factory, one_thread):
    """A seed and three specialists (seed_and_experts) as HF Llama folders carrying a byte-level BPE tokenizer.json,
    which a merge carries into the GGUF file; and that tokenizer."""
    tokenizers = pytest.importorskip("tokenizers")
    root = tmp_path_factory.mktemp("shared")
    save_bpe(root / "tok")
    folders = []
    for path in seed_and_experts(root, llama_config(vocab_size=300), names=("seed", "code", "law", "math")):
        folder = root / path.stem
        run_cli("convert", path, "--out", folder, "--format", "hf", "--architecture", "llama")
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(root / "tok" / name, folder / name)
        folders.append(folder)
    return folders, tokenizers.Tokenizer.from_file(str(root / "tok" / "tokenizer.json"))


@pytest.mark.slow
@pytest.mark.parametrize("gate_norm", ["softmax", "topk_softmax"])
def test_llama_cpp_shared_expert_mixture(llama_cpp, shared_family, tmp_path, gate_norm, monkeypatch, one_thread):
    """btx-shared-expert as llama.cpp's qwen2moe. softmax: merge --format gguf, logits and greedy tokens equal the
    runtime's, as merged (shared gate 1/2) and with trained shared gates (export-gguf). topk_softmax: refused, because
    llama.cpp's qwen2moe never renormalizes: written anyway, it computes the same weights with softmax gates."""
    folders, tok = shared_family
    args = ("--recipe", "btx-shared-expert", "--gate-norm", gate_norm, "--ffn-top-k", "2", "--router-std", "0.5")
    merge_family(folders, tmp_path / "mix.safetensors", *args)
    model = load_model(tmp_path / "mix.safetensors")
    prompt = tok.encode("The quick brown fox merges the experts; numbers 42 and 2024 follow the seed.").ids
    with torch.no_grad():
        routing = next(iter(model(torch.tensor([prompt])).routing.values()))
    assert routing.topk.unique().numel() == 3  # the routers spread tokens over all routed experts
    if gate_norm == "topk_softmax":
        error_line(merge_family(folders, tmp_path / "mix.gguf", *args, "--format", "gguf", code=2),
                   "--gate-norm softmax")
        assert not (tmp_path / "mix.gguf").exists()
        monkeypatch.setattr(ge, "check_gguf", lambda cfg, recipe=None: None)
        state = model.state_dict()
        write(model.config, state, tmp_path / "forced.gguf")
        llm = llama(llama_cpp, tmp_path / "forced.gguf")
        off = float(np.abs(llama_logits(llm, prompt) - runtime_logits(model, prompt)).max())
        assert off > 100 * F32_TOL, off
        as_softmax = Model(model.config.replace(gate_norm="softmax"))
        as_softmax.load_state_dict(state)
        diff = check_against_runtime(llm, as_softmax.eval(), prompt, F32_TOL)
        print(f"\nshared expert, topk_softmax written anyway: max|dlogit| {off:.2e} from the model, {diff:.2e} from "
              "the same weights with softmax gates")
        return
    assert float(routing.gates.sum(-1).min()) < 0.95  # the top-2 gates p_i do not sum to 1: not renormalized
    merge_family(folders, tmp_path / "mix.gguf", *args, "--format", "gguf")
    f = fields(tmp_path / "mix.gguf")
    assert f["general.architecture"] == "qwen2moe" and f["tokenizer.ggml.pre"] == "gpt-2"
    assert "recipe btx-shared-expert" in f["general.description"]
    llm = llama(llama_cpp, tmp_path / "mix.gguf")
    assert llm.tokenize(HELD_OUT.encode(), add_bos=True, special=True) == tok.encode(HELD_OUT).ids
    diff = check_against_runtime(llm, model, prompt, F32_TOL)
    # trained shared gates (merged at w = 0, sigmoid 1/2 for every token): a canonical folder through export-gguf
    state = model.state_dict()
    gen = torch.Generator().manual_seed(1)
    for i in range(model.config.n_layers):
        state[f"layers.{i}.ffn_shared_gate.weight"] = torch.randn(1, model.config.d_model, generator=gen)
    folder = save_checkpoint(state, model.config, tmp_path / "trained")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(folders[0] / name, folder / name)
    run_cli("export-gguf", folder, "--out", tmp_path / "trained.gguf")
    trained_model = load_model(folder)
    gates = []
    hook = trained_model.layers[0].ffn_shared_gate.register_forward_hook(lambda m, i, o: gates.append(o.sigmoid()))
    with torch.no_grad():
        trained_model(torch.tensor([prompt]))
    hook.remove()
    assert float(gates[0].max() - gates[0].min()) > 0.1  # the shared gates differ across tokens
    assert float(np.abs(runtime_logits(trained_model, prompt) - runtime_logits(model, prompt)).max()) > 1e-2
    diff_trained = check_against_runtime(llama(llama_cpp, tmp_path / "trained.gguf"), trained_model, prompt, F32_TOL)
    run_cli("export-gguf", folder, "--out", tmp_path / "trained-f16.gguf", "--dtype", "f16")
    f16 = llama_logits(llama(llama_cpp, tmp_path / "trained-f16.gguf"), prompt)
    diff16 = float(np.abs(f16 - runtime_logits(trained_model, prompt)).max())
    assert diff16 <= F16_TOL, diff16
    print(f"\nshared expert (qwen2moe): max|dlogit| f32 {diff:.2e} as merged, {diff_trained:.2e} with trained gates, "
          f"f16 {diff16:.2e}")


@pytest.mark.slow
@pytest.mark.parametrize("shape", [dict(qkv_bias=True), dict(tie_embeddings=True, n_kv_heads=1),
                                   dict(ffn_top_k=1, n_heads=2, n_kv_heads=2, head_dim=32)],
                         ids=["qkv-bias", "tied-mqa", "top1-headdim32"])
def test_llama_cpp_shared_expert_shapes(llama_cpp, tmp_path, shape, one_thread):
    cfg = shared_config(**shape)
    ckpt = save_checkpoint(random_state(cfg, 7), cfg, tmp_path / "m.safetensors")
    run_cli("export-gguf", ckpt, "--out", tmp_path / "m.gguf")
    prompt = [3, 100, 17, 255, 1, 64, 128, 9, 33, 200]
    diff = check_against_runtime(llama(llama_cpp, tmp_path / "m.gguf"), load_model(ckpt), prompt, F32_TOL)
    print(f"\nshared expert {shape}: max|dlogit| f32 {diff:.2e}")


@pytest.mark.slow
@pytest.mark.parametrize("shape", [
    dict(qkv_bias=True),  # Qwen2: llama.cpp's qwen2 architecture
    dict(qkv_bias=True, o_bias=True, ffn_bias=True, rope_interleaved=True, tie_embeddings=True, head_dim=24),
    dict(tie_embeddings=True, n_kv_heads=1, head_dim=8),
], ids=["qwen2", "llama-biases-pairs-tied-headdim", "mqa-tied"])
def test_llama_cpp_dense_shapes(llama_cpp, tmp_path, shape, one_thread):
    cfg = llama_config(**shape)
    state = random_state(cfg, 7)
    ckpt = save_checkpoint(state, cfg, tmp_path / "m.safetensors")
    run_cli("export-gguf", ckpt, "--out", tmp_path / "m.gguf")
    prompt = [3, 100, 17, 255, 1, 64, 128, 9, 33, 200]
    diff = check_against_runtime(llama(llama_cpp, tmp_path / "m.gguf"), load_model(ckpt), prompt, F32_TOL)
    print(f"\ndense {shape} ({fields(tmp_path / 'm.gguf')['general.architecture']}): max|dlogit| f32 {diff:.2e}")


def random_prompt(cfg: ModelConfig, n: int, seed: int = 11) -> list[int]:
    return torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_llama_cpp_families(llama_cpp, tmp_path, family, one_thread):
    """Each family in llama.cpp's architecture for it: logits and greedy tokens equal the runtime's, on a prompt past
    RoPE's original length (32; phi3's 256). phi3's longrope in both of llama.cpp's regimes: it takes the long factors
    when its context (a multiple of 256) exceeds the original length, whatever the sequence, and the runtime (as
    transformers) when the sequence does: equal within a context of 256, and past it on a prompt longer than 256;
    a short prompt in the long context differs, and equals the runtime with the long factors in place of the short."""
    cfg = family_config(family)
    ckpt = save_checkpoint(family_state(cfg, 7), cfg, tmp_path / "m.safetensors")
    run_cli("export-gguf", ckpt, "--out", tmp_path / "m.gguf")
    model = load_model(ckpt)
    if family != "phi3":
        tol = GEGLU_TOL if cfg.activation == "geglu_tanh" else F32_TOL  # llama.cpp's f16 GELU table (GEGLU_TOL)
        n = 80 if cfg.linear_layers else 60  # Qwen3.5: past the delta rule's chunk of 64 tokens
        diff = check_against_runtime(llama(llama_cpp, tmp_path / "m.gguf"), model, random_prompt(cfg, n), tol)
        print(f"\n{family} ({FAMILIES[family][1]}): max|dlogit| f32 {diff:.2e} over {n} positions")
        return
    short_ctx = llama(llama_cpp, tmp_path / "m.gguf", n_ctx=256)
    diff_short = check_against_runtime(short_ctx, model, random_prompt(cfg, 40), F32_TOL)
    long_ctx = llama(llama_cpp, tmp_path / "m.gguf", n_ctx=512)
    diff_long = check_against_runtime(long_ctx, model, random_prompt(cfg, 300), F32_TOL)
    prompt = random_prompt(cfg, 40)
    off = float(np.abs(llama_logits(long_ctx, prompt) - runtime_logits(model, prompt)).max())
    assert off > 100 * F32_TOL, off
    as_long = Model(cfg.replace(scaled_rope=dict(LONGROPE, short_factor=LONGROPE["long_factor"])))
    as_long.load_state_dict(model.state_dict())
    diff_as_long = float(np.abs(llama_logits(long_ctx, prompt) - runtime_logits(as_long.eval(), prompt)).max())
    assert diff_as_long <= F32_TOL, diff_as_long
    print(f"\nphi3 longrope: max|dlogit| f32 {diff_short:.2e} (context 256, 40 tokens: short factors), {diff_long:.2e} "
          f"(context 512, 300 tokens: long factors); 40 tokens in context 512: {off:.2e} from the runtime, "
          f"{diff_as_long:.2e} from it with the long factors")


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma2", "gemma3", "gemma4"])
def test_llama_cpp_gemma_exact_but_the_gelu_table(llama_cpp, tmp_path, family, one_thread):
    """Gemma without its FFNs' output (ffn.down zeroed, and Gemma 4's per-layer inputs' output projection, so
    llama.cpp's f16 GELU table adds nothing): everything else (sliding windows and their pattern, the sliding layers'
    RoPE base beside gemma3's scaled global RoPE, soft-caps, (1 + w) sandwich norms, scaled embeddings, the attention
    scale, QK-norm; Gemma 4's global layers of their own geometry with K = V and proportional RoPE, the layers reading
    earlier layers' K/V, the value norm, the block scale) within F32_TOL of the runtime on 60 tokens, 12 times the
    window, prefilled at once and decoded a token at a time from the cache; the windows matter there (the runtime
    without them is far off)."""
    cfg = family_config(family)
    state = {k: torch.zeros_like(v) if ".ffn.down." in k or ".ple.out." in k else v
             for k, v in family_state(cfg, 7).items()}
    ckpt = save_checkpoint(state, cfg, tmp_path / "m.safetensors")
    run_cli("export-gguf", ckpt, "--out", tmp_path / "m.gguf")
    model, prompt = load_model(ckpt), random_prompt(cfg, 60)
    llm = llama(llama_cpp, tmp_path / "m.gguf")
    want = runtime_logits(model, prompt)
    diff = check_against_runtime(llm, model, prompt, F32_TOL)
    llm.reset()
    llm.eval(prompt[:20])
    for token in prompt[20:]:
        llm.eval([token])
    decoded = float(np.abs(np.array(llm.scores[:60], dtype=np.float64) - want).max())
    assert decoded <= F32_TOL, decoded
    unwindowed = Model(cfg.replace(attn_window=10**6) if cfg.global_head_dim else  # Gemma 4: its window layers stay
                       cfg.replace(attn_window=None, attn_window_layers=None, window_rope_theta=None))
    unwindowed.load_state_dict(model.state_dict())
    off = float(np.abs(llama_logits(llm, prompt) - runtime_logits(unwindowed.eval(), prompt)).max())
    assert off > 100 * F32_TOL, off
    print(f"\n{family} without FFN output: max|dlogit| f32 {diff:.2e} prefilled, {decoded:.2e} decoded; the runtime "
          f"without windows {off:.2e} off")


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3", "llama3"])
def test_llama_cpp_btx_of_a_family(llama_cpp, tmp_path, family, one_thread):
    """merge --recipe btx --format gguf of Qwen3 specialists: llama.cpp's qwen3moe (per-head QK-norm kept per layer);
    of Llama 3 specialists: a Mixtral-shaped llama with rope_freqs. Logits and greedy tokens equal the runtime's."""
    cfg = family_config(family)
    paths = seed_and_experts(tmp_path, cfg)
    btx = ("--recipe", "btx", "--gate-norm", "topk_softmax", "--ffn-top-k", "2", "--router-std", "0.5")
    merge_family(paths, tmp_path / "btx.gguf", *btx, "--format", "gguf")
    merge_family(paths, tmp_path / "btx.safetensors", *btx)
    assert fields(tmp_path / "btx.gguf")["general.architecture"] == ("qwen3moe" if family == "qwen3" else "llama")
    model = load_model(tmp_path / "btx.safetensors")
    diff = check_against_runtime(llama(llama_cpp, tmp_path / "btx.gguf"), model, random_prompt(cfg, 60), F32_TOL)
    print(f"\nbtx of {family}: max|dlogit| f32 {diff:.2e} over 60 positions")


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3", "llama3"])
def test_llama_cpp_fine_grained_upcycle_is_the_dense_seed(llama_cpp, tmp_path, family, one_thread):
    """merge --recipe upcycle --ffn-granularity 4 --format gguf: llama.cpp runs 16 experts of a quarter of the FFN
    width, 8 per token (qwen3moe reads expert_feed_forward_length, the Mixtral-shaped llama its feed_forward_length),
    and the fresh mixture's logits and greedy tokens are the dense seed's."""
    cfg = family_config(family)
    seed = save_checkpoint(random_state(cfg, 4), cfg, tmp_path / "seed.safetensors")
    up = ("--recipe", "upcycle", "--ffn-granularity", "4", "--router-std", "0.5")
    merge_family([seed], tmp_path / "fine.gguf", *up, "--format", "gguf")
    keys = fields(tmp_path / "fine.gguf")
    arch = keys["general.architecture"]
    width = keys.get(f"{arch}.expert_feed_forward_length", keys[f"{arch}.feed_forward_length"])
    assert (width, keys[f"{arch}.expert_count"], keys[f"{arch}.expert_used_count"]) == (cfg.ffn_hidden // 4, 16, 8)
    diff = check_against_runtime(llama(llama_cpp, tmp_path / "fine.gguf"), load_model(seed), random_prompt(cfg, 40),
                                 F32_TOL)
    print(f"\nfine-grained upcycle of {family} ({arch}): max|dlogit| against the dense seed {diff:.2e}")


@pytest.mark.slow
@pytest.mark.parametrize("pre, regex, ignore_merges", [
    ("llama-bpe", gt.LLAMA3_REGEX, True), ("qwen2", gt.QWEN2_REGEX, False)])
def test_llama_cpp_split_pre_tokenizers_encode_like_tokenizers(llama_cpp, tmp_path, pre, regex, ignore_merges):
    tokenizers = pytest.importorskip("tokenizers")
    p = tokenizers.pre_tokenizers
    path = save_bpe(tmp_path / "tok", 300, p.Sequence([p.Split(tokenizers.Regex(regex), behavior="isolated"),
                                                       p.ByteLevel(add_prefix_space=False, use_regex=False)]),
                    ignore_merges=ignore_merges)
    cfg = llama_config(vocab_size=300)
    out = write(cfg, random_state(cfg), tmp_path / "t.gguf", tokenizer_files=(path,))
    assert fields(out)["tokenizer.ggml.pre"] == pre
    tok = tokenizers.Tokenizer.from_file(str(path))
    llm = llama(llama_cpp, out, vocab_only=True)
    for text in TRICKY + [HELD_OUT, "x\n\n\ny  \n z 1234567 '''"]:
        assert llm.tokenize(text.encode(), add_bos=False, special=True) == tok.encode(text).ids, text
