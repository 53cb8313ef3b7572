"""What this tool wrote, and may therefore replace: the ownership test behind `--force`.

    not_own_output(path)   None if `path` is an output of bam-surgery, else why not (one phrase)

An output is recognised by our own marks, never by file names alone (a folder of someone else's
`.safetensors` models looks like a checkpoint folder):

* a file: a safetensors file whose header metadata says "format": "bam-surgery/1" (what every
  canonical checkpoint carries), or a GGUF file whose first metadata entries say
  "bam_surgery.format": "bam-surgery/1" (converters/gguf_export.py writes it second, after general.architecture);
* a folder: it holds MARKER (written by runtime.atomic into every folder output: canonical
  checkpoints, merges, HF, Mixtral and HF BAM exports) and nothing that marker does not list, each
  a regular file; or, for folders written before the marker existed, a canonical checkpoint
  folder: config.json saying "format": "bam-surgery/1", the index, and safetensors shards that
  each carry that format, nothing else;
* an empty folder (nothing to lose).

Never ours, whatever they hold: the file-system root, the home folder and its parents, the
working directory and its parents, and symbolic links.
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path

from .errors import CheckpointError, printable
from .jsonfile import read_json

FORMAT = "bam-surgery/1"  # "format" in every canonical file's metadata and canonical config.json
MARKER = ".bam-surgery.json"  # in every folder output: {"format": FORMAT, "files": [names]}
GGUF_FORMAT_KEY = "bam_surgery.format"  # in every GGUF file this tool writes, among its first two entries
_MAX_MARKER_BYTES = 1 << 20


def write_marker(directory: Path) -> None:
    """Mark a finished folder output as ours, listing every file in it (called by runtime.atomic
    just before the folder is renamed into place)."""
    names = sorted(n for n in os.listdir(directory) if n != MARKER)
    body = {"format": FORMAT, "written_by": "bam-surgery", "files": names}
    (directory / MARKER).write_text(json.dumps(body, indent=1) + "\n")


def protected(path: Path) -> str | None:
    """Why `path` may never be replaced or removed, whatever it holds (None: not protected)."""
    try:
        resolved = path.resolve()
        cwd = Path.cwd().resolve()
        home = Path.home().resolve()
    except (OSError, RuntimeError):
        return "cannot be resolved"
    if resolved == Path(resolved.anchor):
        return "is the root of the file system"
    if resolved == cwd:
        return "is the working directory"
    if resolved in cwd.parents:
        return "is a parent of the working directory"
    if resolved == home:
        return "is the home folder"
    if resolved in home.parents:
        return "is a parent of the home folder"
    return None


def not_own_output(path: Path) -> str | None:
    """None if `path` (which exists) is an output of this tool; else a phrase saying why not,
    e.g. "holds notes.txt, which bam-surgery did not write"."""
    path = Path(path)
    reason = protected(path)
    if reason:
        return reason
    if path.is_symlink():
        return "is a symbolic link"
    if path.is_file():
        if _own_safetensors(path) or _own_gguf(path):
            return None
        return "is a file bam-surgery did not write (no \"format\": \"bam-surgery/1\" in its metadata)"
    if path.is_dir():
        return _folder_reason(path)
    return "is neither a regular file nor a folder"


def _own_safetensors(file: Path) -> bool:
    try:
        with open(file, "rb") as f:
            from .safetensors_file import read_header  # lazy: torch (runtime/cache.py -> atomic -> here is torch-free)
            header = read_header(file, f, os.fstat(f.fileno()).st_size)
    except (CheckpointError, OSError):
        return False
    return header.metadata.get("format") == FORMAT


def _own_gguf(file: Path) -> bool:
    """A GGUF file (llama.cpp's format) whose first two metadata entries include GGUF_FORMAT_KEY = FORMAT; read
    with struct from the file's first 64 KiB (magic, version, counts, then key/type/value entries)."""
    try:
        with open(file, "rb") as f:
            head = f.read(1 << 16)
    except OSError:
        return False
    if head[:4] != b"GGUF":
        return False

    def string(pos: int) -> tuple[bytes, int]:
        (n,) = struct.unpack_from("<Q", head, pos)
        if pos + 8 + n > len(head):
            raise ValueError("past the bytes read")
        return head[pos + 8:pos + 8 + n], pos + 8 + n

    try:
        _, _, n_kv = struct.unpack_from("<IQQ", head, 4)
        pos = 24
        for _ in range(min(n_kv, 2)):
            key, pos = string(pos)
            (value_type,) = struct.unpack_from("<I", head, pos)
            if value_type != 8:  # both entries are strings
                return False
            value, pos = string(pos + 4)
            if key == GGUF_FORMAT_KEY.encode():
                return value == FORMAT.encode()
    except (struct.error, ValueError):
        return False
    return False


def _folder_reason(folder: Path) -> str | None:
    try:
        entries = sorted(os.listdir(folder))
    except OSError as e:
        return f"cannot be listed ({e.strerror})"
    if not entries:
        return None
    for name in entries:
        p = folder / name
        if p.is_symlink() or not p.is_file():
            return f"holds {printable(name)}, which is not a regular file bam-surgery wrote"
    if MARKER in entries:
        try:
            body = read_json(folder / MARKER, expect=dict, error=ValueError, max_bytes=_MAX_MARKER_BYTES)
            listed = set(body["files"]) if body.get("format") == FORMAT else None
        except (OSError, ValueError, TypeError, KeyError, AttributeError, RecursionError):
            listed = None
        if listed is None:
            return f"holds a {MARKER} that is not bam-surgery's"
        foreign = [n for n in entries if n != MARKER and n not in listed]
        return f"holds {printable(foreign[0])}, which bam-surgery did not write" if foreign else None
    return _legacy_canonical_reason(folder, entries)


def _legacy_canonical_reason(folder: Path, entries: list[str]) -> str | None:
    """A canonical checkpoint folder written before folders carried the marker."""
    try:
        body = read_json(folder / "config.json", error=ValueError) if "config.json" in entries else None
    except (OSError, ValueError, RecursionError):
        body = None
    if not (isinstance(body, dict) and body.get("format") == FORMAT):
        return f"is a folder bam-surgery did not write (no {MARKER}; it holds {printable(entries[0])})"
    for name in entries:
        if name in ("config.json", "model.safetensors.index.json"):
            continue
        if not _own_safetensors(folder / name):
            return f"holds {printable(name)}, which bam-surgery did not write"
    return None
