"""The static KV cache and runtime.generate: cached decoding equals full recomputation token by token in every
attention mode, the cache holds what each mode needs, greedy and seeded sampling, left-padded batches, eos,
and a decode step that torch.compile captures whole."""
from __future__ import annotations

import pytest
import torch

from conftest import build_model, max_diff, random_state, tiny_config, tokens_for
from test_fused import close_logits
from bam_surgery.runtime import ModelKVCache, generate
from bam_surgery.runtime.generation import decode_step, sample_next

MODES = {
    "dense_gqa": dict(n_kv_heads=2),
    "btx": dict(ffn_experts=4, ffn_top_k=2, gate_norm="topk_softmax", block="sequential"),
    "bam_expert_kv": dict(attn_experts=3, ffn_experts=3, n_kv_heads=2, block="parallel"),
    "bam_shared_kv": dict(attn_experts=3, kv_mode="shared", ffn_experts=3, n_kv_heads=1, rope_interleaved=True,
                          rotary_fraction=0.5, qkv_bias=True, o_bias=True),
    "topk_attention": dict(attn_experts=3, attn_top_k=1, gate_norm="topk_softmax", block="parallel_two_norms",
                           ffn_experts=4, ffn_top_k=2, norm="layernorm"),
    "learned_positions": dict(position="learned", attn_experts=2, ffn_experts=2, activation="gelu"),
}


def model_for(mode: str, seed: int = 0):
    cfg = tiny_config(**MODES[mode], max_positions=32)
    return build_model(cfg, random_state(cfg, seed))


def greedy_by_recomputation(model, prompt: torch.Tensor, n: int) -> torch.Tensor:
    seq = prompt
    with torch.no_grad():
        for _ in range(n):
            seq = torch.cat([seq, model(seq).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return seq[:, prompt.shape[1]:]


@pytest.mark.parametrize("impl", ["fused", "reference"])
@pytest.mark.parametrize("mode", list(MODES))
def test_cached_decoding_equals_full_recomputation(mode, impl):
    model = model_for(mode, 3)
    model.impl = impl
    seq = tokens_for(model.config, 3, batch=2, length=12)
    cache = model.new_cache(2, 14)
    with torch.no_grad():
        full = model(seq).logits
        prefill = model(seq[:, :5], input_pos=torch.arange(5), cache=cache).logits
        assert close_logits(prefill, full[:, :5])
        for t in range(5, 12):
            step = model(seq[:, t:t + 1], input_pos=torch.tensor([t]), cache=cache).logits
            assert close_logits(step[:, 0], full[:, t]), (t, max_diff(step[:, 0], full[:, t]))


def test_cache_holds_what_each_mode_needs():
    """Expert KV caches E*G heads per layer, shared KV and dense attention G: bytes per token
    2 * L * heads * Dh * itemsize."""
    L, G, Dh, E = 2, 2, 8, 3
    expected = {"dense": G, "btx": G, "expert": E * G, "shared": G, "topk_expert": E * G}
    configs = {"dense": {}, "btx": dict(ffn_experts=3), "expert": dict(attn_experts=E),
               "shared": dict(attn_experts=E, kv_mode="shared"), "topk_expert": dict(attn_experts=E, attn_top_k=1)}
    for name, mix in configs.items():
        cfg = tiny_config(n_kv_heads=G, **mix)
        cache = build_model(cfg, random_state(cfg)).new_cache(batch=2, max_len=10)
        assert len(cache.layers) == L
        assert tuple(cache.layers[0].k.shape) == tuple(cache.layers[0].v.shape) == (2, expected[name], 10, Dh)
        assert ModelKVCache.bytes_per_token(cfg, torch.float32) == 2 * L * expected[name] * Dh * 4
        assert ModelKVCache.bytes_per_token(cfg, torch.bfloat16) == 2 * L * expected[name] * Dh * 2
        stored = sum(b.numel() * b.element_size() for b in cache.buffers())
        assert stored == ModelKVCache.bytes_per_token(cfg, torch.float32) * 2 * 10
        assert not cache.state_dict()  # nothing of the cache leaks into checkpoints


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_generate_equals_recomputation(mode):
    model = model_for(mode, 4)
    prompt = tokens_for(model.config, 4, batch=2, length=6)
    assert torch.equal(generate(model, prompt, 9), greedy_by_recomputation(model, prompt, 9))


@pytest.mark.parametrize("mode", ["bam_expert_kv", "bam_shared_kv", "learned_positions", "btx"])
def test_left_padded_batch_equals_rows_alone(mode):
    model = model_for(mode, 5)
    rows = [tokens_for(model.config, 5 + n, batch=1, length=n)[0] for n in (7, 3, 5)]
    ids = torch.zeros(3, 7, dtype=torch.long)
    mask = torch.zeros(3, 7, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, 7 - len(row):], mask[i, 7 - len(row):] = row, 1
    batched = generate(model, ids, 8, attention_mask=mask)
    for i, row in enumerate(rows):
        assert torch.equal(batched[i], generate(model, row[None], 8)[0]), i


def test_sampling_is_deterministic_for_a_seed():
    model = model_for("bam_expert_kv", 6)
    prompt = tokens_for(model.config, 6, batch=2, length=4)
    a = generate(model, prompt, 12, temperature=1.0, seed=7)
    assert torch.equal(a, generate(model, prompt, 12, temperature=1.0, seed=7))
    assert not torch.equal(a, generate(model, prompt, 12, temperature=1.0, seed=8))
    # a nucleus smaller than the top token's probability is greedy decoding
    assert torch.equal(generate(model, prompt, 12, temperature=0.7, top_p=1e-6, seed=1), generate(model, prompt, 12))


def test_sampler_draws_from_the_nucleus_distribution():
    """Evenly spaced uniforms hit each token in proportion to its renormalized nucleus probability."""
    probs = torch.tensor([0.2, 0.5, 0.3])
    logits = probs.log().expand(1000, 3)
    uniform = (torch.arange(1000) + 0.5) / 1000
    counts = torch.bincount(sample_next(logits, 1.0, 1.0, uniform), minlength=3)
    assert counts.tolist() == [200, 500, 300]
    counts = torch.bincount(sample_next(logits, 1.0, 0.6, uniform), minlength=3)  # nucleus {1, 2}: 5/8, 3/8
    assert counts.tolist() == [0, 625, 375]
    counts = torch.bincount(sample_next(logits * 2, 2.0, 1.0, uniform), minlength=3)  # temperature divides
    assert counts.tolist() == [200, 500, 300]


def test_eos_stops_a_row_and_pads_it():
    model = model_for("btx", 9)
    prompt = tokens_for(model.config, 9, batch=2, length=4)
    free = generate(model, prompt, 10)
    eos = int(free[0, 2])
    stops = [(row == eos).nonzero()[0].item() if (row == eos).any() else None for row in free]
    out = generate(model, prompt, 10, eos_token_id=eos, pad_token_id=63)
    for row, stop in enumerate(stops):
        if stop is None:
            assert torch.equal(out[row], free[row, :out.shape[1]])
        else:
            assert torch.equal(out[row, :stop + 1], free[row, :stop + 1])
            assert (out[row, stop + 1:] == 63).all()
    if all(s is not None for s in stops):
        assert out.shape[1] == max(stops) + 1  # ends once every row has emitted eos
    assert generate(model, prompt, 0).shape == (2, 0)


@pytest.mark.slow
def test_decode_step_compiles_whole():
    """The decode step is one graph (fullgraph=True): static cache, mask and slot tensors, no host sync.
    aot_eager checks the capture without inductor's slow C++ build (generate(compile=True) uses inductor,
    with CUDA graphs on a GPU)."""
    model = model_for("bam_shared_kv", 10)
    prompt = tokens_for(model.config, 10, batch=2, length=5)
    want = generate(model, prompt, 4)
    step = torch.compile(decode_step, backend="aot_eager", fullgraph=True)
    cache = model.new_cache(2, 9)
    mask = torch.ones(2, 9, dtype=torch.long)
    got = []
    with torch.no_grad():
        token = model(prompt, attention_mask=mask, input_pos=torch.arange(5), cache=cache).logits[:, -1].argmax(-1)
        for i in range(4):
            got.append(token)
            token = step(model, cache, token[:, None], torch.tensor([5 + i]), mask, 0.0, 1.0, None)
    assert torch.equal(torch.stack(got, 1), want)


def test_generate_under_autocast_uses_a_bf16_cache():
    model = model_for("bam_expert_kv", 11)
    prompt = tokens_for(model.config, 11, batch=1, length=4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = generate(model, prompt, 5)
        assert model.new_cache(1, 4).layers[0].k.dtype == torch.float32  # new_cache itself: the weights' dtype
    assert out.shape == (1, 5)


def test_generate_refuses_bad_input():
    model = model_for("dense_gqa")
    prompt = tokens_for(model.config, batch=2, length=4)
    with pytest.raises(ValueError, match="padded on the left"):
        generate(model, prompt, 3, attention_mask=torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]]))
    with pytest.raises(ValueError, match="attention_mask has shape"):
        generate(model, prompt, 3, attention_mask=torch.ones(2, 3))
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, prompt, -1)
    with pytest.raises(ValueError, match="top_p"):
        generate(model, prompt, 3, temperature=1.0, top_p=0.0)
    with pytest.raises(ValueError, match="integer tensor"):
        generate(model, prompt.float(), 3)
    learned = model_for("learned_positions")
    with pytest.raises(ValueError, match="max_positions"):
        generate(learned, prompt, 40)
