"""The native mixture formats over the families of 2024-25: BTX merges of tiny HF specialists (transformers' own
classes, conftest.FAMILY_CASES) written as Qwen3-MoE (Qwen3, with and without attention biases and yarn RoPE),
FlexOlmo (OLMo 2) and Mixtral (Llama 3.2's llama3 RoPE), loaded by transformers' own class:

  * logits equal the runtime's on the canonical merge (fp32, <= 1e-4), at short positions and at positions past the
    RoPE original length, and in cached decoding through that threshold; greedy generation gives the same tokens;
  * the folder holds exactly what save_pretrained writes for the loaded model;
  * read back (`convert FOLDER --out X.safetensors`), every tensor and the config are the canonical merge's;
  * what a format cannot carry is refused in one line (exit 2) naming everything it lacks, nothing written.
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from conftest import cli_error_line, hf_specialists, load_hf_native, max_diff, merge_family, run_cli, tiny_config
from bam_surgery.converters.base import CapabilityError
from bam_surgery.converters.export import exporter
from bam_surgery.converters.hf.architectures import architecture
from bam_surgery.runtime import load_model
from bam_surgery.runtime.checkpoint import CheckpointReader
from bam_surgery.runtime.generation import generate

transformers = pytest.importorskip("transformers")

TOL = 1e-4
BTX = ("--recipe", "btx", "--ffn-top-k", "2")
# case -> (format, transformers class, a start position whose window crosses the RoPE original length)
CASES = {
    "qwen3": ("qwen3_moe", "Qwen3MoeForCausalLM", 40950),
    "qwen3-yarn": ("qwen3_moe", "Qwen3MoeForCausalLM", 32760),
    "olmo2": ("flex_olmo", "FlexOlmoForCausalLM", 4000),
    "llama3.2": ("mixtral", "MixtralForCausalLM", 8180),
}
LENGTH = 16


@pytest.fixture(scope="module")
def specialists(tmp_path_factory):
    """case -> [seed, specialist, specialist] HF folders (smollm3 too, for a refusal)."""
    return {case: hf_specialists(tmp_path_factory.mktemp(case), case) for case in (*CASES, "smollm3")}


@pytest.fixture(scope="module")
def merged(specialists, tmp_path_factory):
    """(case, gate_norm) -> (canonical merge, native folder), merged once."""
    cache = {}

    def get(case: str, gate_norm: str = "topk_softmax"):
        if (case, gate_norm) not in cache:
            root = tmp_path_factory.mktemp(f"{case}-{gate_norm}")
            fmt = CASES[case][0]
            merge_family(specialists[case], root / "mix.safetensors", *BTX, "--gate-norm", gate_norm)
            merge_family(specialists[case], root / fmt, *BTX, "--gate-norm", gate_norm, "--format", fmt)
            cache[case, gate_norm] = root / "mix.safetensors", root / fmt
        return cache[case, gate_norm]
    return get


def _inputs(vocab: int, start: int, batch: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, vocab, (batch, LENGTH), generator=torch.Generator().manual_seed(3))
    return tokens, torch.arange(start, start + LENGTH)[None].expand(batch, LENGTH)


@pytest.mark.slow
@pytest.mark.parametrize("case, gate_norm", [(c, "topk_softmax") for c in CASES] + [("qwen3", "softmax")])
def test_logits_equal_the_runtime(merged, case, gate_norm):
    mix, folder = merged(case, gate_norm)
    fmt, cls, start = CASES[case]
    body = json.loads((folder / "config.json").read_text())
    assert body["model_type"] == fmt and body["architectures"] == [cls]
    hf, ours = load_hf_native(cls, folder), load_model(mix).eval()
    if fmt != "mixtral":
        assert body["norm_topk_prob"] == (gate_norm == "topk_softmax")
    for first in (0, start):
        tokens, positions = _inputs(ours.config.vocab_size, first)
        with torch.no_grad():
            out = ours(tokens, positions=positions)
            assert max_diff(out.logits, hf(tokens, position_ids=positions).logits) <= TOL, first
        # the routers really choose: every expert is in some token's top 2
        assert next(iter(out.routing.values())).topk.unique().numel() == ours.config.ffn_experts


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_cached_decoding_and_greedy_generation(merged, case):
    """Prefill 10 tokens, then one at a time through the RoPE threshold against transformers' DynamicCache; then
    greedy generation from position 0 in both (transformers' generate with its cache) gives the same tokens."""
    mix, folder = merged(case)
    _, cls, start = CASES[case]
    hf, ours = load_hf_native(cls, folder), load_model(mix).eval()
    tokens, positions = _inputs(ours.config.vocab_size, start, batch=1)
    cache, hf_cache = ours.new_cache(1, LENGTH), transformers.DynamicCache(config=hf.config)
    with torch.no_grad():
        for a, b in [(0, 10)] + [(t, t + 1) for t in range(10, LENGTH)]:
            ref = hf(tokens[:, a:b], position_ids=positions[:, a:b], past_key_values=hf_cache, use_cache=True).logits
            got = ours(tokens[:, a:b], positions=positions[:, a:b], input_pos=torch.arange(a, b), cache=cache).logits
            assert max_diff(got, ref) <= TOL, (a, b)
        prompt = tokens[:, :6]
        want = hf.generate(prompt, max_new_tokens=8, do_sample=False, use_cache=True, pad_token_id=0)[:, 6:]
    assert torch.equal(generate(ours, prompt, 8), want)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["qwen3-yarn", "olmo2"])
def test_folder_is_what_save_pretrained_writes_and_reads_back_exactly(merged, case, tmp_path):
    mix, folder = merged(case)
    fmt, cls, _ = CASES[case]
    load_hf_native(cls, folder).save_pretrained(tmp_path / "resaved")
    resaved = {}
    for shard in (tmp_path / "resaved").glob("*.safetensors"):
        with safe_open(str(shard), "pt") as f:
            resaved.update({k: f.get_tensor(k) for k in f.keys()})
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(resaved)
    assert any(".mlp.experts.2.down_proj.weight" in k for k in resaved)
    for key, file in index["weight_map"].items():
        with safe_open(str(folder / file), "pt") as f:
            assert torch.equal(f.get_tensor(key), resaved[key]), key

    run_cli("convert", folder, "--out", tmp_path / "back.safetensors")
    source, back = CheckpointReader(mix), CheckpointReader(tmp_path / "back.safetensors")
    assert back.names() == source.names()
    for name in source.names():
        assert torch.equal(back.get(name), source.get(name)), name
    assert back.config == source.config.replace(z_coef=0.0, name=back.config.name)  # no z-loss field there
    assert architecture(fmt).config.read(json.loads((folder / "config.json").read_text()))[0] == back.config


@pytest.mark.slow
def test_refusals_are_one_line(specialists, tmp_path):
    out = tmp_path / "o"

    def refused(case, fmt, *args):
        return cli_error_line("merge", "--seed", specialists[case][0], "--experts",
                              ",".join(map(str, specialists[case][1:])), "--out", out, "--format", fmt, *args)

    line = refused("llama3.2", "qwen3_moe", *BTX)
    assert ("qwen3_moe export needs a per-head QK-norm; recipe btx has no QK-norm; the mixtral, qwen2_moe, hf, onnx "
            "or gguf formats carry it") in line
    line = refused("qwen3", "flex_olmo", *BTX)
    assert ("flex_olmo export needs a full-width QK-norm and norms after attention and FFN; recipe btx has a per-head "
            "QK-norm and norms before attention and FFN; the qwen3_moe, hf, onnx or gguf formats carry it") in line
    line = refused("qwen3", "qwen3_moe", "--recipe", "bam", "--router", "mlp")
    assert "dense attention and linear routers" in line and "attention experts, router mlp" in line
    assert refused("qwen3", "qwen3_moe", "--recipe", "btx-shared-expert").endswith(
        "needs no shared expert; recipe btx-shared-expert has a shared FFN expert; the hf or onnx formats carry it")
    line = refused("qwen3", "mixtral", *BTX, "--gate-norm", "topk_softmax")
    assert ("mixtral export needs no QK-norm; recipe btx has a per-head QK-norm; the qwen3_moe, hf, onnx or gguf "
            "formats carry it") in line
    line = refused("olmo2", "mixtral", *BTX, "--gate-norm", "topk_softmax")
    assert ("needs no QK-norm and norms before attention and FFN; recipe btx has a full-width QK-norm and norms after "
            "attention and FFN; the flex_olmo, hf or onnx formats carry it") in line
    line = refused("smollm3", "qwen2_moe", "--recipe", "btx-shared-expert")
    assert "RoPE in every layer" in line and "no RoPE in layers [3]" in line
    line = refused("qwen3", "phimoe", *BTX)
    assert line.startswith("bam-surgery: error: --format phimoe is not offered: PhiMoE normalizes with LayerNorm")
    assert not out.exists()


@pytest.mark.parametrize("fmt, overrides, words", [
    ("qwen3_moe", dict(qk_norm="head", qkv_bias=True), ["q/k/v and o biases together", "q/k/v biases without an o"]),
    ("qwen3_moe", dict(qk_norm="head", ffn_bias=True), ["no biases but on attention", "ffn biases"]),
    ("qwen3_moe", dict(qk_norm="full"), ["needs a per-head QK-norm", "has a full-width QK-norm"]),
    ("flex_olmo", dict(qk_norm="full"), ["needs a full-width QK-norm and norms after attention and FFN",
                                         "has a full-width QK-norm and norms before attention and FFN"]),
    ("flex_olmo", dict(qk_norm="full", norm_position="post", rope_interleaved=True), ["half-split RoPE"]),
    ("qwen3_moe", dict(qk_norm="head", ffn_experts=0), ["FFN experts", "a dense FFN"]),
])
def test_capability_errors_from_the_config(fmt, overrides, words):
    cfg = tiny_config(**{"ffn_experts": 3, "ffn_top_k": 2, **overrides})
    with pytest.raises(CapabilityError) as err:
        exporter(fmt).check(cfg, recipe="btx")
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"{fmt} export needs")
    for w in words:
        assert w in message, message
    exporter(fmt).check(tiny_config(ffn_experts=3, ffn_top_k=2, qk_norm="head" if fmt == "qwen3_moe" else "full",
                                    norm_position="pre" if fmt == "qwen3_moe" else "post", qkv_bias=True, o_bias=True))
