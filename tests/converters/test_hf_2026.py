"""Qwen3.5 (Gated DeltaNet layers, gated attention) and Gemma 4 (global layers of their own geometry, K = V, layers
reading earlier layers' K/V, per-layer inputs, proportional RoPE) against transformers' own classes, past what
test_hf_import.py and test_hf_families.py cover for every family (FAMILY_CASES "qwen3.5" and "gemma4": logits, the
export's bytes, long positions, greedy generation):

  * logits of sequences past the delta rule's chunk (64 tokens) and Gemma's window (5), fused and reference paths
    (the reference runs the delta rule token by token: the oracle of the chunked one);
  * the cache: a chunked prefill, a multi-token continuation from a cached state, then step-by-step decoding,
    against transformers' own cache (its conv and recurrent states, its shared K/V);
  * a left-padded batch gives each row its unpadded logits (padding leaves the recurrent state as it was);
  * greedy generation past the chunk equals transformers' generate;
  * what is refused, in one line: Gemma 4's MoE block, its bidirectional attention.

fp32 logits within 1e-4, as everywhere.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")

from conftest import FAMILY_CASES, random_hf_model  # noqa: E402
from bam_surgery.converters import open_checkpoint  # noqa: E402
from bam_surgery.converters.base import CapabilityError  # noqa: E402
from bam_surgery.runtime.generation import generate  # noqa: E402
from bam_surgery.runtime.model import Model  # noqa: E402

TOL = 1e-4
CASES = ("qwen3.5", "gemma4")
LENGTH = 150  # two chunks of the delta rule and a part of a third; 30 of Gemma's windows


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    out = {}
    for case in CASES:
        d = tmp_path_factory.mktemp(case)
        hf = random_hf_model(*FAMILY_CASES[case])
        hf.save_pretrained(d)
        with open_checkpoint(str(d)) as reader:
            ours = Model(reader.config)
            ours.load_state_dict({n: reader.get(n) for n in reader.names()})
        out[case] = (hf, ours.eval(), d)
    return out


def _tokens(batch: int = 2, length: int = LENGTH, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, 100, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("impl", ["fused", "reference"])
@pytest.mark.parametrize("case", CASES)
def test_logits_past_the_chunk_and_the_window(saved, case, impl):
    hf, ours, _ = saved[case]
    x = _tokens()
    ours.impl = impl
    try:
        with torch.no_grad():
            got, ref = ours(x).logits, hf(x).logits
    finally:
        ours.impl = "fused"
    assert (got - ref).abs().max().item() <= TOL


@pytest.mark.parametrize("case", CASES)
def test_cache_prefill_continuation_and_decoding(saved, case):
    """70 tokens prefilled (a chunk and a part), 10 more at once from the cached state (transformers' chunked rule
    from its initial state), then one token at a time (its recurrent rule), logits of every call compared."""
    hf, ours, _ = saved[case]
    x = _tokens(batch=2, length=90)
    cache = ours.new_cache(2, 90)
    hf_cache = transformers.DynamicCache(config=hf.config)
    with torch.no_grad():
        for a, b in [(0, 70), (70, 80)] + [(t, t + 1) for t in range(80, 90)]:
            ref = hf(x[:, a:b], past_key_values=hf_cache, use_cache=True).logits
            got = ours(x[:, a:b], input_pos=torch.arange(a, b), cache=cache).logits
            assert (got - ref).abs().max().item() <= TOL, (a, b)


@pytest.mark.parametrize("case", CASES)
def test_a_cache_filled_again_from_slot_0_starts_afresh(saved, case):
    """A pass from slot 0 restarts the Gated DeltaNet states: the same prompt twice into one cache, same logits."""
    _, ours, _ = saved[case]
    x = _tokens(batch=1, length=20)
    cache = ours.new_cache(1, 20)
    with torch.no_grad():
        first = ours(x, input_pos=torch.arange(20), cache=cache).logits
        again = ours(x, input_pos=torch.arange(20), cache=cache).logits
    assert torch.equal(first, again)


@pytest.mark.parametrize("case", CASES)
def test_left_padded_batch_gives_each_row_its_own_logits(saved, case):
    _, ours, _ = saved[case]
    long, short = _tokens(batch=1, length=80, seed=5), _tokens(batch=1, length=71, seed=6)
    batch = torch.cat((long, torch.cat((torch.zeros(1, 9, dtype=torch.long), short), dim=1)))
    mask = torch.ones(2, 80, dtype=torch.long)
    mask[1, :9] = 0
    with torch.no_grad():
        both = ours(batch, attention_mask=mask).logits
        alone = ours(short).logits
        first = ours(long).logits
    assert (both[0] - first[0]).abs().max().item() <= TOL
    assert (both[1, 9:] - alone[0]).abs().max().item() <= TOL


@pytest.mark.parametrize("case", CASES)
def test_greedy_generation_past_the_chunk_equals_transformers(saved, case):
    hf, ours, _ = saved[case]
    prompt = torch.randint(3, 100, (1, 66), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = hf.generate(prompt, max_new_tokens=14, do_sample=False, eos_token_id=None, pad_token_id=0)[:, 66:]
    assert torch.equal(generate(ours, prompt, 14), want)


def _config_with(folder, tmp_path, **changes):
    out = tmp_path / "changed"
    out.mkdir()
    body = json.loads((folder / "config.json").read_text())
    body.update(changes)
    (out / "config.json").write_text(json.dumps(body))
    shutil.copy(folder / "model.safetensors", out / "model.safetensors")
    return out


@pytest.mark.parametrize("changes, words", [
    (dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=16), "MoE block"),
    (dict(use_bidirectional_attention="all"), "bidirectional attention"),
])
def test_gemma4_refuses_what_it_does_not_model_in_one_line(saved, tmp_path, changes, words):
    folder = _config_with(saved["gemma4"][2], tmp_path, **changes)
    with pytest.raises(CapabilityError, match=words) as e:
        open_checkpoint(str(folder))
    assert "\n" not in str(e.value)


def test_gemma4_reads_the_hub_configs_global_keys(saved, tmp_path):
    """The hub's config.json names the global layers' geometry global_head_dim / num_global_key_value_heads
    (transformers 5 saves per_layer_config instead): the same model either way."""
    folder = saved["gemma4"][2]
    changed = _config_with(folder, tmp_path, global_head_dim=32, num_global_key_value_heads=1)
    body = json.loads((changed / "config.json").read_text())
    del body["per_layer_config"]
    (changed / "config.json").write_text(json.dumps(body))
    with open_checkpoint(str(folder)) as a, open_checkpoint(str(changed)) as b:
        assert a.config == b.config
        assert (a.config.global_head_dim, a.config.global_kv_heads, a.config.global_k_eq_v) == (32, 1, True)


# ---- the native MoE formats -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen_specialists(tmp_path_factory):
    from conftest import hf_specialists

    return hf_specialists(tmp_path_factory.mktemp("qwen3.5-native"), "qwen3.5",
                          keep=lambda n: ".attn." in n or ".linear." in n)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["btx", "btx-shared-expert"])
def test_qwen3_5_moe_computes_the_mixture(qwen_specialists, tmp_path, recipe):
    """A BTX of Qwen3.5 (and with the seed as the shared expert) as Qwen3_5MoeForCausalLM: transformers' logits
    equal the runtime's on the canonical merge, in one pass and through its cache; read back, the same mixture (a
    BTX without a shared expert gains an all-zero one)."""
    from conftest import load_hf_native, merge_family
    from bam_surgery.converters.native_moe import ZERO_SHARED_HIDDEN
    from bam_surgery.runtime import load_model

    args = ("--recipe", recipe, "--ffn-top-k", "2", "--gate-norm", "topk_softmax")
    merge_family(qwen_specialists, tmp_path / "mix.safetensors", *args)
    merge_family(qwen_specialists, tmp_path / "native", *args, "--format", "qwen3_5_moe")
    body = json.loads((tmp_path / "native" / "config.json").read_text())
    assert body["model_type"] == "qwen3_5_moe_text" and body["architectures"] == ["Qwen3_5MoeForCausalLM"]
    hf, ours = load_hf_native("Qwen3_5MoeForCausalLM", tmp_path / "native"), load_model(tmp_path / "mix.safetensors")
    x = _tokens(length=80)
    cache, hf_cache = ours.new_cache(2, 80), transformers.DynamicCache(config=hf.config)
    with torch.no_grad():
        assert (hf(x).logits - ours(x).logits).abs().max().item() <= TOL
        for a, b in [(0, 70)] + [(t, t + 1) for t in range(70, 80)]:
            ref = hf(x[:, a:b], past_key_values=hf_cache, use_cache=True).logits
            got = ours(x[:, a:b], input_pos=torch.arange(a, b), cache=cache).logits
            assert (got - ref).abs().max().item() <= TOL, (a, b)
    with open_checkpoint(str(tmp_path / "native")) as back, open_checkpoint(str(tmp_path / "mix.safetensors")) as mix:
        shared = mix.config.ffn_shared_hidden or ZERO_SHARED_HIDDEN
        assert back.config.replace(name="") == mix.config.replace(ffn_shared_hidden=shared, name="", z_coef=0.0)
        for n in mix.names():
            assert torch.equal(back.get(n), mix.get(n)), n


@pytest.mark.parametrize("args, words", [
    (("--recipe", "bam"), ["qwen3_5_moe export needs", "dense attention", "one Gated DeltaNet per linear layer"]),
    (("--recipe", "btx-shared-expert"), ["top-k gates renormalized", "gate_norm softmax"]),
])
def test_qwen3_5_moe_refuses_what_it_cannot_carry(qwen_specialists, tmp_path, args, words):
    from conftest import error_line, merge_family

    result = merge_family(qwen_specialists, tmp_path / "native", *args, "--format", "qwen3_5_moe", code=None)
    error_line(result, *words)
    assert not (tmp_path / "native").exists()


def test_gemma4_moe_format_is_refused_in_one_line():
    from bam_surgery.converters.export import exporter

    with pytest.raises(CapabilityError, match="Gemma 4's MoE block runs a dense MLP beside") as e:
        exporter("gemma4_moe")
    assert "\n" not in str(e.value)
