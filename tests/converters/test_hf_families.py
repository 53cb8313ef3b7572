"""The families of 2024-25 (Llama 3.x with every RoPE type, Qwen3, Phi-3, OLMo 2, SmolLM3) against transformers'
own classes past the short positions test_hf_import.py covers: logits at positions past
original_max_position_embeddings (where llama3, yarn and longrope change frequencies and dynamic NTK starts
scaling), and cached decoding step by step through the same positions, against transformers' own cached forward.

Tolerance 1e-4 on fp32 logits, as everywhere: RoPE frequencies are computed op for op as transformers does, so
angles agree to the bit even at position 131,000; a wrong frequency rule moves logits by > 1e-2 there.
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from conftest import FAMILY_CASES, random_hf_model  # noqa: E402
from test_hf_import import TOL, canonical_model, save_cases  # noqa: E402
from bam_surgery.converters import open_checkpoint  # noqa: E402
from bam_surgery.runtime.model import Model  # noqa: E402

# where each case's RoPE changes: positions starting before and ending past it
START = {"llama3.2": 8180, "llama-linear": 500, "llama-dynamic": 50, "llama-yarn": 32760, "llama-longrope": 4090,
         "qwen3": 40950, "qwen3-yarn": 32760, "phi3": 4090, "phi4-mini": 4000, "olmo2": 4000, "smollm3": 65000,
         "mistral-window": 0, "qwen2-window": 0, "phi3-window": 0, "gemma2": 0, "gemma3": 100, "olmo3": 0,
         "qwen3.5": 262100, "gemma4": 130000, "granite": 8180, "ministral3": 505, "exaone4": 8180,
         "exaone4-global": 0}
LENGTH = 16


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{case: (the transformers model, ours read from its saved folder)}."""
    return {case: (model, canonical_model(open_checkpoint(str(d))))
            for case, (model, d) in save_cases(tmp_path_factory, FAMILY_CASES).items()}


def _inputs(vocab: int, start: int, batch: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, vocab, (batch, LENGTH), generator=torch.Generator().manual_seed(3))
    return tokens, torch.arange(start, start + LENGTH)[None].expand(batch, LENGTH)


def test_every_case_crosses_its_rope_threshold():
    """The start positions put the last position past the original length of every scaled case."""
    for case, (_, kwargs) in FAMILY_CASES.items():
        rope = kwargs.get("rope_parameters", {})
        original = rope.get("original_max_position_embeddings", kwargs.get("original_max_position_embeddings"))
        if rope.get("rope_type") == "dynamic":
            original = kwargs["max_position_embeddings"]
        if original:
            assert START[case] < original < START[case] + LENGTH, case


@pytest.mark.parametrize("case", list(FAMILY_CASES))
def test_logits_at_long_positions(saved, case):
    hf, ours = saved[case]
    tokens, positions = _inputs(hf.config.vocab_size, START[case])
    with torch.no_grad():
        ref = hf(tokens, position_ids=positions).logits
        got = ours(tokens, positions=positions).logits
    assert (got - ref).abs().max().item() <= TOL


@pytest.mark.parametrize("case", list(FAMILY_CASES))
def test_cached_decoding_past_the_threshold(saved, case):
    """Prefill the first 10 tokens, then decode one at a time through the threshold, in both: the runtime's static
    cache against transformers' DynamicCache (dynamic NTK and longrope re-derive frequencies per step in both)."""
    hf, ours = saved[case]
    tokens, positions = _inputs(hf.config.vocab_size, START[case], batch=1)
    cache = ours.new_cache(1, LENGTH)
    hf_cache = transformers.DynamicCache(config=hf.config)
    steps = [(0, 10)] + [(t, t + 1) for t in range(10, LENGTH)]
    with torch.no_grad():
        for a, b in steps:
            ref = hf(tokens[:, a:b], position_ids=positions[:, a:b], past_key_values=hf_cache, use_cache=True).logits
            got = ours(tokens[:, a:b], positions=positions[:, a:b], input_pos=torch.arange(a, b), cache=cache).logits
            assert (got - ref).abs().max().item() <= TOL, (a, b)


def test_scaled_rope_really_differs_from_plain_past_the_original(saved):
    """Control: the same weights with plain RoPE give other logits at long positions (the check can fail)."""
    _, scaled = saved["llama3.2"]
    plain = Model(scaled.config.replace(scaled_rope=None)).eval()
    plain.load_state_dict(scaled.state_dict())
    tokens, positions = _inputs(scaled.config.vocab_size, START["llama3.2"])
    with torch.no_grad():
        diff = (plain(tokens, positions=positions).logits - scaled(tokens, positions=positions).logits).abs().max()
    assert diff > 1e-2


# Qwen3.5 and Gemma 4: test_hf_2026.py, past the delta rule's chunk
@pytest.mark.parametrize("case", ["phi3", "llama3.2", "qwen3", "olmo2", "smollm3", "gemma2", "gemma3", "olmo3",
                                  "mistral-window", "granite", "ministral3", "exaone4"])
def test_greedy_generation_equals_transformers(tmp_path, case):
    """runtime.generate against transformers' generate, greedy, through the threshold: Phi-3's longrope with its
    original length shrunk to 32 (transformers' Phi-3 drops its cache where the frequencies switch; the runtime
    computes its cache again there), the others at their real parameters."""
    from bam_surgery.runtime.generation import generate

    cls_name, kwargs = FAMILY_CASES[case]
    if case == "phi3":
        kwargs = dict(kwargs, original_max_position_embeddings=32, max_position_embeddings=1024)
    hf = random_hf_model(cls_name, kwargs, seed=5)
    hf.save_pretrained(tmp_path)
    ours = canonical_model(open_checkpoint(str(tmp_path)))
    prompt = torch.randint(3, hf.config.vocab_size, (1, 26), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = hf.generate(prompt, max_new_tokens=14, do_sample=False, eos_token_id=None, pad_token_id=0)[:, 26:]
    got = generate(ours, prompt, 14)
    assert torch.equal(got, want), (got, want)
