"""The safetensors file format: a streaming writer, a validated reader, and in-place header patches.

    [8 bytes little-endian N][N bytes JSON header, space-padded][tensor bytes]
    header: {"__metadata__": {str: str}, name: {"dtype": "BF16", "shape": [...], "data_offsets": [b, e]}}

Loading never unpickles. `SafetensorsStreamWriter` writes the header first (all shapes and dtypes
are known in advance), then each tensor's bytes as it is produced, so a writer never holds more
than one tensor. `SafetensorsFile` reads each tensor into memory of its own (`read_tensor`).
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Mapping

import torch
from safetensors import safe_open

from .dtypes import SAFETENSORS_DTYPES, TORCH_TO_SAFETENSORS, nbytes
from .errors import CheckpointError

Entry = tuple[str, tuple[int, ...], torch.dtype]  # (name, shape, dtype) of a tensor to write


class SafetensorsStreamWriter:
    """Write a safetensors file tensor by tensor, in a fixed order declared up front.

    >>> w = SafetensorsStreamWriter(path, [(name, shape, dtype), ...], metadata)
    >>> for name, ... : w.write(name, tensor)   # in declared order
    >>> w.close()
    """

    def __init__(self, path: str | os.PathLike, entries: list[Entry], metadata: Mapping[str, str] | None = None):
        self.path = Path(path)
        header: dict[str, object] = {}
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        offset = 0
        self._order = []
        self._sizes = {}
        for name, shape, dtype in entries:
            size = nbytes(shape, dtype)
            header[name] = {"dtype": TORCH_TO_SAFETENSORS[dtype], "shape": [int(s) for s in shape],
                            "data_offsets": [offset, offset + size]}
            self._order.append((name, tuple(int(s) for s in shape), dtype))
            self._sizes[name] = size
            offset += size
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self._f = open(self.path, "wb")
        self._f.write(struct.pack("<Q", len(raw)))
        self._f.write(raw)
        self._next = 0
        self.total_bytes = offset

    def write(self, name: str, tensor: torch.Tensor) -> int:
        exp_name, shape, dtype = self._order[self._next]
        if name != exp_name:
            raise CheckpointError(f"{self.path}: tensor {name} written out of order (expected {exp_name})")
        if tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise CheckpointError(f"{self.path}: tensor {name} is {tuple(tensor.shape)} {tensor.dtype}, "
                                  f"declared {shape} {dtype}")
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
        self._f.write(memoryview(data))
        self._next += 1
        return self._sizes[name]

    def abort(self) -> None:
        """Close the file without completing it (the caller's atomic_path discards it)."""
        if not self._f.closed:
            self._f.close()

    def __enter__(self) -> "SafetensorsStreamWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def close(self) -> None:
        if self._next != len(self._order):
            missing = self._order[self._next][0]
            self._f.close()
            raise CheckpointError(f"{self.path}: closed before tensor {missing} was written")
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()


def read_tensor(file: Path, data_start: int, begin: int, end: int, shape: tuple[int, ...],
                dtype: torch.dtype) -> torch.Tensor:
    """Read one tensor's byte range [begin, end) into memory of its own.

    safetensors' get_tensor maps the whole file: every page a merge reads stays resident in the
    process, so its RSS grows to the size of all inputs. Reading each tensor's byte range into a
    private buffer keeps RSS bounded by the tensors alive; the page cache still serves repeats.
    """
    if end == begin:
        return torch.empty(shape, dtype=dtype)
    buf = torch.empty(end - begin, dtype=torch.uint8)  # uninitialized: readinto fills every byte
    view = memoryview(buf.numpy())
    with open(file, "rb", buffering=0) as f:
        f.seek(data_start + begin)
        got = 0
        while got < len(view):
            n = f.readinto(view[got:])
            if not n:
                raise CheckpointError(f"{file}: truncated while reading tensor bytes {begin}-{end}")
            got += n
    return buf.view(dtype).reshape(shape)


def _truncation(file: Path) -> str | None:
    """If `file` has a readable header but ends early, say which tensor is cut off (else None)."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            if n > size:
                return None
            header = json.loads(f.read(n))
        tensors = sorted((v["data_offsets"][1], k) for k, v in header.items() if k != "__metadata__")
    except Exception:
        return None
    cut = next(((end, k) for end, k in tensors if 8 + n + end > size), None)
    if cut is None:
        return None
    return (f"{file}: truncated: tensor {cut[1]} ends at byte {8 + n + cut[0]} but the file has {size} bytes "
            f"(header promises {8 + n + tensors[-1][0]})")


class SafetensorsFile:
    """One safetensors file: header validated and parsed once, tensors read into private buffers.

    Every reader of this project (canonical, HF, Mixtral, HF BAM exports) opens its files through
    this class, so the error messages and the bounded-RSS reading (`read_tensor`) are the same
    everywhere. `meta[key]` is (shape, dtype); `metadata` the header's string map.
    """

    def __init__(self, file: Path):
        self.file = Path(file)
        if not self.file.is_file():
            raise CheckpointError(f"{self.file}: file not found")
        try:
            safe_open(str(self.file), framework="pt")  # validates the header (offsets, dtypes, coverage)
        except Exception as e:  # safetensors raises its own error types for bad headers
            raise CheckpointError(_truncation(self.file) or f"{self.file}: unreadable safetensors file ({e})") from e
        with open(self.file, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(n))
        self.metadata: dict[str, str] = dict(header.pop("__metadata__", None) or {})
        self.entries: dict[str, dict] = header
        self.data_start = 8 + n
        end = max((v["data_offsets"][1] for v in header.values()), default=0)
        size = self.file.stat().st_size
        if size < self.data_start + end:  # a valid header over fewer bytes than its offsets promise
            raise CheckpointError(f"{self.file}: truncated ({size} bytes, header promises {self.data_start + end})")
        self.meta: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        for k, v in header.items():
            if v["dtype"] not in SAFETENSORS_DTYPES:
                raise CheckpointError(f"{self.file}: tensor {k} has dtype {v['dtype']}, which has no torch dtype "
                                      f"to read it into (readable: {', '.join(SAFETENSORS_DTYPES)})")
            self.meta[k] = (tuple(v["shape"]), SAFETENSORS_DTYPES[v["dtype"]])

    def keys(self) -> list[str]:
        return list(self.entries)

    def get(self, key: str) -> torch.Tensor:
        begin, end = self.entries[key]["data_offsets"]
        shape, dtype = self.meta[key]
        return read_tensor(self.file, self.data_start, begin, end, shape, dtype)


def patch_header(path: Path, replace: Mapping[str, str]) -> None:
    """Overwrite same-length placeholders in a safetensors header in place (every occurrence)."""
    with open(path, "r+b") as f:
        n = int.from_bytes(f.read(8), "little")
        header = f.read(n)
        for old, new in replace.items():
            old_b, new_b = old.encode(), new.encode()
            if len(old_b) != len(new_b) or header.count(old_b) < 1:  # once per input naming the file
                raise AssertionError(f"{path}: cannot patch header placeholder {old}")
            header = header.replace(old_b, new_b)
        f.seek(8)
        f.write(header)
        f.flush()
        os.fsync(f.fileno())
