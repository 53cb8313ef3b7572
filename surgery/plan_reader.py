"""A merge plan seen as a checkpoint reader: `get(name)` computes that output tensor on demand.

Exporters take any reader, so with a PlanReader they write any format straight from the inputs,
with no intermediate canonical file. Every input tensor is checked against its header and for
non-finite values as it is read.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from bam_surgery.runtime.buffers import BufferPool
from bam_surgery.runtime.reader import Reader

from .errors import InputError
from .hashing import InputHasher
from .kernels import run_op
from .plan import Plan, Source, file_label
from .provenance import output_metadata, plan_input_files

Warn = Callable[[str], None]


def all_finite(x: torch.Tensor) -> bool:
    """No NaN or Inf in x. aminmax propagates NaN and surfaces +-Inf as the min/max; it runs in the
    input's dtype, ~10x faster than isfinite().all() on bf16. Every input tensor goes through this."""
    if x.numel() == 0:
        return True
    lo, hi = torch.aminmax(x)
    return math.isfinite(float(lo)) and math.isfinite(float(hi))


def read_source(plan: Plan, src: Source, allow_nonfinite: bool, warn: Warn | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """One input tensor, checked against its header and for non-finite values; read into `out`
    (its planned shape and the input's dtype) when given."""
    inp = plan.inputs[src.input]
    reader, where = inp.reader, file_label(inp.reader, src.name, inp.label)
    if out is not None and tuple(out.shape) != tuple(reader.shape(src.name)):
        raise InputError(f"{where}: tensor {src.name} has shape {list(reader.shape(src.name))}, the plan needs "
                         f"{list(out.shape)}")
    try:
        if out is None:
            x = reader.get(src.name)
        else:
            reader.read_into(src.name, out)
            x = out
    except Exception as e:
        raise InputError(f"{where}: tensor {src.name} could not be read ({' '.join(str(e).split())})") from e
    if tuple(x.shape) != tuple(reader.shape(src.name)):
        raise InputError(f"{where}: tensor {src.name} has shape {list(x.shape)}, its header says "
                         f"{list(reader.shape(src.name))}")
    if not all_finite(x):
        bad = int((~torch.isfinite(x)).sum())
        msg = f"{where}: tensor {src.name} has {bad} non-finite value(s) (NaN or Inf)"
        if not allow_nonfinite:
            raise InputError(msg + "; fix the input or pass --allow-nonfinite to merge anyway")
        if warn:
            warn(msg + " (kept: --allow-nonfinite)")
    return x


class _PlanSources:
    """The kernels' view of a plan's inputs (surgery/kernels.py Sources): every read checked by
    read_source; memory from `pool` when given (a streamed merge), else plain allocations."""

    def __init__(self, plan: Plan, allow_nonfinite: bool, warn: Warn | None, pool: BufferPool | None):
        self.plan, self.allow_nonfinite, self.warn, self.pool = plan, allow_nonfinite, warn, pool

    def dtype(self, src: Source) -> torch.dtype:
        return self.plan.inputs[src.input].reader.dtype(src.name)

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return self.pool.empty(shape, dtype) if self.pool is not None else torch.empty(shape, dtype=dtype)

    def release(self, tensor: torch.Tensor) -> None:
        if self.pool is not None:
            self.pool.release(tensor)

    def read(self, src: Source) -> torch.Tensor:
        if self.pool is None:
            return read_source(self.plan, src, self.allow_nonfinite, self.warn)
        reader = self.plan.inputs[src.input].reader
        buf = self.pool.empty(tuple(reader.shape(src.name)), reader.dtype(src.name))
        try:
            return read_source(self.plan, src, self.allow_nonfinite, self.warn, out=buf)
        except BaseException:
            self.pool.release(buf)
            raise

    def read_into(self, src: Source, out: torch.Tensor) -> None:
        read_source(self.plan, src, self.allow_nonfinite, self.warn, out=out)


class PlanReader(Reader):
    """The reader protocol over a plan. `metadata` carries the provenance, with the inputs' digests:
    the first access hashes every input file (a full read of the inputs; pass hash_inputs=False to
    leave the digests out). With a `pool` (runtime/buffers.py), outputs and scratch memory are
    pooled buffers: the caller must release each output once written and use it no more
    (surgery/execute.py); without one, every tensor returned is the caller's to keep."""

    def __init__(self, plan: Plan, allow_nonfinite: bool | None = None, warn: Warn | None = None,
                 hash_inputs: bool = True, pool: BufferPool | None = None):
        self.plan = plan
        self.config = plan.config
        self.allow_nonfinite = plan.options.allow_nonfinite if allow_nonfinite is None else allow_nonfinite
        self.warn = warn
        self.hash_inputs = hash_inputs
        self._metadata: dict[str, str] | None = None
        self.pool = pool
        self._sources = _PlanSources(plan, self.allow_nonfinite, warn, pool)

    def names(self) -> list[str]:
        return [t.name for t in self.plan.tensors]

    def __contains__(self, name: str) -> bool:
        try:
            self.plan[name]
        except KeyError:
            return False
        return True

    def shape(self, name: str) -> tuple[int, ...]:
        return self.plan[name].shape

    def dtype(self, name: str) -> torch.dtype:
        return self.plan[name].dtype

    def get(self, name: str) -> torch.Tensor:
        t = self.plan[name]
        out = run_op(t, self._sources, self.plan.calibrated)
        if _may_make_nonfinite(self.plan, t) and not self.allow_nonfinite and not all_finite(out):
            bad = int((~torch.isfinite(out)).sum())
            raise InputError(f"{name}: the merge made {bad} non-finite value(s) ({t.op} in "
                             f"{str(t.dtype).removeprefix('torch.')}: values past the dtype's range?); "
                             "nothing was written")
        return out


    @property
    def metadata(self) -> dict[str, str]:
        if self._metadata is None:
            digests = InputHasher(plan_input_files(self.plan)).result() if self.hash_inputs else None
            self._metadata = output_metadata(self.plan, digests)
        return self._metadata


def _may_make_nonfinite(plan: Plan, t) -> bool:
    """Ops whose output can hold Inf/NaN although every input is finite: a random init, a mean, a scaled or
    re-initialized stack, and any cast to a narrower dtype (bfloat16 inputs written as float16). A stack or copy in the
    inputs' own dtype cannot."""
    if t.op in ("normal", "mean") or t.drop is not None or any(s.scale != 1.0 for s in t.sources):
        return True
    return any(plan.inputs[s.input].reader.dtype(s.name) != t.dtype for s in t.sources)
