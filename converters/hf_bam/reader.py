"""Read an exported HF BAM directory (model_type "bam_mixture") back under canonical names.

The export's weight names are the canonical ones under "model." (lm_head.* at the top level), and
its config.json carries every ModelConfig field, so the reader is a renaming view over the files.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from bam_surgery.runtime.checkpoint import CheckpointError, ReaderBase, SafetensorsFile
from bam_surgery.runtime.layout import tensor_shapes

from ..hf.reader import read_hf_config, weight_files
from .export import canonical_weight_name, config_from_hf_dict


class BamHFReader(ReaderBase):
    """Lazy reader (CheckpointReader's protocol) over an HF BAM export."""

    def __init__(self, path: str | os.PathLike):
        self.path = self.source_dir = Path(path)
        try:
            self.config = config_from_hf_dict(read_hf_config(self.path))
        except ValueError as e:
            raise CheckpointError(f"{self.path / 'config.json'}: {e}") from None
        self.metadata = {"source_format": "bam_mixture", "source": str(self.path)}
        files, _, _ = weight_files(self.path)
        self._handles = {f: SafetensorsFile(f) for f in files}
        self._where: dict[str, tuple[Path, str]] = {}
        for f, h in self._handles.items():
            for key in h.keys():
                try:
                    self._where[canonical_weight_name(key)] = (f, key)
                except KeyError:
                    raise CheckpointError(f"{f}: tensor {key} is not a weight name of the HF BAM format") from None
        want = tensor_shapes(self.config)
        missing = [n for n in want if n not in self._where]
        if missing:
            raise CheckpointError(f"{self.path}: tensor {missing[0]} is missing")

    def names(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def _meta(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        f, key = self._where[name]
        return self._handles[f].meta[key]

    def shape(self, name: str) -> tuple[int, ...]:
        return self._meta(name)[0]

    def dtype(self, name: str) -> torch.dtype:
        return self._meta(name)[1]

    def file_of(self, name: str) -> Path:
        return self._where[name][0]

    def files(self) -> list[Path]:
        return list(self._handles)

    def get(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise CheckpointError(f"{self.path}: tensor {name} is missing")
        f, key = self._where[name]
        return self._handles[f].get(key)

    def tokenizer_files(self) -> list[Path]:
        from ..hf.reader import TOKENIZER_FILES
        return [self.path / n for n in TOKENIZER_FILES if (self.path / n).is_file()]
