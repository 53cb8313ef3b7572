"""The op kernels of a merge plan: one function per op, computing one output tensor.

`read(source)` returns one input tensor; each is dropped after its use, so a kernel holds its
output plus one input (a mean: a float32 accumulator and one input). Ops (surgery/plan.py):

    stack   out[e] = source_e                      [E, *dense_shape]
    mean    out = sum_i w_i * source_i             accumulated in float32, then cast
    copy    out = source_0
    normal  out ~ normal(0, std), a CPU generator seeded per tensor
    zeros   out = 0
    full    out = value
    calibrated  out = the plan's tensor of that name (computed before the merge; surgery/warm_start.py)
"""
from __future__ import annotations

from typing import Callable

import torch

from .plan import Source, TensorOp

Read = Callable[[Source], torch.Tensor]


def _stack(t: TensorOp, read: Read) -> torch.Tensor:  # out [E, *shape]: slot e from source e
    out = torch.empty(t.shape, dtype=t.dtype)
    last_use = {s: e for e, s in enumerate(t.sources)}
    held: dict[Source, torch.Tensor] = {}  # a source used by several slots (the seed's FFN copies)
    for e, s in enumerate(t.sources):
        x = held.pop(s) if s in held else read(s)
        out[e].copy_(x)
        if last_use[s] > e:
            held[s] = x
        del x
    return out


def _mean(t: TensorOp, read: Read) -> torch.Tensor:  # sum_i w_i x_i, accumulated in float32
    acc = None
    for w, s in zip(t.weights, t.sources):
        x = read(s)
        if acc is None:
            acc = x.to(torch.float32) * w  # a new tensor: the reader's is never modified
        else:
            acc.add_(x, alpha=w)  # promotes x to float32 element by element, no temporary copy
        del x
    return acc.to(t.dtype)


def _copy(t: TensorOp, read: Read) -> torch.Tensor:
    return read(t.sources[0]).to(t.dtype)


def _normal(t: TensorOp, read: Read) -> torch.Tensor:  # generator seeded per tensor (plan.router_rng_seed)
    gen = torch.Generator().manual_seed(t.rng_seed)
    return (torch.randn(t.shape, generator=gen, dtype=torch.float32) * t.std).to(t.dtype)


def _unit_rows(t: TensorOp, read: Read) -> torch.Tensor:  # normal rows scaled to unit norm (key-store keys)
    gen = torch.Generator().manual_seed(t.rng_seed)
    rows = torch.randn(t.shape, generator=gen, dtype=torch.float32)
    return torch.nn.functional.normalize(rows, dim=-1).to(t.dtype)


def _zeros(t: TensorOp, read: Read) -> torch.Tensor:
    return torch.zeros(t.shape, dtype=t.dtype)


def _full(t: TensorOp, read: Read) -> torch.Tensor:
    return torch.full(t.shape, t.value, dtype=torch.float32).to(t.dtype)


OP_TABLE: dict[str, Callable[[TensorOp, Read], torch.Tensor]] = {
    "stack": _stack, "mean": _mean, "copy": _copy, "normal": _normal, "unit_rows": _unit_rows, "zeros": _zeros,
    "full": _full}


def run_op(t: TensorOp, read: Read, calibrated: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """Compute one output tensor (`calibrated`: the plan's precomputed tensors, for op calibrated)."""
    if t.op == "calibrated":
        return (calibrated or {})[t.name].to(t.dtype)
    if t.op not in OP_TABLE:
        raise ValueError(f"{t.name}: unknown op {t.op!r}; the ops are {', '.join(OP_TABLE)}")
    out = OP_TABLE[t.op](t, read)
    if tuple(out.shape) != t.shape or out.dtype != t.dtype:
        raise AssertionError(f"{t.name}: op {t.op} made {tuple(out.shape)} {out.dtype}, planned {t.shape} {t.dtype}")
    return out
