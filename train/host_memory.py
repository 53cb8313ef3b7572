"""Host memory for training on the CPU: freed tensors' pages stay with the process.

glibc's malloc serves every block above 32 MiB with its own mmap and hands it back to the kernel when freed, and
trims the heap's free top likewise. A training step frees and allocates the same large tensors every time (the
gradients, set to None after each update; the loss head's [V, D] gradient; activations and their gradients), so each
step touches fresh pages again and the kernel faults them in, zeroed, one by one: on the 2-core VM of BENCHMARKS.md
keeping them took a SmolLM2 step from 1.334 to 1.294 s and from 1.325 to 1.302 s (two pairs of processes, median of
6 steps; 5-6% with the same settings given to glibc before the process starts, GLIBC_TUNABLES). What
PyTorch's CPU tuning guide gets from a preloaded jemalloc or tcmalloc, mallopt gets from glibc itself: no mmap for
large blocks (they come from the heap, and a freed one is reused by the next of its size) and no trimming below
2 GiB of free heap top. The process keeps what it peaked at until it exits; a training process would reach that
peak again at the next step anyway. Not glibc (musl, macOS, Windows): nothing changes.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys

M_TRIM_THRESHOLD = -1  # glibc's malloc.h
M_MMAP_MAX = -4
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: the most it can say


@functools.cache
def keep_freed_pages() -> bool:
    """Tell glibc's malloc to keep freed memory in the process (once per process). True where it took effect."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # no C library found, or one without mallopt
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # glibc still falls back to mmap where the heap cannot grow (and in threads' own arenas), so nothing is refused;
    # a mallopt that does nothing (musl's) returns 0: not kept
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
