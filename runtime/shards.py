"""The one shard writer: tensors streamed into size-bounded safetensors files, plus the index, and the one
reader of a model folder's index and side files.

    model-00001-of-0000N.safetensors ...      (or one file with the format's single-file name)
    model.safetensors.index.json              {"metadata": {"total_size": ..., ...}, "weight_map": {name: file}}

Every directory output (canonical checkpoints, merges, HF, Mixtral and HF BAM exports) is written
by `write_shards`; the formats differ only in the file names, the per-file metadata and whether
they write an index for a single shard, which the caller says.

Importing this module imports no torch (the writer's modules load when a file is written), so the console entry
reads a merge's shard index here (`read_index`) while torch is still being imported.
"""
from __future__ import annotations

import itertools
import json
import os
from contextlib import contextmanager
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import TYPE_CHECKING, BinaryIO, Callable, Iterator, Mapping

from .errors import CheckpointError, printable
from .jsonfile import MAX_JSON_BYTES, open_regular, read_json

if TYPE_CHECKING:  # annotations only: the writer's modules import torch
    import torch

    from .safetensors_file import Entry

INDEX_NAME = "model.safetensors.index.json"


def plan_shards(entries: list[Entry], max_shard_bytes: int | None) -> list[list[Entry]]:
    """Split entries (in order) into shards of at most max_shard_bytes (a single bigger tensor gets its own)."""
    from .dtypes import nbytes  # lazy: torch (the module docstring)
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


def write_file(path: Path, entries: list[Entry], tensors: Iterator[tuple[str, torch.Tensor]],
               metadata: Mapping[str, str] | None = None, on_write: Callable[[str], None] | None = None) -> None:
    """One safetensors file: the next len(entries) (name, tensor) pairs of `tensors`, in entries' order."""
    from .safetensors_file import SafetensorsStreamWriter  # lazy: torch (the module docstring)
    with SafetensorsStreamWriter(path, entries, metadata) as writer:
        for name, tensor in itertools.islice(tensors, len(entries)):
            writer.write(name, tensor)
            del tensor  # free it before the next one is taken
            if on_write is not None:
                on_write(name)


def write_shards(directory: Path, entries: list[Entry], tensors: Iterator[tuple[str, torch.Tensor]],
                 max_shard_bytes: int | None, *, file_metadata: Mapping[str, str], single_file: str | None = None,
                 on_write: Callable[[str], None] | None = None) -> dict[str, str]:
    """Write `tensors` ((name, tensor) in entries' order) as shards into `directory`; return the
    weight map {name: file}. single_file: the file name when everything fits one shard (None: the
    shard name model-00001-of-00001.safetensors)."""
    shards = plan_shards(entries, max_shard_bytes)
    weight_map: dict[str, str] = {}
    tensors = iter(tensors)
    for i, shard in enumerate(shards):
        fname = single_file if single_file and len(shards) == 1 else shard_name(i, len(shards))
        write_file(directory / fname, shard, tensors, file_metadata, on_write)
        weight_map.update((name, fname) for name, _, _ in shard)
    return weight_map


def write_index(directory: Path, weight_map: dict[str, str], total_size: int, metadata: Mapping[str, str]) -> None:
    index = {"metadata": {"total_size": total_size, **metadata}, "weight_map": weight_map}
    (directory / INDEX_NAME).write_text(json.dumps(index, indent=2))


def total_size(entries: list[Entry]) -> int:
    from .dtypes import nbytes  # lazy: torch (the module docstring)
    return sum(nbytes(shape, dtype) for _, shape, dtype in entries)


# ---- reading an index -------------------------------------------------------------------------
def read_index(index: Path) -> tuple[dict[str, str], dict[str, str]]:
    """(weight_map {tensor name: shard file name}, metadata {key: str}) of an index file, checked:
    a JSON object whose weight_map maps strings to strings. Shard names are not resolved here
    (shard_path does that)."""
    body = read_json(index, expect=dict)
    weight_map = body.get("weight_map")
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index}: malformed index (weight_map must be an object of tensor name -> file)")
    for name, file in weight_map.items():
        if not isinstance(file, str):
            raise CheckpointError(f"{index}: malformed index (weight_map[{printable(name)!r}] is not a file name)")
    metadata = body.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise CheckpointError(f"{index}: malformed index (metadata must be an object)")
    return dict(weight_map), {str(k): v if isinstance(v, str) else json.dumps(v) for k, v in metadata.items()}


def folder_file(directory: Path, path: Path, what: str) -> Path:
    """`path`, a file of the model folder `directory` (weights or a side file such as tokenizer.json),
    unless it is a symbolic link resolving outside the folder: then a CheckpointError names the file
    and where it points, so that a folder cannot carry /etc/hostname or a private file into an export.

    Kept on purpose, and only this: the Hugging Face hub cache, where every file of
    `models--org--name/snapshots/<rev>/` is a link to `../../blobs/<hash>`. A link is allowed when the
    folder (resolved) lies in such a snapshot and the link resolves to a file directly in that same
    repository folder's `blobs/`. Both paths are compared resolved, so a `blobs` that is itself a link
    elsewhere does not match."""
    try:
        root, target = directory.resolve(), path.resolve()  # a missing file is the caller's to report
    except (OSError, RuntimeError):  # a symlink loop
        target = Path(os.readlink(path)) if path.is_symlink() else path
    else:
        if _inside(root, target):
            return path
    raise _outside(directory, path, what, target)


# The side files a model folder carries besides config and weights (tokenizer, its config and special tokens, the
# chat template, the generation config), copied into every export of it (converters/hf/files.py, app/exports.py)
# and into a canonical checkpoint (runtime/checkpoint.py).
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "vocab.json",
              "merges.txt", "added_tokens.json", "chat_template.jinja", "generation_config.json")


def side_file(directory: Path, name: str) -> Path | None:
    """The side file `name` of a model directory (one of SIDE_FILES), None when absent; a link
    resolving outside the directory is refused (folder_file)."""
    path = directory / name
    if not (path.is_file() or path.is_symlink()):  # a link to nothing is still checked
        return None
    return folder_file(directory, path, name)


def side_files_in(directory: Path) -> list[Path]:
    """The side files (SIDE_FILES) present in a model directory."""
    found = [side_file(directory, n) for n in SIDE_FILES]
    return [p for p in found if p is not None and p.is_file()]


def _inside(root: Path, target: Path) -> bool:
    """Whether the resolved `target` may be read as a file of the resolved folder `root` (folder_file's rule)."""
    return target.is_relative_to(root) or target.parent == _hub_blobs(root)


def _outside(directory: Path, path: Path, what: str, target: Path) -> CheckpointError:
    return CheckpointError(f"{path}: {what} is a symbolic link to {printable(str(target))}, outside the model "
                           f"folder {directory}; a model folder's files are read only from inside it (or from the "
                           "blobs of its Hugging Face cache folder)")


# The most a side file (tokenizer.json, tokenizer.model, merges.txt, README.md, ...) may hold to be copied into
# an export or read: export-gguf's bound on tokenizer.json (runtime.jsonfile.read_json), for every export alike.
MAX_SIDE_FILE_BYTES = MAX_JSON_BYTES


def open_folder_file(path: Path, what: str, folder: Path | None = None) -> BinaryIO:
    """`path`, a file of the model folder `folder` (default: path.parent), opened once and checked after opening,
    the rule of every file read from inside a model folder (side files, a split GGUF's parts, a folder's GGUF): its
    resolved path opened with O_NOFOLLOW (a link put there since fails), the opened descriptor's own path
    (/proc/self/fd) inside the folder by folder_file's rule, a regular file (runtime.jsonfile.open_regular). The
    caller closes the file; errors are one CheckpointError naming it."""
    folder = path.parent if folder is None else folder
    folder_file(folder, path, what)
    root = folder.resolve()
    try:
        f = open_regular(path.resolve(), str(path), flags=os.O_NOFOLLOW)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: {what} not found") from None
    try:
        try:
            real = Path(os.readlink(f"/proc/self/fd/{f.fileno()}"))
        except OSError:  # no /proc: the O_NOFOLLOW open of the resolved path stands alone
            real = None
        if real is not None and not _inside(root, real):
            raise _outside(folder, path, what, real)
    except BaseException:
        f.close()
        raise
    return f


@contextmanager
def open_side_file(path: Path, what: str | None = None, max_bytes: int = MAX_SIDE_FILE_BYTES) -> Iterator[BinaryIO]:
    """The side file `path` of the model folder path.parent, opened once and checked after opening
    (open_folder_file), so that what is read is what was checked (a file swapped for a link between a check and a
    copy cannot bring an outside file in), and at most max_bytes by fstat. Errors are one CheckpointError naming
    it."""
    what = what or path.name
    with open_folder_file(path, what) as f:
        size = os.fstat(f.fileno()).st_size
        if size > max_bytes:
            raise CheckpointError(f"{path}: {size:,} bytes is too large for {what} (the limit of every side file "
                                  f"an export reads or copies is {max_bytes:,} bytes)")
        yield f


def read_side_file(path: Path, what: str | None = None, max_bytes: int = MAX_SIDE_FILE_BYTES) -> bytes:
    """The bytes of a side file (open_side_file), never more than max_bytes read (a file growing meanwhile)."""
    with open_side_file(path, what, max_bytes) as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise CheckpointError(f"{path}: too large for {what or path.name} (limit {max_bytes:,} bytes)")
    return data


def copy_side_file(path: Path, dst: Path) -> None:
    """Copy the side file `path` to `dst` through its one checked descriptor (open_side_file), bounded."""
    with open_side_file(path) as f, open(dst, "wb") as out:
        left = MAX_SIDE_FILE_BYTES + 1
        while left > 0 and (chunk := f.read(min(left, 1 << 20))):
            out.write(chunk)
            left -= len(chunk)
    if left <= 0:
        raise CheckpointError(f"{path}: too large for {path.name} (limit {MAX_SIDE_FILE_BYTES:,} bytes)")


def _hub_blobs(root: Path) -> Path | None:
    """The blobs folder of the hub cache repository whose snapshot holds the resolved folder `root`
    (the snapshot itself or a subfolder of it), else None."""
    for folder in (root, *root.parents):
        if folder.parent.name == "snapshots" and folder.parent.parent.name.startswith("models--"):
            return folder.parent.parent / "blobs"
    return None


def shard_path(directory: Path, name: str, index: Path) -> Path:
    """The shard file `name` (from `index`) inside `directory`. Refused, naming the entry: an
    absolute name, a `..` component, or a name whose folder resolves (following symlinks) outside
    `directory`. The file itself may be a symlink only as folder_file allows: to a file inside the
    folder, or in the Hugging Face cache, where every file of a snapshot links to a blob two folders up."""
    parts = PurePosixPath(name).parts
    bad = (not name or "\x00" in name or PurePosixPath(name).is_absolute() or PureWindowsPath(name).is_absolute()
           or bool(PureWindowsPath(name).drive) or ".." in parts or ".." in PureWindowsPath(name).parts)
    path = directory / name
    if not bad:
        try:
            bad = not path.parent.resolve().is_relative_to(directory.resolve())
        except (OSError, RuntimeError):  # a symlink loop
            bad = True
    if bad:
        raise CheckpointError(f"{index}: shard {printable(name)!r} is outside the model folder {directory}; an "
                              "index may only name files inside its own folder")
    return folder_file(directory, path, "a shard")
