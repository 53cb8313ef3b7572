"""The safetensors file format: a streaming writer, a validated reader, and in-place header patches.

    [8 bytes little-endian N][N bytes JSON header, space-padded][tensor bytes]
    header: {"__metadata__": {str: str}, name: {"dtype": "BF16", "shape": [...], "data_offsets": [b, e]}}

Loading never unpickles. `SafetensorsStreamWriter` writes the header first (all shapes and dtypes
are known in advance), then each tensor's bytes as it is produced, so a writer never holds more
than one tensor. `SafetensorsFile` reads each tensor into memory of its own (`read_tensor`).
"""
from __future__ import annotations

import json
import math
import os
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import torch

from .dtypes import SAFETENSORS_DTYPES, TORCH_TO_SAFETENSORS, nbytes
from .errors import CheckpointError, printable
from .jsonfile import parse_json

Entry = tuple[str, tuple[int, ...], torch.dtype]  # (name, shape, dtype) of a tensor to write
WRITEBACK_BYTES = 64 << 20  # a writer starts writeback of its file every 64 MiB (SafetensorsStreamWriter)
_FADV_DONTNEED = getattr(os, "POSIX_FADV_DONTNEED", None) if sys.platform.startswith("linux") else None


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
        self._written = self._flushed = 8 + len(raw)

    def write(self, name: str, tensor: torch.Tensor) -> int:
        exp_name, shape, dtype = self._order[self._next]
        if name != exp_name:
            raise CheckpointError(f"{self.path}: tensor {name} written out of order (expected {exp_name})")
        if tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise CheckpointError(f"{self.path}: tensor {name} is {tuple(tensor.shape)} {tensor.dtype}, "
                                  f"declared {shape} {dtype}")
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
        self._f.write(memoryview(data))
        self._written += data.nbytes
        if self._written - self._flushed >= WRITEBACK_BYTES:
            self._start_writeback()
        self._next += 1
        return self._sizes[name]

    def _start_writeback(self) -> None:
        """Have the kernel start writing what was written so far to disk, now, without waiting for
        it: dirty pages otherwise sit in memory until the kernel's thresholds (gigabytes, or 5-30
        s), and the final fsync then writes them all while the disk was idle before. Linux's
        POSIX_FADV_DONTNEED starts asynchronous writeback of the range (and drops what is clean)."""
        if _FADV_DONTNEED is None:
            return
        self._f.flush()
        try:
            os.posix_fadvise(self._f.fileno(), self._flushed, self._written - self._flushed, _FADV_DONTNEED)
        except OSError:
            pass
        self._flushed = self._written

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
                dtype: torch.dtype, identity: "FileIdentity | None" = None) -> torch.Tensor:
    """Read one tensor's byte range [begin, end) into memory of its own.

    safetensors' get_tensor maps the whole file: every page a merge reads stays resident in the
    process, so its RSS grows to the size of all inputs. Reading each tensor's byte range into a
    private buffer keeps RSS bounded by the tensors alive; the page cache still serves repeats.
    identity: the file as it was opened; a file replaced or rewritten since is refused (checked on
    the open descriptor after the read, so the bytes returned are from the file that was checked).
    """
    out = torch.empty(shape, dtype=dtype)  # uninitialized: the read fills every byte
    read_tensor_into(file, data_start, begin, end, out, identity)
    return out


def read_tensor_into(file: Path, data_start: int, begin: int, end: int, out: torch.Tensor,
                     identity: "FileIdentity | None" = None) -> None:
    """Read the byte range [begin, end) into `out`, a contiguous CPU tensor of exactly that many
    bytes (a slot of a stacked output, a pooled buffer): no intermediate copy. Checks as read_tensor."""
    if not (out.is_contiguous() and out.device.type == "cpu" and out.numel() * out.element_size() == end - begin):
        raise ValueError(f"{file}: read_tensor_into needs a contiguous CPU tensor of {end - begin} bytes")
    if end == begin:
        return
    view = memoryview(out.view(-1).view(torch.uint8).numpy())
    with open(file, "rb", buffering=0) as f:
        f.seek(data_start + begin)
        got = 0
        while got < len(view):
            n = f.readinto(view[got:])
            if not n:
                raise CheckpointError(f"{file}: truncated while reading tensor bytes {begin}-{end}")
            got += n
        if identity is not None:
            identity.check(os.fstat(f.fileno()), file)


@dataclass(frozen=True)
class FileIdentity:
    """What a file was when it was opened: device, inode, size, modification and change times.
    ctime changes with every write and cannot be set back (touch sets mtime only), so a file
    rewritten in place, even to the same size and mtime, no longer matches."""

    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> "FileIdentity":
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def check(self, st: os.stat_result, file: Path) -> None:
        now = FileIdentity.of(st)
        if now != self:
            what = "replaced" if (now.dev, now.ino) != (self.dev, self.ino) else "modified"
            raise CheckpointError(f"{file}: {what} while it was being read (size {self.size:,} -> {now.size:,} "
                                  "bytes); nothing was written from it, run again once it is stable")

    def check_path(self, file: Path) -> None:
        self.check(os.stat(file), file)


# ---- the header, validated --------------------------------------------------------------------
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit
_PACKED = {"F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}  # bits per element of the sub-byte floats torch cannot hold
_U64 = 2**64


@dataclass(frozen=True)
class Header:
    metadata: dict[str, str]
    entries: dict[str, dict]  # name -> {"dtype", "shape", "data_offsets"}, validated
    data_start: int  # 8 + header length
    data_end: int  # data_start + the last tensor's end offset


def read_header(file: Path, f, size: int) -> Header:
    """Parse and validate the header of an open safetensors file of `size` bytes, the way
    safetensors does and a little stricter, with one-line messages that say what is wrong:

    * the length prefix fits the file and safetensors' 100 MB limit; the header is UTF-8 JSON (an
      object, no duplicate keys, no NaN, no 5000-digit integers, not nested past recursion);
    * `__metadata__` maps strings to strings; every tensor has a known dtype, a shape of
      non-negative integers and data_offsets [begin, end] with end - begin = its byte size;
    * the tensors tile the data area from 0 with neither gaps nor overlaps;
    * a size or offset past 2**64 is reported as that (a corrupt header), not as a short file;
      only a consistent header over fewer bytes than it promises is "truncated".
    """
    def bad(msg: str) -> CheckpointError:
        return CheckpointError(f"{file}: unreadable safetensors header: {msg}")

    head = f.read(8)
    if len(head) < 8:
        raise CheckpointError(f"{file}: not a safetensors file ({size} bytes, less than the 8-byte length prefix)")
    n = struct.unpack("<Q", head)[0]
    if n > MAX_HEADER_BYTES:
        raise bad(f"its length prefix says {n:,} bytes, past safetensors' limit of {MAX_HEADER_BYTES:,} "
                  "(not a safetensors file, or a corrupt one)")
    if 8 + n > size:
        raise CheckpointError(f"{file}: truncated: the header alone needs {8 + n:,} bytes, the file has {size:,}")
    header = parse_json(f.read(n), f"{file}: unreadable safetensors header", expect=dict, unique_keys=True)
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise bad("__metadata__ must map strings to strings")
    spans = sorted(_span(file, name, entry) for name, entry in header.items())
    at = 0
    for begin, end, name in spans:
        if begin != at:
            raise bad(f"tensor {printable(name)} starts at byte {begin} of the data, expected {at} "
                      f"({'a gap' if begin > at else 'overlapping the tensor before'})")
        at = end
    data_start = 8 + n
    if data_start + at > size:
        end, cut = next((end, name) for _, end, name in spans if data_start + end > size)
        raise CheckpointError(f"{file}: truncated: tensor {printable(cut)} ends at byte {data_start + end} but the "
                              f"file has {size} bytes (header promises {data_start + at})")
    if data_start + at < size:
        raise bad(f"the file has {size - data_start - at:,} bytes after its last tensor (a corrupt or appended file)")
    return Header(metadata, header, data_start, data_start + at)


def _span(file: Path, name: str, entry) -> tuple[int, int, str]:
    """(begin, end, name) of one header entry, checked: dtype, shape, offsets, size."""
    def bad(msg: str) -> CheckpointError:
        return CheckpointError(f"{file}: unreadable safetensors header: tensor {printable(name)} {msg}")

    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise bad("must have exactly dtype, shape and data_offsets")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or (dtype not in SAFETENSORS_DTYPES and dtype not in _PACKED):
        raise bad(f"has unknown dtype {printable(str(dtype)[:40])!r}")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise bad(f"has shape {printable(str(shape)[:80])}, not a list of integers >= 0")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)):
        raise bad(f"has data_offsets {printable(str(offsets)[:80])}, not [begin, end]")
    begin, end = offsets
    bits = 8 * SAFETENSORS_DTYPES[dtype].itemsize if dtype in SAFETENSORS_DTYPES else _PACKED[dtype]
    numel = math.prod(shape)
    if numel * bits >= 8 * _U64 or end >= _U64:
        raise CheckpointError(f"{file}: corrupt safetensors header: tensor {printable(name)} ({shape} {dtype}, "
                              f"offsets {offsets}) overflows 64-bit sizes; this is not a truncated file")
    if numel * bits % 8 or end - begin != numel * bits // 8:
        raise bad(f"is {shape} {dtype} ({numel * bits / 8:g} bytes) but its data_offsets [{begin}, {end}] span "
                  f"{end - begin} bytes")
    return begin, end, name


def _is_count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


class SafetensorsFile:
    """One safetensors file: header validated and parsed once, tensors read into private buffers.

    Every reader of this project (canonical, HF, Mixtral, HF BAM exports) opens its files through
    this class, so the error messages and the bounded-RSS reading (`read_tensor`) are the same
    everywhere. `meta[key]` is (shape, dtype); `metadata` the header's string map; `identity` the
    file as opened (every read checks the file is still that one).
    """

    def __init__(self, file: Path):
        self.file = Path(file)
        if not self.file.is_file():
            raise CheckpointError(f"{self.file}: file not found")
        with open(self.file, "rb") as f:
            st = os.fstat(f.fileno())
            header = read_header(self.file, f, st.st_size)
        self.identity = FileIdentity.of(st)
        self.metadata: dict[str, str] = dict(header.metadata)
        self.entries: dict[str, dict] = header.entries
        self.data_start = header.data_start
        self.meta: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        for k, v in header.entries.items():
            if v["dtype"] not in SAFETENSORS_DTYPES:
                raise CheckpointError(f"{self.file}: tensor {printable(k)} has dtype {v['dtype']}, which has no torch "
                                      f"dtype to read it into (readable: {', '.join(SAFETENSORS_DTYPES)})")
            self.meta[k] = (tuple(v["shape"]), SAFETENSORS_DTYPES[v["dtype"]])

    def keys(self) -> list[str]:
        return list(self.entries)

    def get(self, key: str) -> torch.Tensor:
        begin, end = self.entries[key]["data_offsets"]
        shape, dtype = self.meta[key]
        return read_tensor(self.file, self.data_start, begin, end, shape, dtype, self.identity)

    def read_into(self, key: str, out: torch.Tensor) -> None:
        """Tensor `key` read straight into `out` (contiguous, its shape and dtype)."""
        begin, end = self.entries[key]["data_offsets"]
        shape, dtype = self.meta[key]
        if tuple(out.shape) != shape or out.dtype != dtype:
            raise ValueError(f"{self.file}: tensor {key} is {shape} {dtype}, read into {tuple(out.shape)} {out.dtype}")
        read_tensor_into(self.file, self.data_start, begin, end, out, self.identity)


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
