"""Dtype tables: the safetensors names of torch dtypes, byte sizes, and the dtypes merges compute in.

`SAFETENSORS_DTYPES` is every dtype safetensors stores that torch holds one element per byte
group of (the table of safetensors' own torch binding, bindings/python/py_src/safetensors/torch.py):
floats down to FP8, signed and unsigned integers, bool and complex64. A file may hold other names
(packed F4, F6_E2M3, F6_E3M2): those are refused when the file is opened, naming file and tensor.
"""
from __future__ import annotations

from typing import Iterable

import torch

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
    "F8_E5M2": torch.float8_e5m2, "F8_E5M2FNUZ": torch.float8_e5m2fnuz, "F8_E8M0": torch.float8_e8m0fnu,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8,
    "BOOL": torch.bool, "C64": torch.complex64,
}
TORCH_TO_SAFETENSORS: dict[torch.dtype, str] = {v: k for k, v in SAFETENSORS_DTYPES.items()}
FLOAT_DTYPES: tuple[torch.dtype, ...] = tuple(d for d in SAFETENSORS_DTYPES.values() if d.is_floating_point)

# The dtypes merges compute in (means accumulate in float32 and cast back): what --dtype accepts,
# by name. FP8 and integer weights have no arithmetic of their own on CPU; merges refuse them.
COMPUTE_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                                          "float16": torch.float16, "float64": torch.float64}


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16" (what config.json files and messages say)."""
    return str(dtype).removeprefix("torch.")


def dtype_size(dtype: torch.dtype) -> int:
    return dtype.itemsize


def nbytes(shape: Iterable[int], dtype: torch.dtype) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n * dtype_size(dtype)


def main_dtype(entries: Iterable[tuple[str, tuple[int, ...], torch.dtype]]) -> torch.dtype:
    """The dtype holding most of the bytes of (name, shape, dtype) entries, ties to the first seen:
    what an exported config.json reports as the model's dtype."""
    by_bytes: dict[torch.dtype, int] = {}
    for _, shape, dtype in entries:
        by_bytes[dtype] = by_bytes.get(dtype, 0) + nbytes(shape, dtype)
    return max(by_bytes, key=lambda d: by_bytes[d])  # max keeps the first of equal keys
