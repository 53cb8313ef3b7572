"""The op kernels of a merge plan: one function per op, computing one output tensor.

Kernels get their inputs through `Sources` (surgery/plan_reader.py), which reads, checks, and owns
the memory: `read(source)` gives one input tensor, `read_into(source, out)` reads one straight into
a slot of the output (no intermediate buffer), `empty(shape, dtype)` gives output or scratch
memory and `release(t)` takes back what a kernel is done with (both pooled in a streamed merge:
runtime/buffers.py). A kernel holds its output plus one input (a mean: a float32 accumulator and
one input). Ops (surgery/plan.py):

    stack   out[e] = source_e                      [E, *dense_shape]
    mean    out = sum_i w_i * source_i             accumulated in float32, then cast
    copy    out = source_0
    normal  out ~ normal(0, std), a CPU generator seeded per tensor
    zeros   out = 0
    full    out = value
    calibrated  out = the plan's tensor of that name (computed before the merge; surgery/warm_start.py)
"""
from __future__ import annotations

from typing import Callable, Protocol

import torch

from .plan import Source, TensorOp


class Sources(Protocol):
    def read(self, source: Source) -> torch.Tensor: ...

    def read_into(self, source: Source, out: torch.Tensor) -> None: ...

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor: ...

    def release(self, tensor: torch.Tensor) -> None: ...

    def dtype(self, source: Source) -> torch.dtype: ...


def _stack(t: TensorOp, io: Sources) -> torch.Tensor:  # out [E, *shape]: slot e from source e
    if t.drop is not None or any(s.is_part for s in t.sources):
        return _stack_parts(t, io)
    out = io.empty(t.shape, t.dtype)
    first_slot: dict[Source, int] = {}  # a source used by several slots (the seed's FFN copies) is read once
    for e, s in enumerate(t.sources):
        if s in first_slot:
            out[e].copy_(out[first_slot[s]])
        elif io.dtype(s) == t.dtype:
            io.read_into(s, out[e])
            first_slot[s] = e
        else:
            x = io.read(s)
            out[e].copy_(x)
            io.release(x)
            first_slot[s] = e
    return out


def _stack_parts(t: TensorOp, io: Sources) -> torch.Tensor:
    """A stack whose slots are parts of their sources (an expert row, a fine-grained share, scaled) or have
    Drop-Upcycling's dimensions re-initialized: each source tensor read once while consecutive slots use it, each
    slot made in float32 and cast."""
    out = io.empty(t.shape, t.dtype)
    held: tuple[Source, torch.Tensor] | None = None
    for e, s in enumerate(t.sources):
        if held is None or held[0] != s.whole:
            if held is not None:
                io.release(held[1])
            held = (s.whole, io.read(s.whole))
        part = held[1] if s.row is None else held[1][s.row]
        if s.shard is not None:
            axis, g, n = s.shard
            width = part.shape[axis] // n
            part = part.narrow(axis, g * width, width)
        if t.drop is None and s.scale == 1.0:
            out[e].copy_(part)
            continue
        slot = part.to(torch.float32, copy=True)
        if t.drop is not None:
            _reinitialize(slot, t.drop.ratio, t.drop.axis, t.drop.subsets[e], t.drop.values[e])
        if s.scale != 1.0:
            slot.mul_(s.scale)
        out[e].copy_(slot)
    if held is not None:
        io.release(held[1])
    return out


def drop_subset(n: int, ratio: float, seed: int) -> torch.Tensor:
    """Drop-Upcycling's re-initialized dimensions of one expert: floor(ratio * n) of its n intermediate dimensions,
    drawn without replacement (sorted)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randperm(n, generator=gen)[:int(ratio * n)].sort().values


def _reinitialize(slot: torch.Tensor, ratio: float, axis: int, subset_seed: int, values_seed: int) -> None:
    """In place: the subset's dimensions along `axis` drawn from normal(mean, std) of the values they replace (the
    paper's statistics, as its released conversion computes them: over the re-initialized part of the matrix)."""
    idx = drop_subset(slot.shape[axis], ratio, subset_seed)
    if not idx.numel():
        return
    old = slot.index_select(axis, idx)
    mean = old.mean()
    std = old.std() if old.numel() > 1 else torch.zeros(())
    gen = torch.Generator().manual_seed(values_seed)
    slot.index_copy_(axis, idx, torch.randn(old.shape, generator=gen) * std + mean)


_CHUNK = 1 << 18  # elements a mean converts to float32 at a time (1 MiB, stays in cache)


def _add_scaled(acc: torch.Tensor, x: torch.Tensor, w: float) -> None:
    """acc += w * x with x promoted to float32 first, exactly as acc.add_(x, alpha=w) does. On the
    CPU that would allocate a float32 copy of all of x; here a chunk at a time goes through one
    small scratch buffer."""
    if x.dtype == torch.float32:
        acc.add_(x, alpha=w)
        return
    a, xs = acc.view(-1), x.reshape(-1)
    scratch = torch.empty(min(_CHUNK, a.numel()), dtype=torch.float32)
    for i in range(0, a.numel(), _CHUNK):
        part = scratch[:min(_CHUNK, a.numel() - i)]
        part.copy_(xs[i:i + _CHUNK])
        a[i:i + _CHUNK].add_(part, alpha=w)


def _mean(t: TensorOp, io: Sources) -> torch.Tensor:  # sum_i w_i x_i, accumulated in float32
    acc = io.empty(t.shape, torch.float32)
    for i, (w, s) in enumerate(zip(t.weights, t.sources)):
        x = io.read(s)
        if i == 0:
            acc.copy_(x).mul_(w)  # x.to(float32) * w, element by element the same
        else:
            _add_scaled(acc, x, w)
        io.release(x)
    if t.dtype == torch.float32:
        return acc
    out = io.empty(t.shape, t.dtype)
    out.copy_(acc)
    io.release(acc)
    return out


def _copy(t: TensorOp, io: Sources) -> torch.Tensor:
    out = io.empty(t.shape, t.dtype)
    s = t.sources[0]
    if io.dtype(s) == t.dtype:
        io.read_into(s, out)
    else:
        x = io.read(s)
        out.copy_(x)
        io.release(x)
    return out


def _drawn(t: TensorOp) -> torch.Tensor:
    """normal(0, 1) of the op's shape from its seeded generator; with `repeat`, each row drawn once and repeated
    (fine-grained upcycling's virtual groups)."""
    gen = torch.Generator().manual_seed(t.rng_seed)
    shape = (t.shape[0] // t.repeat, *t.shape[1:])
    rows = torch.randn(shape, generator=gen, dtype=torch.float32)
    return rows if t.repeat == 1 else rows.repeat_interleave(t.repeat, dim=0)


def _normal(t: TensorOp, io: Sources) -> torch.Tensor:  # generator seeded per tensor (plan.router_rng_seed)
    return (_drawn(t) * t.std).to(t.dtype)


def _unit_rows(t: TensorOp, io: Sources) -> torch.Tensor:  # normal rows scaled to unit norm (key-store keys)
    return torch.nn.functional.normalize(_drawn(t), dim=-1).to(t.dtype)


def _zeros(t: TensorOp, io: Sources) -> torch.Tensor:
    return torch.zeros(t.shape, dtype=t.dtype)


def _full(t: TensorOp, io: Sources) -> torch.Tensor:
    return torch.full(t.shape, t.value, dtype=torch.float32).to(t.dtype)


OP_TABLE: dict[str, Callable[[TensorOp, Sources], torch.Tensor]] = {
    "stack": _stack, "mean": _mean, "copy": _copy, "normal": _normal, "unit_rows": _unit_rows, "zeros": _zeros,
    "full": _full}


def run_op(t: TensorOp, io: Sources, calibrated: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """Compute one output tensor (`calibrated`: the plan's precomputed tensors, for op calibrated)."""
    if t.op == "calibrated":
        return (calibrated or {})[t.name].to(t.dtype)
    if t.op not in OP_TABLE:
        raise ValueError(f"{t.name}: unknown op {t.op!r}; the ops are {', '.join(OP_TABLE)}")
    out = OP_TABLE[t.op](t, io)
    if tuple(out.shape) != t.shape or out.dtype != t.dtype:
        raise AssertionError(f"{t.name}: op {t.op} made {tuple(out.shape)} {out.dtype}, planned {t.shape} {t.dtype}")
    return out
