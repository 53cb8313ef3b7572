"""Read an exported HF BAM directory (model_type "bam_mixture") back under canonical names.

The export's weight names are the canonical ones under "model." (lm_head.* at the top level), and
its config.json carries every ModelConfig field, so the reader is a renaming view over the files.
"""
from __future__ import annotations

import os
from pathlib import Path

from bam_surgery.runtime.errors import CheckpointError
from bam_surgery.runtime.reader import SafetensorsReader, check_layout

from ..hf.files import read_hf_config, tokenizer_files_in, weight_files
from .export import canonical_weight_name, config_from_hf_dict


class BamHFReader(SafetensorsReader):
    """The reader protocol (runtime.reader) over an HF BAM export."""

    def __init__(self, path: str | os.PathLike):
        super().__init__()
        self.path = self.source_dir = Path(path)
        try:
            self.config = config_from_hf_dict(read_hf_config(self.path))
        except ValueError as e:
            raise CheckpointError(f"{self.path / 'config.json'}: {e}") from None
        self.metadata = {"source_format": "bam_mixture", "source": str(self.path)}
        files, _, _ = weight_files(self.path)
        for f in files:
            self._add(f, lambda key, f=f: self._canonical(f, key))
        check_layout(self)

    @staticmethod
    def _canonical(file: Path, key: str) -> str:
        try:
            return canonical_weight_name(key)
        except KeyError:
            raise CheckpointError(f"{file}: tensor {key} is not a weight name of the HF BAM format") from None

    def tokenizer_files(self) -> list[Path]:
        return tokenizer_files_in(self.path)
