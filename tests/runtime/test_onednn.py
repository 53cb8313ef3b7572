"""oneDNN's float32 products on a CPU (runtime/blocks.py: `onednn_linear`, `mm`, and the mixture's output projection
in training): each against torch's own products (MKL's), forward and gradients, and where they are taken (and
where not: outside autograd, the FFN experts' row segments). ONEDNN_FP32 is forced both ways here, so these run on any CPU torch has oneDNN for,
whatever `auto` would choose there.

Tolerances: both are float32 products summed in their own orders: 1e-5 relative to the largest value (a product
over K terms differs by a few ulps of its magnitude); any wrong operand or transpose moves it by O(1)."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from conftest import build_model, random_state, tiny_config, tokens_for
from bam_surgery.runtime import blocks

pytestmark = pytest.mark.skipif(not (torch.backends.mkldnn.is_available()
                                     and hasattr(torch.ops.mkldnn, "_linear_pointwise")), reason="no oneDNN in torch")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


@pytest.fixture
def dnn_calls(monkeypatch):
    """ONEDNN_FP32 on; the list grows by one per oneDNN product."""
    calls: list[tuple] = []
    real = blocks._dnn
    monkeypatch.setattr(blocks, "ONEDNN_FP32", True)
    monkeypatch.setattr(blocks, "_dnn", lambda x, w, b=None: calls.append((tuple(x.shape), tuple(w.shape))) or real(x, w, b))
    return calls


@pytest.mark.parametrize("shape", [(7, 40), (2, 5, 40), (3, 1, 40)])
@pytest.mark.parametrize("bias", [False, True])
def test_onednn_linear_and_its_gradients_equal_f_linear(dnn_calls, shape, bias):
    gen = torch.Generator().manual_seed(len(shape) + bias)
    x0, w0 = torch.randn(*shape, generator=gen), torch.randn(24, 40, generator=gen)
    b0 = torch.randn(24, generator=gen) if bias else None
    g = torch.randn(*shape[:-1], 24, generator=gen)
    results = []
    for fn in (blocks.onednn_linear, F.linear):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        b = b0.clone().requires_grad_() if bias else None
        y = fn(x, w, b)
        y.backward(g)
        results.append((y.detach(), x.grad, w.grad, None if b is None else b.grad))
    for got, want in zip(*results):
        assert (got is None) == (want is None)
        if want is not None:
            assert got.shape == want.shape and _rel(got, want) < 1e-5
    assert len(dnn_calls) == 3  # forward, input gradient, weight gradient


def test_onednn_linear_takes_only_the_gradients_asked_for(dnn_calls):
    x, w = torch.randn(6, 16), torch.randn(8, 16).requires_grad_()
    blocks.onednn_linear(x, w).sum().backward()  # x without a gradient: no input-gradient product
    assert _rel(w.grad, torch.ones(6, 8).t() @ x) < 1e-5 and len(dnn_calls) == 2
    with torch.no_grad():
        blocks.onednn_linear(torch.randn(6, 16), w)
    assert len(dnn_calls) == 3


@pytest.mark.parametrize("transpose", [(False, False), (True, False), (False, True), (True, True)])
def test_mm_equals_matmul_of_strided_operands(dnn_calls, transpose):
    gen = torch.Generator().manual_seed(3)
    a = torch.randn(33, 17, generator=gen)
    b = torch.randn(17, 29, generator=gen)
    a = a.t().contiguous().t() if transpose[0] else a  # same values, column-major
    b = b.t().contiguous().t() if transpose[1] else b
    assert _rel(blocks.mm(a, b), a @ b) < 1e-5 and len(dnn_calls) == 1


def test_where_onednn_is_taken(monkeypatch):
    monkeypatch.setattr(blocks, "ONEDNN_FP32", True)
    x, w = torch.randn(300, 16), torch.randn(8, 16)
    assert blocks._onednn(x, w) and blocks._onednn(x, w, torch.randn(8))
    assert not blocks._onednn(x.double(), w.double())  # float32 only
    assert not blocks._onednn(x, w.bfloat16())
    assert not blocks._onednn(torch.randn(0, 16), w)
    assert not blocks._onednn(x, w, torch.randn(8).double())
    with torch.autocast("cpu", dtype=torch.bfloat16):  # torch's bf16 products are oneDNN's already
        assert not blocks._onednn(x, w)
    monkeypatch.setattr(blocks, "ONEDNN_FP32", False)
    assert not blocks._onednn(x, w)


def test_linear_takes_onednn_under_autograd_only(dnn_calls, monkeypatch):
    """Outside autograd (prompts, evaluation, an expert's rows) shapes vary from call to call, and oneDNN would make
    and keep a primitive for each: row blocks and torch's products there, as without oneDNN."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    w = torch.randn(8, 16)
    with torch.no_grad():
        blocks.linear(torch.randn(3, 16), w)  # decoding: row blocks
        blocks.linear(torch.randn(blocks.ROW_BLOCK_ROWS + 1, 16), w)  # a long prompt: torch's product
    blocks.linear(torch.randn(blocks.ROW_BLOCK_ROWS + 1, 16), w)  # nothing requires a gradient
    assert dnn_calls == []
    blocks.linear(torch.randn(3, 16), w.requires_grad_())  # training
    assert len(dnn_calls) == 1


@pytest.mark.parametrize("choice, wanted", [("blas", False), ("onednn", True)])
def test_the_environment_chooses(choice, wanted):
    code = "from bam_surgery.runtime import blocks; print(blocks.ONEDNN_FP32)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**__import__("os").environ, "BAM_SURGERY_CPU_MATMUL": choice})
    assert out.stdout.strip() == str(wanted)


def test_experts_row_segments_keep_torchs_products(dnn_calls, monkeypatch):
    """An expert's share of the tokens varies from call to call: oneDNN would make and keep a primitive for every
    row count, so the loop kernel's segments take row blocks (up to ROW_BLOCK_ROWS rows) or torch's products."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    lin = blocks.StackedLinear(3, 12, 20, bias=False)
    torch.nn.init.normal_(lin.weight)
    expert = torch.tensor([0] * 7 + [2] * (blocks.ROW_BLOCK_ROWS + 3))
    counts = torch.bincount(expert, minlength=3)
    xs = torch.randn(expert.numel(), 12)
    with torch.no_grad():
        y = blocks.grouped_linear(xs, lin, expert, counts, counts.cumsum(0), "loop")
    want = torch.cat([F.linear(xs[:7], lin.weight[0]), F.linear(xs[7:], lin.weight[2])])
    assert _rel(y, want) < 1e-5 and dnn_calls == []


@pytest.mark.parametrize("mix", [dict(), dict(ffn_experts=3, ffn_top_k=1, attn_experts=3, gate_norm="topk_softmax"),
                                 dict(attn_experts=3, kv_mode="shared", attn_output_gate=True),
                                 dict(ffn_experts=4, ffn_top_k=2, activation="gelu", qkv_bias=True, o_bias=True, ffn_bias=True,
                                      lm_head_bias=True)],
                         ids=["dense", "bam", "shared_kv_gated", "btx_bias"])
def test_a_training_step_with_onednn_equals_torch_products(monkeypatch, mix):
    """Loss, logits and every parameter's gradient of one training step (the fused path, the chunked loss head),
    with oneDNN's products and with torch's own; and oneDNN takes them all where it is on."""
    cfg = tiny_config(**mix)
    model = build_model(cfg, random_state(cfg, 7)).train()
    tokens, targets = tokens_for(cfg, 7), tokens_for(cfg, 8)
    calls = []
    real = blocks._dnn
    monkeypatch.setattr(blocks, "_dnn", lambda x, w, b=None: calls.append(1) or real(x, w, b))
    runs = []
    for on in (True, False):
        monkeypatch.setattr(blocks, "ONEDNN_FP32", on)
        model.zero_grad(set_to_none=True)
        out = model(tokens, targets=targets, return_logits=False)
        out.loss.backward()
        runs.append((out.loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
        if on:
            assert calls, "no oneDNN product in a float32 training step"
            calls.clear()
    assert calls == []  # off: none
    (loss_on, grads_on), (loss_off, grads_off) = runs
    assert abs(loss_on - loss_off) < 1e-5 * max(1.0, abs(loss_off))
    assert set(grads_on) == set(grads_off)
    for name, g in grads_off.items():
        assert (grads_on[name] - g).abs().max().item() <= 1e-5 * max(1.0, g.abs().max().item()), name
