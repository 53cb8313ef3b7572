"""The exporter protocol every output format implements, its options and its error.

converters/export.py holds the table of formats (`exporters()`) and imports each format's module; the formats
import only this file, so the table and the formats form no import loop.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from bam_surgery.runtime.config import ConfigError, ModelConfig
from bam_surgery.runtime.reader import Reader


class CapabilityError(ConfigError):
    """A format, architecture or option cannot express this model; raised from the config alone,
    before any tensor is read. The message is one line saying what is needed and what the model has."""


@dataclass(frozen=True)
class ExportOptions:
    """Everything an exporter may use besides the reader; each format reads the fields it needs."""

    tokenizer_files: tuple[Path, ...] = ()  # copied into the output by name
    tokenizer_source: Reader | None = None  # dense hf: carry this reader's tokenizer files and token ids
    generation: Mapping[str, Any] | None = None  # generation_config.json entries; *_token_id also go to config.json
    model_card: str | None = None  # README.md
    max_shard_bytes: int | None = None  # None: the format's default (one file for most)
    dtype: torch.dtype | None = None  # cast every tensor (None: keep each tensor's dtype)
    architecture: str | None = None  # dense hf: the HF model_type to write
    recipe: str | None = None  # named in capability messages
    metadata: Mapping[str, str] = field(default_factory=dict)  # canonical: extra metadata entries
    replace: bool = True  # an existing OUT may be replaced if it is our own output (False: refuse; --force: True)
    opset: int | None = None  # onnx: the ONNX opset (None: the exporter's default)
    kv_cache: bool = True  # onnx: past key/values as graph inputs, present key/values as outputs
    verify: bool = False  # onnx: run the export in onnxruntime against the runtime before putting it in place
    gguf_dtype: str | None = None  # gguf: f32, f16 or q8_0 matrices (None: from dtype, else from the weights)
    log: Callable[[str], None] | None = None  # progress and summary lines (the CLI prints them on stderr)


class Exporter(ABC):
    """One output format."""

    name: str
    summary: str  # a few words for --format's help
    writes_directory: bool = True  # False: OUT may also be a single file (canonical .safetensors)

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


__all__ = ["CapabilityError", "Exporter", "ExportOptions"]
