"""Canonical checkpoint format: safetensors with the config JSON in the file's metadata.

    mix.safetensors                 one file; metadata["bam_config"] is ModelConfig.to_json()
    mix/                            HF-style directory:
        config.json                 {"bam_config": {...}, "format": "bam-surgery"}
        model-00001-of-0000N.safetensors ...
        model.safetensors.index.json      {"metadata": {...}, "weight_map": {name: file}}

Loading never unpickles (safetensors only). Writing streams: `SafetensorsStreamWriter` writes
the header first (all shapes and dtypes are known in advance) and then each tensor's bytes as
it is produced, so a writer never holds more than one tensor. Every write goes to a temporary
path and is renamed into place at the end: an interrupted write leaves nothing at the target.
"""
from __future__ import annotations

import json
import os
import queue
import shutil
import struct
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator, Mapping

import torch
from safetensors import safe_open

from .config import ConfigError, ModelConfig

FORMAT = "bam-surgery/1"
CONFIG_KEY = "bam_config"
INDEX_NAME = "model.safetensors.index.json"

DTYPE_TO_ST = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
ST_TO_DTYPE = {v: k for k, v in DTYPE_TO_ST.items()}
DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
               "float64": torch.float64}


class CheckpointError(ValueError):
    """A checkpoint file is unreadable, truncated or inconsistent; the message names file and tensor."""


def dtype_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def nbytes(shape: Iterable[int], dtype: torch.dtype) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n * dtype_size(dtype)


# ---- atomic paths ---------------------------------------------------------------------------
@contextmanager
def atomic_path(target: str | os.PathLike, is_dir: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling path; rename it onto `target` only if the block succeeds."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent))
    work = tmp if is_dir else tmp / target.name
    try:
        yield work
        if target.exists():
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            else:
                target.unlink()
        os.replace(work, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ---- streaming writer -----------------------------------------------------------------------
class SafetensorsStreamWriter:
    """Write a safetensors file tensor by tensor, in a fixed order declared up front.

    >>> w = SafetensorsStreamWriter(path, [(name, shape, dtype), ...], metadata)
    >>> for name, ... : w.write(name, tensor)   # in declared order
    >>> w.close()
    """

    def __init__(self, path: str | os.PathLike, entries: list[tuple[str, tuple[int, ...], torch.dtype]],
                 metadata: Mapping[str, str] | None = None):
        self.path = Path(path)
        header: dict[str, object] = {}
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        offset = 0
        self._order = []
        self._sizes = {}
        for name, shape, dtype in entries:
            size = nbytes(shape, dtype)
            header[name] = {"dtype": DTYPE_TO_ST[dtype], "shape": [int(s) for s in shape],
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


def iter_tensors(reader, names: list[str], depth: int = 2) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) in order while a background thread computes the next `depth` tensors.

    Reading, the ops and writing all release the GIL, so on two cores the next tensor is read and
    merged while the current one is written. Memory: at most depth + 1 output tensors alive."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def work() -> None:
        try:
            for name in names:
                if stop.is_set():
                    return
                q.put((name, reader.get(name), None))
        except BaseException as e:  # re-raised in the consumer, with its traceback
            q.put((None, None, e))

    thread = threading.Thread(target=work, name="bam-surgery-read-ahead", daemon=True)
    thread.start()
    try:
        for _ in names:
            name, tensor, err = q.get()
            if err is not None:
                raise err
            yield name, tensor
    finally:
        stop.set()
        while thread.is_alive():  # unblock a producer waiting on a full queue
            try:
                q.get_nowait()
            except queue.Empty:
                pass
            thread.join(timeout=0.05)


def plan_shards(entries: list[tuple[str, tuple[int, ...], torch.dtype]], max_shard_bytes: int | None
                ) -> list[list[tuple[str, tuple[int, ...], torch.dtype]]]:
    """Split entries (in order) into shards of at most max_shard_bytes (a single bigger tensor gets its own)."""
    if not max_shard_bytes:
        return [list(entries)]
    shards: list[list] = [[]]
    size = 0
    for e in entries:
        b = nbytes(e[1], e[2])
        if shards[-1] and size + b > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += b
    return shards


def shard_name(i: int, n: int) -> str:
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def write_index(directory: Path, weight_map: dict[str, str], total_size: int, metadata: Mapping[str, str]) -> None:
    index = {"metadata": {"total_size": total_size, **metadata}, "weight_map": weight_map}
    (directory / INDEX_NAME).write_text(json.dumps(index, indent=2))


def write_dir_config(directory: Path, config: ModelConfig, extra: Mapping[str, object] | None = None) -> None:
    body = {"format": FORMAT, CONFIG_KEY: config.to_dict(), **(extra or {})}
    (directory / "config.json").write_text(json.dumps(body, indent=2, sort_keys=True))


# ---- whole-state save / load (small models, tests, training) -------------------------------
class StateReader:
    """An in-memory state dict seen through the reader protocol."""

    def __init__(self, state: Mapping[str, torch.Tensor], config: ModelConfig):
        self.state, self.config, self.path, self.metadata = state, config, None, {}

    def names(self) -> list[str]:
        return list(self.state)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.state[name].shape)

    def dtype(self, name: str) -> torch.dtype:
        return self.state[name].dtype

    def get(self, name: str) -> torch.Tensor:
        return self.state[name]


def save_checkpoint(state: Mapping[str, torch.Tensor], config: ModelConfig, path: str | os.PathLike,
                    metadata: Mapping[str, str] | None = None, max_shard_bytes: int | None = None) -> Path:
    """Save a canonical checkpoint. `path` ending in .safetensors -> one file; otherwise a directory."""
    return write_checkpoint(StateReader(state, config), path, metadata, max_shard_bytes)


def read_tensor(file: Path, data_start: int, entry: Mapping) -> torch.Tensor:
    """Read one tensor (a safetensors header entry) into memory of its own.

    safetensors' get_tensor maps the whole file: every page a merge reads stays resident in the
    process, so its RSS grows to the size of all inputs. Reading each tensor's byte range into a
    private buffer keeps RSS bounded by the tensors alive; the page cache still serves repeats.
    """
    begin, end = entry["data_offsets"]
    dtype, shape = ST_TO_DTYPE[entry["dtype"]], tuple(entry["shape"])
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
        self.meta = {k: (tuple(v["shape"]), ST_TO_DTYPE[v["dtype"]]) for k, v in header.items()}

    def keys(self) -> list[str]:
        return list(self.entries)

    def get(self, key: str) -> torch.Tensor:
        return read_tensor(self.file, self.data_start, self.entries[key])


class ReaderBase:
    """Lifetime part of the reader protocol: `close()` drops open file handles; usable in `with`."""

    _handles: dict

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class CheckpointReader(ReaderBase):
    """Lazy, read-only view of a canonical checkpoint (file or directory); tensors are read on demand.

    One SafetensorsFile per shard (headers only); `get(name)` reads one tensor into its own memory.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._handles: dict[Path, SafetensorsFile] = {}
        self._where: dict[str, Path] = {}
        self.metadata: dict[str, str] = {}
        try:
            if self.path.is_dir():
                index = self.path / INDEX_NAME
                cfg_file = self.path / "config.json"
                if not cfg_file.exists():
                    raise CheckpointError(f"{self.path}: no config.json")
                body = json.loads(cfg_file.read_text())
                if CONFIG_KEY not in body:
                    raise CheckpointError(f"{cfg_file}: not a bam-surgery canonical config (no {CONFIG_KEY!r})")
                self.config = ModelConfig.from_dict(body[CONFIG_KEY])
                if index.exists():
                    idx = json.loads(index.read_text())
                    self.metadata = {k: str(v) for k, v in idx.get("metadata", {}).items()}
                    files = sorted(set(idx["weight_map"].values()))
                else:
                    files = sorted(p.name for p in self.path.glob("*.safetensors"))
                for fname in files:
                    self._open(self.path / fname)
            else:
                h = self._open(self.path)
                self.metadata = dict(h.metadata)
                if CONFIG_KEY not in self.metadata:
                    raise CheckpointError(f"{self.path}: safetensors metadata has no {CONFIG_KEY!r}; "
                                          "not a bam-surgery canonical checkpoint")
                self.config = ModelConfig.from_json(self.metadata[CONFIG_KEY])
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{self.path}: malformed checkpoint metadata ({e})") from e
        except ConfigError as e:  # an invalid stored config: keep the type, name the file
            where = self.path / "config.json" if self.path.is_dir() else self.path
            raise ConfigError(f"{where}: {e}") from None

    def _open(self, file: Path) -> SafetensorsFile:
        h = SafetensorsFile(file)
        self._handles[file] = h
        for k in h.keys():
            self._where[k] = file
        return h

    def names(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def file_of(self, name: str) -> Path:
        return self._where[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return self._handles[self._where[name]].meta[name][0]

    def dtype(self, name: str) -> torch.dtype:
        return self._handles[self._where[name]].meta[name][1]

    def get(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise CheckpointError(f"{self.path}: tensor {name} is missing")
        return self._handles[self._where[name]].get(name)

    def files(self) -> list[Path]:
        return list(self._handles)



def load_checkpoint(path: str | os.PathLike) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    with CheckpointReader(path) as r:
        return r.config, {k: r.get(k) for k in r.names()}


RESERVED_METADATA = ("format", CONFIG_KEY, "total_size")


def check_metadata(metadata: Mapping[str, str] | None) -> None:
    """User metadata may not replace the keys the format itself writes (a file whose "bam_config"
    was replaced would not load); values must be strings, as safetensors stores them."""
    for key, value in (metadata or {}).items():
        if key in RESERVED_METADATA:
            raise CheckpointError(f"metadata key {key!r} is reserved by the checkpoint format "
                                  f"(reserved: {', '.join(RESERVED_METADATA)}); choose another key")
        if not isinstance(key, str) or not isinstance(value, str):
            raise CheckpointError(f"metadata {key!r}: keys and values must be strings, got "
                                  f"{type(value).__name__} (json.dumps it first)")


def write_checkpoint(reader, path: str | os.PathLike, metadata: Mapping[str, str] | None = None,
                     max_shard_bytes: int | None = None) -> Path:
    """Stream any reader (.config, .names(), .shape(), .dtype(), .get()) into a canonical checkpoint,
    one tensor in memory at a time. Tensors are written in canonical layout order."""
    from .layout import tensor_shapes

    config: ModelConfig = reader.config
    check_metadata(metadata)
    names = set(reader.names())
    order = [n for n in tensor_shapes(config) if n in names] + sorted(names - set(tensor_shapes(config)))
    entries = [(n, tuple(reader.shape(n)), reader.dtype(n)) for n in order]
    meta = {"format": FORMAT, CONFIG_KEY: config.to_json(), **(metadata or {})}
    path = Path(path)
    if path.suffix == ".safetensors":
        with atomic_path(path) as tmp, SafetensorsStreamWriter(tmp, entries, meta) as w:
            for n, tensor in iter_tensors(reader, [e[0] for e in entries]):
                w.write(n, tensor)
        return path
    with atomic_path(path, is_dir=True) as tmp:
        tmp.mkdir(parents=True, exist_ok=True)
        shards = plan_shards(entries, max_shard_bytes)
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = shard_name(i, len(shards))
            with SafetensorsStreamWriter(tmp / fname, shard, {"format": FORMAT}) as w:
                for n, tensor in iter_tensors(reader, [e[0] for e in shard]):
                    w.write(n, tensor)
                    weight_map[n] = fname
        write_index(tmp, weight_map, sum(nbytes(s, d) for _, s, d in entries), meta)
        write_dir_config(tmp, config)
    return path
