"""Sizes a user gives, checked against the memory there is before anything is allocated.

`check_fits(need, what, error)` refuses an estimate larger than the machine's memory (the device's for
CUDA, physical RAM otherwise) with one line holding both numbers. The limit is the total, not what is
free now: a refusal says the job can never run here, whatever else the machine is doing.
"""
from __future__ import annotations

import os

import torch


def memory_limit(device: torch.device | str | None = None) -> int | None:
    """Bytes of memory on `device` (CUDA: its total; else physical RAM); None when unknown."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(device).total_memory
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_fits(need: int, what: str, error: type[Exception], device: torch.device | str | None = None) -> None:
    """Raise `error` when `need` bytes exceed the memory of `device`; `what` says what was estimated."""
    limit = memory_limit(device)
    if limit is not None and need > limit:
        raise error(f"{what} needs at least {_gib(need)} of memory; this machine has {_gib(limit)} "
                    f"({'the device' if device is not None and torch.device(device).type == 'cuda' else 'RAM'})")


def _gib(n: int) -> str:
    return f"{n / 2**30:,.1f} GiB"
