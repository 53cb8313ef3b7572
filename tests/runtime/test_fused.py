"""The fused path (runtime/blocks.py, the default `model.impl`) against the reference loop (`impl="reference"`),
which test_model.py holds to the float64 reference: logits, routing trace, losses and the gradient of every
parameter, over the whole config matrix, forced routing, padding masks, every FFN expert kernel, autocast,
low-precision weights, the chunked loss-only head and torch.compile.

Tolerances. Both paths compute in fp32 but sum in different orders (one wide attention and a batched output
projection against per-expert accumulation; sorted grouped matmuls against per-expert index_add), so logits
differ by a few fp32 ulps of their magnitude: 1e-5 relative to the largest logit (logits reach ~30 in the
tied-embedding cases, where one ulp is ~4e-6). Gradients: 1e-4 absolute (observed ~1e-6). Any semantic slip
(a head read from the wrong kv head, a dropped gate or bias) moves logits by 1e-2 or more.
"""
from __future__ import annotations

import pytest
import torch

from conftest import build_model, max_diff, random_state, tiny_config, tokens_for
from test_model import DENSE_CASES, MIXTURE_CASES, MIXTURES
from bam_surgery.runtime.blocks import EXPERT_KERNELS
from bam_surgery.runtime.model import ForcedRouting

ALL_CASES = DENSE_CASES + MIXTURE_CASES
GRAD_TOL = 1e-4


def close_logits(a: torch.Tensor, b: torch.Tensor, rel: float = 1e-5) -> bool:
    return max_diff(a, b) <= rel * max(1.0, b.abs().max().item())


def run(model, impl: str, tokens, targets=None, **kwargs):
    """(output, {parameter name: gradient}) of one forward (and backward of the loss, given targets)."""
    model.impl = impl
    model.zero_grad(set_to_none=True)
    out = model(tokens, targets=targets, **kwargs)
    if targets is not None:
        out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same(model, fused, reference):
    (out_f, grads_f), (out_r, grads_r) = fused, reference
    assert close_logits(out_f.logits, out_r.logits), max_diff(out_f.logits, out_r.logits)
    assert list(out_f.routing) == list(out_r.routing)
    for name, rf in out_f.routing.items():
        rr = out_r.routing[name]
        assert max_diff(rf.gates, rr.gates) < 1e-5, name
        for part in ("logits", "probs", "topk"):
            a, b = getattr(rf, part), getattr(rr, part)
            assert (a is None) == (b is None), (name, part)
            if a is not None:
                assert torch.equal(a, b) if part == "topk" else max_diff(a, b) < 1e-5, (name, part)
    if out_r.loss is not None:
        for part in ("loss", "nll", "lb_loss", "z_loss"):
            assert abs(getattr(out_f, part).item() - getattr(out_r, part).item()) < 1e-5, part
        assert set(grads_f) == set(grads_r)
        for name, g in grads_r.items():
            assert max_diff(grads_f[name], g) < GRAD_TOL, (name, max_diff(grads_f[name], g))


@pytest.mark.parametrize("case", [c for _, c in ALL_CASES], ids=[n for n, _ in ALL_CASES])
def test_fused_equals_reference(case):
    cfg = tiny_config(**case)
    model = build_model(cfg, random_state(cfg, 41))
    tokens, targets = tokens_for(cfg, 41), tokens_for(cfg, 42)
    targets[1, 2] = -100
    fused = run(model, "fused", tokens, targets)
    assert_same(model, fused, run(model, "reference", tokens, targets))
    assert set(fused[1]) == {name for name, _ in model.named_parameters()}


FORCINGS = {
    "expert_1": ForcedRouting(expert=1),
    "gates": ForcedRouting(ffn_gates=torch.tensor([0.25, 0.0, 1.25]), attn_gates=torch.tensor([0.5, 0.3, 0.2])),
    "ffn_only": ForcedRouting(ffn_gates=torch.tensor([0.0, 1.0, 0.0])),
}


@pytest.mark.parametrize("forcing", list(FORCINGS))
@pytest.mark.parametrize("mixture", ["bam", "soft_moa_shared_kv", "topk_moa"])
def test_fused_equals_reference_with_forced_routing(mixture, forcing):
    mix = dict(MIXTURES[mixture], ffn_experts=3, ffn_top_k=2)
    cfg = tiny_config(**mix, n_kv_heads=2, qkv_bias=True, o_bias=True, ffn_bias=True)
    model = build_model(cfg, random_state(cfg, 5))
    tokens, targets = tokens_for(cfg, 5), tokens_for(cfg, 6)
    forced = FORCINGS[forcing]
    assert_same(model, run(model, "fused", tokens, targets, routing=forced),
                run(model, "reference", tokens, targets, routing=forced))


PADDED_CASES = [("dense_gqa", dict(n_kv_heads=2)), ("learned", dict(position="learned", ffn_experts=3)),
                ("bam_expert_kv", dict(attn_experts=3, ffn_experts=3, ffn_top_k=2, n_kv_heads=2)),
                ("bam_shared_kv_mqa", dict(attn_experts=3, kv_mode="shared", ffn_experts=3, n_kv_heads=1,
                                           rope_interleaved=True, rotary_fraction=0.5)),
                ("topk_moa", dict(attn_experts=3, attn_top_k=1, gate_norm="topk_softmax", block="parallel"))]


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("case", [c for _, c in PADDED_CASES], ids=[n for n, _ in PADDED_CASES])
def test_padding_mask(case, side):
    """Padded rows: fused == reference, and each row's real tokens get the logits of the row run alone."""
    cfg = tiny_config(**case)
    model = build_model(cfg, random_state(cfg, 8))
    rows = [tokens_for(cfg, 8, batch=1, length=n)[0] for n in (8, 5, 3)]
    tokens = torch.zeros(3, 8, dtype=torch.long)
    mask = torch.zeros(3, 8, dtype=torch.long)
    for i, row in enumerate(rows):
        where = slice(8 - len(row), 8) if side == "left" else slice(0, len(row))
        tokens[i, where], mask[i, where] = row, 1
    targets = torch.where(mask.bool(), tokens_for(cfg, 9, batch=3), -100)
    fused = run(model, "fused", tokens, targets, attention_mask=mask)
    assert_same(model, fused, run(model, "reference", tokens, targets, attention_mask=mask))
    with torch.no_grad():
        for i, row in enumerate(rows):
            alone = model(row[None]).logits[0]
            real = fused[0].logits[i][mask[i].bool()]
            assert close_logits(real, alone), (i, max_diff(real, alone))


@pytest.mark.parametrize("kernel", EXPERT_KERNELS)
@pytest.mark.parametrize("mixture", ["moe_ffn", "bam"])
def test_every_expert_kernel_equals_reference(mixture, kernel):
    cfg = tiny_config(**MIXTURES[mixture], ffn_bias=True, activation="gelu" if mixture == "bam" else "swiglu")
    model = build_model(cfg, random_state(cfg, 13))
    tokens, targets = tokens_for(cfg, 13, batch=3), tokens_for(cfg, 14, batch=3)
    model.expert_kernel = kernel
    fused = run(model, "fused", tokens, targets)
    assert_same(model, fused, run(model, "reference", tokens, targets))
    # and on a decoding-sized batch (one token per row), where the automatic choice may differ
    assert_same(model, run(model, "fused", tokens[:, :1], targets[:, :1]),
                run(model, "reference", tokens[:, :1], targets[:, :1]))


@pytest.mark.parametrize("name", list(MIXTURES) + ["dense"])
def test_autocast_bf16_forward_backward(name):
    """Every mixture kind trains under CPU autocast with fp32 weights, on both paths (the reference loop's
    index_add used to fail on mixed dtypes); results stay close to fp32."""
    cfg = tiny_config(**MIXTURES.get(name, {}), ffn_bias=True, qkv_bias=True, o_bias=True)
    model = build_model(cfg, random_state(cfg, 17))
    tokens, targets = tokens_for(cfg, 17), tokens_for(cfg, 18)
    exact, _ = run(model, "fused", tokens, targets)
    scale = exact.logits.abs().max().item()
    for impl in ("fused", "reference"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out, grads = run(model, impl, tokens, targets)
        assert out.logits.dtype == torch.bfloat16
        assert max_diff(out.logits, exact.logits) < 0.03 * scale, (impl, max_diff(out.logits, exact.logits))
        assert abs(out.loss.item() - exact.loss.item()) < 0.02 * exact.loss.item()
        assert len(grads) == len(list(model.parameters()))
        assert all(torch.isfinite(g).all() for g in grads.values()), impl


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_weights(dtype):
    cfg = tiny_config(attn_experts=3, ffn_experts=3, ffn_top_k=2, n_kv_heads=2, kv_mode="shared")
    model = build_model(cfg, random_state(cfg, 19))
    tokens, targets = tokens_for(cfg, 19), tokens_for(cfg, 20)
    exact, _ = run(model, "fused", tokens, targets)
    model.to(dtype)
    for impl in ("fused", "reference"):
        out, grads = run(model, impl, tokens, targets)
        assert out.logits.dtype == dtype
        assert max_diff(out.logits, exact.logits) < 0.05 * exact.logits.abs().max().item(), impl
        assert all(g.dtype == dtype and torch.isfinite(g).all() for g in grads.values())


@pytest.mark.parametrize("case", [dict(), dict(tie_embeddings=True, lm_head_bias=True, logit_scale=0.5),
                                  dict(ffn_experts=3, attn_experts=3, lm_head_bias=True)])
def test_loss_only_head_in_chunks(case):
    """return_logits=False: the head and cross-entropy run chunk by chunk (3 rows here), with the same loss
    and gradients as the full logits, ignored targets included."""
    cfg = tiny_config(**case)
    model = build_model(cfg, random_state(cfg, 23))
    model.loss_chunk_rows = 3
    tokens, targets = tokens_for(cfg, 23), tokens_for(cfg, 24)
    targets[0, :3] = -100
    full, full_grads = run(model, "fused", tokens, targets)
    chunked, chunked_grads = run(model, "fused", tokens, targets, return_logits=False)
    assert chunked.logits is None
    assert abs(chunked.loss.item() - full.loss.item()) < 1e-5 and abs(chunked.nll.item() - full.nll.item()) < 1e-5
    for name, g in full_grads.items():
        assert max_diff(chunked_grads[name], g) < 1e-5, name
    with torch.no_grad():
        assert abs(model(tokens, targets=targets, return_logits=False).nll.item() - full.nll.item()) < 1e-5
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low, low_grads = run(model, "fused", tokens, targets, return_logits=False)
    assert abs(low.nll.item() - full.nll.item()) < 0.02 * full.nll.item()
    assert all(torch.isfinite(g).all() for g in low_grads.values())


def test_logits_to_keep():
    cfg = tiny_config(ffn_experts=3, attn_experts=3)
    model = build_model(cfg, random_state(cfg, 2))
    tokens = tokens_for(cfg, 2)
    with torch.no_grad():  # the same positions' logits; a BLAS may sum a product of 2 rows in another order than
        # one of all T rows (blocks.linear), so they agree to float rounding, not bit for bit
        assert max_diff(model(tokens, logits_to_keep=2).logits, model(tokens).logits[:, -2:]) < 1e-5


def test_bad_impl_and_shapes_are_refused():
    cfg = tiny_config(ffn_experts=3)
    model = build_model(cfg, random_state(cfg))
    tokens = tokens_for(cfg)
    model.impl = "fast"
    with pytest.raises(ValueError, match="impl='fast'"):
        model(tokens)
    model.impl = "fused"
    with pytest.raises(ValueError, match="targets has shape"):
        model(tokens, targets=tokens[:, 1:])
    with pytest.raises(ValueError, match="attention_mask has shape"):
        model(tokens, attention_mask=torch.ones(2, 3))
    with pytest.raises(ValueError, match="input_pos"):
        model(tokens, cache=model.new_cache(2, 16))


@pytest.mark.slow
def test_torch_compile_fused_training_step():
    """The fused forward and backward compile whole (fullgraph) under bf16 autocast, where the expert FFN's
    grouped matmul has a meta kernel; aot_eager checks the capture without inductor's slow C++ build."""
    cfg = tiny_config(n_layers=1, attn_experts=3, ffn_experts=3, ffn_top_k=2, n_kv_heads=2)
    model = build_model(cfg, random_state(cfg, 29))
    tokens, targets = tokens_for(cfg, 29), tokens_for(cfg, 30)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        eager, eager_grads = run(model, "fused", tokens, targets)
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        model.zero_grad(set_to_none=True)
        out = compiled(tokens, targets=targets)
    out.loss.backward()
    assert max_diff(out.logits, eager.logits) < 1e-2
    for name, p in model.named_parameters():
        assert max_diff(p.grad, eager_grads[name]) < 1e-2, name


def _attention_float64(q, k, v, mask):
    """Plain attention in float64 with K/V repeated per query head: the independent reference for attend()."""
    rep = q.shape[1] // k.shape[1]
    q, k, v = q.double(), k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if mask is None:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril(k.shape[2] - q.shape[2])
    return (scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v).float()


@pytest.mark.parametrize("rep", [1, 4])
@pytest.mark.parametrize("shape", ["causal", "cache", "padded"])
@pytest.mark.parametrize("sdpa_gqa", [True, False], ids=["sdpa-gqa", "per-group"])
def test_attend_and_its_graph_form_equal_plain_attention(rep, shape, sdpa_gqa, monkeypatch):
    """attend() on every path (SDPA; SDPA's own GQA, or one causal SDPA per query group where it would copy
    K/V; folded under a mask) and _attend_graph(), the form the ONNX export traces (one additive bias, query
    heads folded over their kv head, no NaN pass), against float64 attention with K/V copied per head."""
    from bam_surgery.runtime import blocks
    from bam_surgery.runtime.blocks import _attend_graph, attend, attention_mask_for

    monkeypatch.setattr(blocks, "_SDPA_GQA_DEVICES", ("cuda", "cpu") if sdpa_gqa else ("cuda",))

    g = torch.Generator().manual_seed(rep)
    B, Hkv, Dh = 2, 2, 8
    T, S = (5, 5) if shape == "causal" else (3, 7)
    q = torch.randn(B, Hkv * rep, T, Dh, generator=g)
    k, v = torch.randn(B, Hkv, S, Dh, generator=g), torch.randn(B, Hkv, S, Dh, generator=g)
    padding = None
    if shape == "padded":
        padding = torch.ones(B, S, dtype=torch.long)
        padding[0, :2] = 0  # left padding in row 0
    mask = None if shape == "causal" else attention_mask_for(padding, torch.arange(T) + (S - T), S)
    want = _attention_float64(q, k, v, mask)
    assert max_diff(attend(q, k, v, mask), want) < 1e-5
    assert max_diff(_attend_graph(q, k, v, mask, Dh ** -0.5), want) < 1e-5


def test_the_loss_head_casts_its_weight_once_under_autocast():
    """Under bf16 autocast the chunked head casts the fp32 head weight to bf16 once per forward, whatever the number
    of chunks (it was three casts per chunk: run G2's largest single CUDA cost at vocab 256k), and its gradient
    accumulates in fp32; the loss equals the full logits' to 0.5%."""
    from torch.utils._python_dispatch import TorchDispatchMode

    cfg = tiny_config(ffn_experts=3, attn_experts=2)
    model = build_model(cfg, random_state(cfg, 31)).train()
    model.loss_chunk_rows = 3
    weight = model.lm_head.weight
    casts = []

    class CountCasts(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._to_copy.default and args[0].data_ptr() == weight.data_ptr():
                casts.append(kwargs.get("dtype"))
            return func(*args, **(kwargs or {}))

    tokens, targets = tokens_for(cfg, 31), tokens_for(cfg, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16), CountCasts():
        out = model(tokens, targets=targets, return_logits=False)
    with CountCasts():
        out.loss.backward()
    assert casts == [torch.bfloat16], casts  # 16 rows in chunks of 3: six chunks, one cast
    assert weight.grad.dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        full = model(tokens, targets=targets)
    assert abs(out.loss.item() - full.loss.item()) < 5e-3 * full.loss.item()
