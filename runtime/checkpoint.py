"""Canonical checkpoint format: safetensors with the config JSON in the file's metadata.

    mix.safetensors                 one file; metadata["bam_config"] is ModelConfig.to_json()
    mix/                            HF-style directory:
        config.json                 {"bam_config": {...}, "format": "bam-surgery/1"}
        model-00001-of-0000N.safetensors ...
        model.safetensors.index.json      {"metadata": {...}, "weight_map": {name: file}}
        tokenizer.json ...          the side files the model came with (runtime.shards.SIDE_FILES: tokenizer files,
                                    chat_template.jinja, generation_config.json), as an HF folder holds them

A single file carries the same side files as text in its metadata (SIDE_FILES_KEY: {name: text}); the reader
gives them back as files (`tokenizer_files()`, written once into runtime.cache). A binary side file
(tokenizer.model) fits only a directory.

Writing streams any reader (runtime.reader) tensor by tensor through the one shard writer
(runtime.shards), with a read-ahead thread (runtime.read_ahead); every write goes to a temporary
path renamed into place at the end (runtime.atomic): an interrupted write leaves nothing at the target.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

import torch

from .atomic import atomic_dir, atomic_path
from .cache import cached_texts
from .config import ConfigError, ModelConfig
from .errors import CheckpointError, printable
from .jsonfile import open_regular, parse_json, read_json
from .layout import tensor_shapes
from .outputs import FORMAT
from .read_ahead import iter_tensors
from .reader import Reader, SafetensorsReader, StateReader
from .shards import (INDEX_NAME, SIDE_FILES, read_index, shard_path, side_files_in, total_size, write_file, write_index,
                     write_shards)

CONFIG_KEY = "bam_config"
PROVENANCE_KEY = "bam_provenance"  # a merge's record of how it was made (surgery.provenance writes it)
SHARD_METADATA = {"format": FORMAT}  # each shard of a canonical directory; the index carries the rest
SIDE_FILES_KEY = "bam_side_files"  # a single file's side files: JSON {name: text}, names from SIDE_FILES



def provenance_inputs(provenance: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """The inputs a provenance record (PROVENANCE_KEY, parsed) names, read by one rule for all its readers (inspect,
    the GGUF card, expert names): a list of entries, each an object (a bare value taken as its path), or an older
    {role: entry or path} object; "inputs" of any other kind (a number, a string) names none."""
    inputs = (provenance or {}).get("inputs")
    if isinstance(inputs, dict):
        return [{**(v if isinstance(v, dict) else {"path": v}), "role": k} for k, v in inputs.items()]
    if isinstance(inputs, list):
        return [i if isinstance(i, dict) else {"path": i} for i in inputs]
    return []


__all__ = ["CONFIG_KEY", "FORMAT", "PROVENANCE_KEY", "SIDE_FILES_KEY", "CheckpointError", "CheckpointReader", "load_checkpoint", "save_checkpoint",
           "write_checkpoint", "write_dir_config"]


class CheckpointReader(SafetensorsReader):
    """Lazy, read-only view of a canonical checkpoint (file or directory); tensors are read on demand.

    One SafetensorsFile per shard (headers only); `get(name)` reads one tensor into its own memory.
    """

    def __init__(self, path: str | os.PathLike):
        super().__init__()
        self.path = Path(path)
        self.metadata: dict[str, str] = {}
        try:
            if self.path.is_dir():
                cfg_file = self.path / "config.json"
                if not cfg_file.exists():
                    if any(self.path.glob("*.gguf")):
                        raise _foreign(self.path, "a folder of GGUF files")
                    raise CheckpointError(f"{self.path}: no config.json")
                body = read_json(cfg_file, expect=dict)
                if CONFIG_KEY not in body:
                    if "model_type" in body:
                        raise _foreign_folder(self.path, body["model_type"])
                    raise CheckpointError(f"{cfg_file}: not a bam-surgery canonical config (no {CONFIG_KEY!r})")
                self.config = ModelConfig.from_dict(body[CONFIG_KEY])
                index = self.path / INDEX_NAME
                if index.exists():
                    weight_map, self.metadata = read_index(index)
                    files = sorted(set(weight_map.values()))
                else:
                    files = sorted(p.name for p in self.path.glob("*.safetensors"))
                for fname in files:
                    self._add(shard_path(self.path, fname, index))
            else:
                if _is_gguf(self.path):
                    raise _foreign(self.path, "a GGUF file")
                h = self._add(self.path)
                self.metadata = dict(h.metadata)
                if CONFIG_KEY not in self.metadata:
                    model_type = _hf_model_type(self.path.parent)
                    if model_type is not None:  # a weight file of an HF folder
                        raise _foreign_folder(self.path.parent, model_type)
                    raise CheckpointError(f"{self.path}: safetensors metadata has no {CONFIG_KEY!r}; "
                                          "not a bam-surgery canonical checkpoint")
                self.config = ModelConfig.from_json(self.metadata[CONFIG_KEY])
        except ConfigError as e:  # an invalid stored config: keep the type, name the file
            where = self.path / "config.json" if self.path.is_dir() else self.path
            raise ConfigError(f"{where}: {e}") from None

    def tokenizer_files(self) -> list[Path]:
        """The side files the checkpoint carries: a directory's own (SIDE_FILES), a single file's from its
        metadata (written once into the cache)."""
        if self.path.is_dir():
            return side_files_in(self.path)
        texts = _embedded_side_files(self.metadata.get(SIDE_FILES_KEY), str(self.path))
        return cached_texts("side-files", texts, str(self.path)) if texts else []


def _embedded_side_files(raw: str | None, where: str) -> dict[str, str]:
    """{name: text} of a single file's SIDE_FILES_KEY: names from SIDE_FILES only, text values; else a
    CheckpointError naming the file."""
    if not raw:
        return {}
    body = parse_json(raw, f"{where}: metadata {SIDE_FILES_KEY}", expect=dict)
    for name, text in body.items():
        if name not in SIDE_FILES or not isinstance(text, str):
            raise CheckpointError(f"{where}: metadata {SIDE_FILES_KEY}: {printable(str(name))[:60]!r} is not a side "
                                  f"file this format carries as text ({', '.join(SIDE_FILES)})")
    return body


def side_files_metadata(side_files: Mapping[str, bytes], where: str) -> dict[str, str]:
    """The metadata entry that carries side files {name: content} in a single file (empty when there are none);
    a binary one (tokenizer.model) is a CheckpointError naming it and the way out: a directory."""
    if not side_files:
        return {}
    texts = {}
    for name, data in side_files.items():
        try:
            texts[name] = data.decode("utf-8")
        except UnicodeDecodeError:
            raise CheckpointError(f"{where}: a single .safetensors file carries side files as text, and {name} is "
                                  "binary; give a directory OUT (no .safetensors suffix) to keep it") from None
    return {SIDE_FILES_KEY: json.dumps(texts, ensure_ascii=False, sort_keys=True)}


def write_side_files(directory: Path, side_files: Mapping[str, bytes]) -> None:
    for name, data in side_files.items():
        (directory / name).write_bytes(data)


def _hf_model_type(folder: Path) -> object | None:
    """The model_type of an HF folder's config.json (None: no such file, or not an HF config)."""
    try:
        body = read_json(folder / "config.json", expect=dict)
    except (OSError, CheckpointError):
        return None
    return body.get("model_type") if CONFIG_KEY not in body else None


def _foreign_folder(folder: Path, model_type: object) -> CheckpointError:
    """An HF folder (an HF model, or our Mixtral / HF BAM export) handed to the canonical reader."""
    return _foreign(folder, f"a Hugging Face model folder (model_type {model_type!r})")


def _foreign(path: Path, what: str) -> CheckpointError:
    """A checkpoint of another kind handed to the canonical reader: one line naming the calls that read it
    (runtime imports nothing from the layers above, so they are only named): bam_surgery.load, the public API's
    door for every checkpoint (the model and its tokenizer), or the reader and the model apart."""
    return CheckpointError(
        f"{path}: {what}, not a bam-surgery canonical checkpoint (load_model and CheckpointReader read only "
        f"those); load it with bam_surgery.load({str(path)!r}) (the model and its tokenizer), or open it with "
        f"bam_surgery.converters.open_checkpoint({str(path)!r}) and build the model with "
        "bam_surgery.runtime.model_from_reader(reader)")


def _is_gguf(path: Path) -> bool:
    """A file that starts with GGUF's magic (or is named .gguf)."""
    if path.suffix.lower() == ".gguf":
        return True
    try:
        with open_regular(path, str(path)) as f:  # a FIFO or a device is not opened blocking
            return f.read(4) == b"GGUF"
    except (OSError, CheckpointError):
        return False  # the reader below says why it cannot read it


def load_checkpoint(path: str | os.PathLike) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    with CheckpointReader(path) as r:
        return r.config, {k: r.get(k) for k in r.names()}


RESERVED_METADATA = ("format", CONFIG_KEY, "total_size", SIDE_FILES_KEY)


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


def write_dir_config(directory: Path, config: ModelConfig, extra: Mapping[str, object] | None = None) -> None:
    body = {"format": FORMAT, CONFIG_KEY: config.to_dict(), **(extra or {})}
    (directory / "config.json").write_text(json.dumps(body, indent=2, sort_keys=True))


def file_metadata(config: ModelConfig, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The metadata of a canonical checkpoint (a single file's header, a directory's index)."""
    return {"format": FORMAT, CONFIG_KEY: config.to_json(), **(extra or {})}


def write_checkpoint(reader: Reader, path: str | os.PathLike, metadata: Mapping[str, str] | None = None,
                     max_shard_bytes: int | None = None, *, replace: bool = True,
                     side_files: Mapping[str, bytes] = {}) -> Path:
    """Stream any reader into a canonical checkpoint, one tensor in memory at a time (plus the
    read-ahead). Tensors are written in canonical layout order, then any others by name.
    replace: an existing `path` may be replaced if it is an output of this tool (runtime.atomic);
    False: an existing path is an OutputError. side_files: {name: content} (names from SIDE_FILES) carried
    beside the weights (a directory) or in the metadata (a single file)."""
    config = reader.config
    check_metadata(metadata)
    layout = tensor_shapes(config)
    names = set(reader.names())
    order = [n for n in layout if n in names] + sorted(names - set(layout))
    entries = [(n, tuple(reader.shape(n)), reader.dtype(n)) for n in order]
    path = Path(path)
    single = path.suffix == ".safetensors"
    meta = file_metadata(config, {**(metadata or {}), **(side_files_metadata(side_files, str(path)) if single else {})})
    if single:
        with atomic_path(path, replace=replace) as tmp:
            write_file(tmp, entries, iter_tensors(reader, order), meta)
        return path
    with atomic_dir(path, replace=replace) as tmp:
        weight_map = write_shards(tmp, entries, iter_tensors(reader, order), max_shard_bytes,
                                  file_metadata=SHARD_METADATA)
        write_index(tmp, weight_map, total_size(entries), meta)
        write_dir_config(tmp, config)
        write_side_files(tmp, side_files)
    return path


def save_checkpoint(state: Mapping[str, torch.Tensor], config: ModelConfig, path: str | os.PathLike,
                    metadata: Mapping[str, str] | None = None, max_shard_bytes: int | None = None) -> Path:
    """Save a canonical checkpoint. `path` ending in .safetensors -> one file; otherwise a directory."""
    return write_checkpoint(StateReader(state, config), path, metadata, max_shard_bytes)
