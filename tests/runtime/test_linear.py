"""blocks.linear: F.linear, run on a CPU for a few rows as one bmm over row blocks of the weight (one per thread),
and blocks' "loop" expert kernel, which sends each expert's rows through it. Both compute F.linear's dot products;
these tests hold them to it and check when the blocked path is taken and when it is not."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bam_surgery.runtime import blocks
from bam_surgery.runtime.blocks import ROW_BLOCK_ROWS, Linear, StackedLinear, _row_blocks, expert_kernel, linear


@pytest.fixture
def threads():
    """Run with n torch threads, restored after."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 12, 64, ROW_BLOCK_ROWS, ROW_BLOCK_ROWS + 1])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_equals_f_linear(threads, rows, bias):
    threads(2)
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 40, generator=gen)
    b = torch.randn(96, generator=gen) if bias else None
    x = torch.randn(1, rows, 40, generator=gen)
    with torch.no_grad():
        got, want = linear(x, w, b), F.linear(x, w, b)
    assert got.shape == want.shape == (1, rows, 96)
    assert _relative(got, want) < 1e-6


def test_the_blocked_path_is_taken_where_it_should_be(threads, monkeypatch):
    w, x = torch.randn(96, 40), torch.randn(3, 40)
    threads(2)
    monkeypatch.setattr(blocks, "ONEDNN_FP32", True)  # oneDNN only under autograd: row blocks as without it
    with torch.no_grad():
        assert _row_blocks(torch.randn(ROW_BLOCK_ROWS, 40), w) == 2
    with torch.no_grad():
        assert _row_blocks(x, w) == 2
        assert _row_blocks(torch.randn(ROW_BLOCK_ROWS + 1, 40), w) == 1  # more rows: the BLAS threads them itself
        assert _row_blocks(x.double(), w) == 1  # mixed dtypes: F.linear says what it says
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert _row_blocks(x, w) == 1
    assert _row_blocks(x, w.requires_grad_()) == 1  # autograd: training's matmuls stay F.linear's
    threads(1)
    with torch.no_grad():
        assert _row_blocks(x, w) == 1
    threads(5)  # 96 rows: the most blocks up to 5 that divide them
    with torch.no_grad():
        assert _row_blocks(x, w) == 4
        assert _row_blocks(x, torch.randn(97, 40)) == 1  # a prime row count: no blocks
    threads(16)  # more threads than rows: a block per row
    with torch.no_grad():
        assert _row_blocks(x, torch.randn(8, 40)) == 8


def test_linear_modules_and_stacked_experts_use_it(threads, monkeypatch):
    threads(2)
    calls = []
    monkeypatch.setattr(blocks.torch, "bmm", lambda *a: calls.append(1) or torch.matmul(*a))
    lin, stacked = Linear(40, 96), StackedLinear(3, 40, 96, bias=True)
    torch.nn.init.normal_(stacked.weight)
    x = torch.randn(2, 40)
    with torch.no_grad():
        assert _relative(lin(x), F.linear(x, lin.weight, lin.bias)) < 1e-6
        assert _relative(stacked(x, 1), F.linear(x, stacked.weight[1], stacked.bias[1])) < 1e-6
        every = stacked.all_experts(x)
    assert _relative(every, torch.cat([F.linear(x, stacked.weight[e], stacked.bias[e]) for e in range(3)], -1)) < 1e-6
    assert len(calls) == 3


def test_loop_kernel_is_the_cpu_inference_choice():
    x = torch.randn(4, 8)
    with torch.no_grad():
        assert expert_kernel(x, 8, 4) == "loop"
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert expert_kernel(x, 8, 4) != "loop"
    assert expert_kernel(x, 8, 4) != "loop"  # training: grad enabled
