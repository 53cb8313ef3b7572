"""The exporter protocol every output format implements, what every format is given, and its error.

converters/export.py holds the table of formats (`exporters()`) and imports each format's module; the formats
import only this file, so the table and the formats form no import loop.

Each format declares its own options as a frozen dataclass, `Exporter.Options` (HFOptions: the architecture of a
dense hf export; OnnxOptions: opset, KV cache, verify; GGUFOptions: the matrices' type; ...), its fields declared
with their flags (runtime/options.py:declared), so that `export-onnx` and `export-gguf` are declarations of them.
What every format gets besides, the same for all, is ExportOptions: what the export carries (decided once, by
app/exports.py) and how its files are written, with the format's own options in `own`.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Mapping

from bam_surgery.runtime.config import ConfigError, ModelConfig
from bam_surgery.runtime.reader import Reader

if TYPE_CHECKING:  # annotations only
    import torch


class CapabilityError(ConfigError):
    """A format, architecture or option cannot express this model; raised from the config alone,
    before any tensor is read. The message is one line saying what is needed and what the model has."""


@dataclass(frozen=True)
class NoOptions:
    """A format without options of its own (canonical)."""


@dataclass(frozen=True)
class CastOptions:
    """The HF formats' own: every tensor cast to one dtype (the Python API's; None: each tensor's own)."""

    dtype: torch.dtype | None = None


@dataclass(frozen=True)
class ExportOptions:
    """What every format is given besides the reader and OUT; each format writes the carried parts its own way."""

    # what the export carries, decided by app/exports.py:export_inputs for every format alike
    tokenizer_files: tuple[Path, ...] = ()  # copied into the output by name
    generation: Mapping[str, Any] | None = None  # generation_config.json entries; *_token_id also go to config.json
    model_card: str | None = None  # README.md
    metadata: Mapping[str, str] = field(default_factory=dict)  # canonical (and the GGUF card): extra metadata entries
    # how it is written
    recipe: str | None = None  # named in capability messages
    max_shard_bytes: int | None = None  # None: the format's default (one file for most)
    replace: bool = True  # an existing OUT may be replaced if it is our own output (False: refuse; --force: True)
    log: Callable[[str], None] | None = None  # progress and summary lines (the CLI prints them on stderr)
    own: Any = None  # the format's own options: an instance of its Exporter.Options (None: their defaults)


class Exporter(ABC):
    """One output format."""

    name: str
    summary: str  # a few words for --format's help
    writes_directory: bool = True  # False: OUT may also be a single file (canonical .safetensors)
    Options: ClassVar[type] = NoOptions  # the format's own options (a frozen dataclass of declared fields)

    @abstractmethod
    def check(self, cfg: ModelConfig, *, recipe: str | None = None, architecture: str | None = None) -> None:
        """Raise CapabilityError if the format cannot express this config (no I/O)."""

    def carries(self, cfg: ModelConfig, *, architecture: str | None = None) -> bool:
        """Whether the format carries this model with some choice of its options (named in other formats'
        refusals)."""
        try:
            self.check(cfg, architecture=architecture)
        except ConfigError:  # CapabilityError, or a dense architecture's config map refusing a value
            return False
        return True

    @abstractmethod
    def write(self, reader: Reader, out: Path, options: ExportOptions) -> Path:
        """Check (again, with the reader's tensors) and write `out` atomically; return it."""

    def own(self, options: ExportOptions) -> Any:
        """This format's own options in `options` (their defaults where none were given)."""
        own = options.own if options.own is not None else self.Options()
        if not isinstance(own, self.Options):
            raise TypeError(f"{self.name} export: its options are {self.Options.__name__}, not {type(own).__name__}")
        return own


__all__ = ["CapabilityError", "CastOptions", "Exporter", "ExportOptions", "NoOptions"]
