"""Reusable memory for streamed tensors: what a merge reads, accumulates and writes, tensor after tensor.

A streamed merge touches every byte of its inputs and outputs once, through a few tensors alive at
a time. Fresh memory for each of them costs a page fault per 4 KiB page (the kernel zeroes it, and a
virtual machine may back it anew), and freeing it returns it to the system: at 0.5B parameters that
is millions of faults, more CPU than the arithmetic. A BufferPool hands out byte buffers and takes
them back, so the same pages carry tensor after tensor.

    pool = BufferPool(max_free_bytes=512 << 20)
    x = pool.empty((4096, 4096), torch.bfloat16)   # memory of a pooled buffer (uninitialized)
    ...                                            # x and its views must not be used after:
    pool.release(x)                                # back to the pool (ignored if not the pool's)

Only the holder of a tensor may release it, once nothing else uses it: the pool reuses the memory
at the next `empty`. Small tensors (under `min_bytes`) are plain allocations (the allocator's own
free lists serve them without faults). Thread-safe: a read-ahead thread takes, the writer releases.
"""
from __future__ import annotations

import math
import threading
from collections import OrderedDict

import torch

_ROUND = 1 << 20  # capacities are whole MiB, so tensors of nearly the same size share buffers


class BufferPool:
    def __init__(self, max_free_bytes: int = 512 << 20, min_bytes: int = 1 << 20):
        self.max_free_bytes = max_free_bytes
        self.min_bytes = min_bytes
        self._lock = threading.Lock()
        self._lent: dict[int, torch.Tensor] = {}  # data_ptr -> the buffer (uint8), while a tensor uses it
        self._free: OrderedDict[int, torch.Tensor] = OrderedDict()  # data_ptr -> buffer, least recently released first
        self._free_bytes = 0
        self.allocated = 0  # buffers created (for tests and benchmarks)

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized contiguous tensor, in pooled memory when it is at least min_bytes."""
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if nbytes < self.min_bytes:
            return torch.empty(shape, dtype=dtype)
        with self._lock:
            buf = self._best_fit(nbytes)
            if buf is None:
                buf = torch.empty(-(-nbytes // _ROUND) * _ROUND, dtype=torch.uint8)
                self.allocated += 1
            self._lent[buf.data_ptr()] = buf
        return buf[:nbytes].view(dtype).view(shape)

    def _best_fit(self, nbytes: int) -> torch.Tensor | None:
        """The smallest free buffer that holds nbytes and is not more than twice the size (a big
        buffer is kept for a big tensor, not spent on a small one)."""
        best = None
        for ptr, buf in self._free.items():
            cap = buf.numel()
            if nbytes <= cap <= 2 * nbytes + _ROUND and (best is None or cap < self._free[best].numel()):
                best = ptr
        if best is None:
            return None
        buf = self._free.pop(best)
        self._free_bytes -= buf.numel()
        return buf

    def release(self, tensor: torch.Tensor | None) -> None:
        """Give back the memory of a tensor made by `empty` (any other tensor is ignored)."""
        if tensor is None:
            return
        with self._lock:
            buf = self._lent.pop(tensor.data_ptr(), None)
            if buf is None:
                return
            self._free[buf.data_ptr()] = buf
            self._free_bytes += buf.numel()
            while self._free_bytes > self.max_free_bytes and self._free:
                _, old = self._free.popitem(last=False)  # the least recently released goes back to the system
                self._free_bytes -= old.numel()

    @property
    def free_bytes(self) -> int:
        return self._free_bytes
