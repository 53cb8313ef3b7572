"""The reader protocol: any checkpoint, whatever its format, seen under canonical tensor names.

Everything that reads weights (merges, exports, audits, the model loader) takes a `Reader`. Opening
one reads headers only; `get(name)` reads that one tensor. Required of every reader:

    config                     ModelConfig
    names(), shape(n), dtype(n), get(n), n in reader

Optional parts have explicit defaults here, so callers never probe for them:

    read_into(n, out) tensor n written into `out` (its shape and dtype; a slot of a stacked
                    output, a pooled buffer): a safetensors-backed reader reads the file's bytes
                    straight into it, the default copies get(n)

    path            where it was opened from (None: in memory, or a merge plan)
    metadata        string map stored with the checkpoint (provenance, source format)
    file_of(n)      the file holding tensor n (None: not in a file, or unknown)
    files()         every file the reader reads (hashed into provenance, guarded from overwrites)
    source_dir      the Hugging Face model directory it came from (tokenizer, generation config)
    hf_config       that directory's config.json body
    architecture    its HF model_type (llama, mixtral, ...), for exporting back to it
    tokenizer_files() the tokenizer files next to the weights
    check_unchanged() raise if a file was modified or replaced since it was opened
    close()         drop open files; readers are context managers

Readers: CheckpointReader (canonical), converters' HFCheckpointReader (HF architectures, Mixtral
included), BamHFReader (HF BAM exports) and GGUFCheckpointReader (GGUF files), surgery's PlanReader (a merge plan, computed on
demand), and StateReader below (a state dict in memory).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from types import MappingProxyType
from typing import Any, Collection, Mapping

import torch

from .config import ModelConfig
from .dtypes import dtype_name
from .errors import CheckpointError
from .layout import Shape, layout_mismatches, tensor_shapes
from .safetensors_file import SafetensorsFile


class Reader(ABC):
    """Base of every reader (see the module docstring for the protocol)."""

    config: ModelConfig
    path: Path | None = None
    metadata: Mapping[str, str] = MappingProxyType({})
    source_dir: Path | None = None
    hf_config: Mapping[str, Any] | None = None
    architecture: str | None = None

    @abstractmethod
    def names(self) -> list[str]: ...

    @abstractmethod
    def shape(self, name: str) -> tuple[int, ...]: ...

    @abstractmethod
    def dtype(self, name: str) -> torch.dtype: ...

    @abstractmethod
    def get(self, name: str) -> torch.Tensor: ...

    def __contains__(self, name: str) -> bool:
        return name in self.names()

    def read_into(self, name: str, out: torch.Tensor) -> None:
        out.copy_(self.get(name))

    def file_of(self, name: str) -> Path | None:
        return None

    def files(self) -> list[Path]:
        return []

    def tokenizer_files(self) -> list[Path]:
        return []

    def check_unchanged(self) -> None:
        """Raise CheckpointError if a file this reader reads was modified or replaced since it was
        opened (every tensor read checks this too; call it once more after the last read)."""

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def where(self, name: str | None = None) -> str:
        """For messages: the file holding `name`, else where the reader was opened from."""
        file = self.file_of(name) if name is not None else None
        return str(file or self.path or "the checkpoint")


class StateReader(Reader):
    """An in-memory state dict seen through the reader protocol."""

    def __init__(self, state: Mapping[str, torch.Tensor], config: ModelConfig):
        self.state, self.config = state, config

    def names(self) -> list[str]:
        return list(self.state)

    def __contains__(self, name: str) -> bool:
        return name in self.state

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.state[name].shape)

    def dtype(self, name: str) -> torch.dtype:
        return self.state[name].dtype

    def get(self, name: str) -> torch.Tensor:
        return self.state[name]


class ShapeTableReader(Reader):
    """A reader whose canonical tensors are the keys of `self._shape` (name -> shape, in canonical order): the
    converters' readers (HF, GGUF), which derive every shape when they open."""

    _shape: dict[str, tuple[int, ...]]

    def names(self) -> list[str]:
        return list(self._shape)

    def __contains__(self, name: str) -> bool:
        return name in self._shape

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shape[name]


class SafetensorsReader(Reader):
    """A reader over safetensors files whose tensors are canonical tensors one to one (under their
    own names, or renamed by the subclass). `_add(file, canonical_of_key)` opens a file."""

    def __init__(self) -> None:
        self._handles: dict[Path, SafetensorsFile] = {}
        self._where: dict[str, tuple[Path, str]] = {}  # canonical name -> (file, key in the file)

    def _add(self, file: Path, canonical_of=lambda key: key) -> SafetensorsFile:
        handle = SafetensorsFile(file)
        self._handles[file] = handle
        for key in handle.keys():
            self._where[canonical_of(key)] = (file, key)
        return handle

    def names(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def shape(self, name: str) -> tuple[int, ...]:
        file, key = self._where[name]
        return self._handles[file].meta[key][0]

    def dtype(self, name: str) -> torch.dtype:
        file, key = self._where[name]
        return self._handles[file].meta[key][1]

    def file_of(self, name: str) -> Path | None:
        return self._where[name][0] if name in self._where else None

    def files(self) -> list[Path]:
        return list(self._handles)

    def check_unchanged(self) -> None:
        for file, handle in self._handles.items():
            handle.identity.check_path(file)

    def get(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise CheckpointError(f"{self.path}: tensor {name} is missing")
        file, key = self._where[name]
        return self._handles[file].get(key)

    def read_into(self, name: str, out: torch.Tensor) -> None:
        if name not in self._where:
            raise CheckpointError(f"{self.path}: tensor {name} is missing")
        file, key = self._where[name]
        self._handles[file].read_into(key, out)

    def close(self) -> None:
        self._handles.clear()


def check_layout(reader: Reader, expected: Mapping[str, Shape] | None = None, *, label: str | None = None,
                 dtypes: Collection[torch.dtype] | None = None) -> None:
    """The reader holds exactly the tensors of `expected` (default: its config's canonical layout)
    with their shapes, and, if `dtypes` is given, only those dtypes. Raises CheckpointError naming
    the file (or `label`, else the reader's path) and the first offending tensor."""
    expected = tensor_shapes(reader.config) if expected is None else dict(expected)
    mismatches = layout_mismatches(expected, ((n, tuple(reader.shape(n))) for n in reader.names()))
    if mismatches:
        first = mismatches[0]
        where = reader.file_of(first.name) if first.kind != "missing" else None
        more = f" ({len(mismatches) - 1} more)" if len(mismatches) > 1 else ""
        raise CheckpointError(f"{where or label or reader.where()}: {first.message()}{more}")
    if dtypes is not None:
        for name in expected:
            dtype = reader.dtype(name)
            if dtype not in dtypes:
                raise CheckpointError(f"{reader.file_of(name) or label or reader.where()}: tensor {name} has dtype "
                                      f"{dtype_name(dtype)}; weights must be floating point "
                                      f"({', '.join(dtype_name(d) for d in dtypes)})")
