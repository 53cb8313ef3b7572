"""A GGUF file's header, metadata and tensor directory, parsed and checked against the file before anything trusts them.

    parsed = parse_gguf(Path("model.gguf"))      # GGUFFile: version, fields {key: value}, tensors [TensorInfo]
    parsed.fields["general.architecture"]        # "llama"
    parsed.tensors[0].name, .shape, .qtype, .start, .nbytes

gguf.GGUFReader trusts the counts a file declares (it allocates and loops over them); a hostile or truncated file
must instead get one line, fast, in bounded memory. So every count, length and offset is checked against the bytes
that are left before it is used: a string or array longer than the rest of the file, more key-value pairs or tensors
than the file could hold, a value or tensor type the format does not define, a tensor that runs past the end of the
file or overlaps another, an unaligned offset, a duplicate key or tensor name: each a CheckpointError naming the
file and the key or tensor. The metadata (everything before the tensor data) is bounded by MAX_METADATA_BYTES, one
string by MAX_STRING_BYTES, nesting by arrays of arrays is refused (llama.cpp writes none). Reading is through one
read-only memory map; values are decoded with struct and numpy (numeric arrays in one call).

Split files (`NAME-00001-of-0000N.gguf`, llama.cpp's gguf-split): `split_files` finds the N parts from any one of
them; each part is a GGUF file of its own (the first holds the metadata, split.count / split.no say where a part
stands).
"""
from __future__ import annotations

import mmap
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from bam_surgery.runtime.errors import CheckpointError, printable
from bam_surgery.runtime.jsonfile import open_regular
from bam_surgery.runtime.shards import open_folder_file

from .gguf_metadata import INTEGER, metadata_value
from .gguf_table import gguf_module

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # version 1 had 32-bit counts and is gone from llama.cpp
DEFAULT_ALIGNMENT = 32
MAX_METADATA_BYTES = 1 << 28  # header, key-value pairs and the tensor directory together
MAX_STRING_BYTES = 1 << 24  # one string (chat templates run to tens of KiB)
MAX_FIELDS = 1 << 16  # key-value pairs (llama.cpp's files hold under a hundred)
MAX_TENSORS = 1 << 16  # tensors of one file (the largest models hold about 1,500)
MAX_ARRAY_STRINGS = 1 << 21  # strings in all arrays together (the largest tokenizers: about 600,000 tokens and merges)
MAX_NAME_BYTES = 64  # llama.cpp's GGML_MAX_NAME, terminating NUL included: names of at most 63 bytes
MAX_DIMS = 4  # GGML_MAX_DIMS
SPLIT = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")

# GGUFValueType: code -> (name, struct format or None for string / array)
_SCALARS = {0: ("uint8", "<B"), 1: ("int8", "<b"), 2: ("uint16", "<H"), 3: ("int16", "<h"), 4: ("uint32", "<I"),
            5: ("int32", "<i"), 6: ("float32", "<f"), 7: ("bool", "<?"), 10: ("uint64", "<Q"), 11: ("int64", "<q"),
            12: ("float64", "<d")}
STRING, ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy / torch order (GGUF lists the innermost dimension first)
    qtype: int  # gguf.GGMLQuantizationType value
    start: int  # absolute byte offset in the file
    nbytes: int


@dataclass
class GGUFFile:
    path: Path
    version: int
    fields: dict[str, Any]  # strings, ints, floats, bools; lists of strings; numpy arrays of numbers and bools
    types: dict[str, tuple[int, int | None]]  # key -> (value type, array item type or None)
    tensors: list[TensorInfo]
    data_start: int
    size: int
    stat: os.stat_result  # of the descriptor parsed (FileIdentity: the file read later must be this one)


class _Cursor:
    """Bounded little-endian reads from a buffer; every read checks the bytes left."""

    def __init__(self, buf, path: Path, limit: int):
        self.buf, self.path, self.pos, self.limit = buf, path, 0, limit
        self.strings_left = MAX_ARRAY_STRINGS  # strings the file's arrays may still hold

    def fail(self, what: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: {what}")

    def take(self, n: int, what: str) -> int:
        if n < 0 or self.pos + n > self.limit:
            left = self.limit - self.pos
            raise self.fail(f"{what} needs {n:,} bytes at offset {self.pos:,} but only {left:,} are left "
                            "(truncated or corrupt GGUF)")
        start = self.pos
        self.pos += n
        return start

    def unpack(self, fmt: str, what: str):
        return struct.unpack_from(fmt, self.buf, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str, max_bytes: int = MAX_STRING_BYTES) -> str:
        n = self.unpack("<Q", f"the length of {what}")
        if n > max_bytes:
            raise self.fail(f"{what} is {n:,} bytes long (at most {max_bytes:,})")
        start = self.take(n, what)
        try:
            return bytes(self.buf[start:start + n]).decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not UTF-8") from None

    def strings(self, count: int, what: str) -> list[str]:
        """`count` strings in a row (an array's items), checked as `string` checks one, in one tight loop (a
        tokenizer's 500,000 strings); an item that fails is read again by `string`, whose message names it."""
        buf, limit, length = self.buf, self.limit, _LENGTH.unpack_from
        pos, out = self.pos, []
        for i in range(count):
            n = length(buf, pos)[0] if pos + 8 <= limit else -1
            end = pos + 8 + n
            text = None
            if 0 <= n <= MAX_STRING_BYTES and end <= limit:
                try:
                    text = str(buf[pos + 8:end], "utf-8")
                except UnicodeDecodeError:
                    pass
            if text is None:
                self.pos = pos
                self.string(f"{what}[{i}]")  # raises, naming the item
            out.append(text)
            pos = end
        self.pos = pos
        return out


_LENGTH = struct.Struct("<Q")


def _value(cur: _Cursor, vtype: int, key: str, nested: bool = False) -> tuple[Any, int | None]:
    what = f"key {printable(key)}"
    if vtype in _SCALARS:
        value = cur.unpack(_SCALARS[vtype][1], what)
        if vtype == 6:  # float32 as the shortest decimal that rounds to it (1e-06, not 9.99999997e-07)
            value = float(str(np.float32(value)))
        return value, None
    if vtype == STRING:
        return cur.string(what), None
    if vtype == ARRAY and not nested:
        itype = cur.unpack("<I", f"{what}'s array type")
        count = cur.unpack("<Q", f"{what}'s array length")
        if itype in _SCALARS:
            size = struct.calcsize(_SCALARS[itype][1])
            start = cur.take(count * size if count <= cur.limit else cur.limit + 1, f"{what}'s {count:,} values")
            values = np.frombuffer(cur.buf, dtype=np.dtype(_SCALARS[itype][1]), count=count, offset=start)
            return values.copy(), itype  # a numpy array of its own (the map closes after parsing)
        if itype == STRING:
            if count * 8 > cur.limit - cur.pos:  # every string takes at least its 8-byte length
                raise cur.fail(f"{what} declares {count:,} strings, more than the {cur.limit - cur.pos:,} bytes left "
                               "could hold (truncated or corrupt GGUF)")
            if count > cur.strings_left:
                raise cur.fail(f"{what} declares {count:,} strings; the arrays of a file may hold "
                               f"{MAX_ARRAY_STRINGS:,} strings in all (the largest tokenizers: about 600,000)")
            cur.strings_left -= count
            return cur.strings(count, what), itype
        if itype == ARRAY:
            raise cur.fail(f"{what} is an array of arrays, which no GGUF model carries")
        raise cur.fail(f"{what}'s array has unknown value type {itype}")
    raise cur.fail(f"{what} has unknown value type {vtype}")


def _quant_sizes() -> dict[int, tuple[int, int]]:
    return {int(k): v for k, v in gguf_module().GGML_QUANT_SIZES.items()}


def open_gguf(path: Path, folder: Path | None = None) -> BinaryIO:
    """The GGUF file `path` opened once: by the folder rule of every weight file when it was found inside the model
    folder `folder` (runtime.shards.open_folder_file), else as the regular file the user named. The caller closes
    it."""
    if folder is not None:
        return open_folder_file(path, "a GGUF file of the model", folder)
    try:
        return open_regular(path, str(path))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such file") from None


def parse_gguf(path: Path, folder: Path | None = None) -> GGUFFile:
    """The file's header, metadata and tensor directory, checked (module docstring); `folder`: the model folder it
    was found in (open_gguf)."""
    try:
        with open_gguf(path, folder) as f:
            st = os.fstat(f.fileno())
            if st.st_size < 24:
                raise CheckpointError(f"{path}: {st.st_size} bytes, too short for a GGUF header (truncated?)")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _parse(path, buf, st)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e})") from None


def _parse(path: Path, buf, st: os.stat_result) -> GGUFFile:
    size = st.st_size
    cur = _Cursor(buf, path, min(size, MAX_METADATA_BYTES))
    if bytes(buf[:4]) != MAGIC:
        raise CheckpointError(f"{path}: not a GGUF file (magic {bytes(buf[:4])!r}, expected {MAGIC!r})")
    cur.pos = 4
    version = cur.unpack("<I", "the version")
    if version not in VERSIONS:
        raise CheckpointError(f"{path}: GGUF version {version}; this reader takes versions "
                              f"{', '.join(map(str, VERSIONS))}")
    n_tensors = cur.unpack("<Q", "the tensor count")
    n_fields = cur.unpack("<Q", "the key-value count")
    left = cur.limit - cur.pos
    if n_fields > MAX_FIELDS or n_tensors > MAX_TENSORS:
        raise CheckpointError(f"{path}: declares {n_fields:,} key-value pairs and {n_tensors:,} tensors; a GGUF file "
                              f"this reader takes holds at most {MAX_FIELDS:,} of each (llama.cpp's hold under a "
                              "hundred key-value pairs and a few thousand tensors)")
    if n_fields * 13 > left or n_tensors * 24 > left:  # the smallest pair / tensor entry takes 13 / 24 bytes
        raise CheckpointError(f"{path}: declares {n_fields:,} key-value pairs and {n_tensors:,} tensors, more than "
                              f"the {left:,} bytes of metadata could hold (corrupt or hostile GGUF)")
    fields: dict[str, Any] = {}
    types: dict[str, tuple[int, int | None]] = {}
    for i in range(n_fields):
        key = cur.string(f"key #{i}", MAX_STRING_BYTES)
        if key in fields:
            raise CheckpointError(f"{path}: key {printable(key)} appears twice")
        vtype = cur.unpack("<I", f"key {printable(key)}'s type")
        fields[key], itype = _value(cur, vtype, key)
        types[key] = (vtype, itype)
    alignment = metadata_value(fields, "general.alignment", INTEGER, DEFAULT_ALIGNMENT, low=1, high=1 << 20,
                               where=str(path))
    if alignment & (alignment - 1):
        raise CheckpointError(f"{path}: general.alignment is {alignment}, expected a power of two up to 2**20")
    sizes = _quant_sizes()
    raw = []
    for i in range(n_tensors):
        name = cur.string(f"tensor #{i}'s name", MAX_NAME_BYTES - 1)
        where = f"tensor {printable(name)}"
        n_dims = cur.unpack("<I", f"{where}'s dimension count")
        if not 1 <= n_dims <= MAX_DIMS:
            raise CheckpointError(f"{path}: {where} has {n_dims} dimensions (1 to {MAX_DIMS})")
        dims = [cur.unpack("<Q", f"{where}'s dimensions") for _ in range(n_dims)]
        qtype = cur.unpack("<I", f"{where}'s type")
        offset = cur.unpack("<Q", f"{where}'s offset")
        raw.append((name, dims, qtype, offset))
    data_start = -(-cur.pos // alignment) * alignment
    tensors = _tensors(path, raw, data_start, size, alignment, sizes)
    return GGUFFile(path, version, fields, types, tensors, data_start, size, st)


def _tensors(path: Path, raw: list, data_start: int, size: int, alignment: int,
             sizes: dict[int, tuple[int, int]]) -> list[TensorInfo]:
    """The tensor directory's entries, each checked against the file: known type, dimensions, aligned data inside the
    file, no name twice, no overlap."""
    tensors, seen = [], set()
    for name, dims, qtype, offset in raw:
        where = f"{path}: tensor {printable(name)}"
        if name in seen:
            raise CheckpointError(f"{where} appears twice")
        seen.add(name)
        if qtype not in sizes:
            raise CheckpointError(f"{where} has unknown type {qtype}")
        block, type_size = sizes[qtype]
        if any(d < 1 or d > size for d in dims) or dims[0] % block:
            raise CheckpointError(f"{where} has dimensions {dims} (each from 1 to the file's size; the first a "
                                  f"multiple of {block} for its type)")
        elements = int(np.prod(dims, dtype=object))
        nbytes = elements // block * type_size
        start = data_start + offset
        if offset % alignment or start + nbytes > size:
            raise CheckpointError(f"{where}: its {nbytes:,} bytes at offset {offset:,} lie "
                                  f"{'unaligned' if offset % alignment else 'past the end of the file'} "
                                  f"({size:,} bytes, data from {data_start:,}; truncated or corrupt GGUF)")
        tensors.append(TensorInfo(name, tuple(reversed(dims)), qtype, start, nbytes))
    previous = None
    for t in sorted(tensors, key=lambda t: t.start):
        if previous is not None and t.start < previous.start + previous.nbytes:
            raise CheckpointError(f"{path}: tensor {printable(t.name)} overlaps tensor {printable(previous.name)}")
        previous = t
    return tensors


def split_files(path: Path) -> list[Path]:
    """The parts of a split GGUF (any part names them all), else [path]. Missing parts: CheckpointError."""
    m = SPLIT.match(path.name)
    if m is None:
        return [path]
    count = int(m.group("count"))
    if count < 1 or int(m.group("no")) > count:
        raise CheckpointError(f"{path}: part {int(m.group('no'))} of {count} is not a split GGUF name")
    parts = [path.with_name(f"{m.group('stem')}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [p for p in parts if not p.is_file()]
    if missing:
        raise CheckpointError(f"{missing[0]}: part of the split GGUF {path.name} is missing")
    return parts
