"""The `hf` format: a Hugging Face directory that transformers loads.

A dense model is written as its own architecture (llama, gpt2, ...: converters/hf/writer.py, which
needs `architecture`); a mixture as the remote-code BAM model (converters/hf_bam, loaded with
trust_remote_code=True).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from bam_surgery.runtime.config import ModelConfig
from bam_surgery.runtime.options import declared
from bam_surgery.runtime.reader import Reader

from .base import CapabilityError, CastOptions, ExportOptions, Exporter
from .hf.architectures import ARCHITECTURES, architecture as lookup_architecture
from .hf.writer import DEFAULT_SHARD_BYTES, export_with_options
from .hf_bam.export import check_hf_bam, export_hf_bam

DENSE = ", ".join(m for m, a in ARCHITECTURES.items() if not a.mixture)


@dataclass(frozen=True)
class HFOptions(CastOptions):
    """The hf format's own options: the architecture a dense model is written as, and CastOptions' dtype."""

    architecture: str | None = declared(
        None, "--architecture", metavar="MODEL_TYPE",
        help="For --format hf of a dense model: the HF architecture to write (llama, mistral, qwen2, gpt_neox, gpt2, "
             "cohere, phi). Default: the input's own, when it came from HF.")


class HFExporter(Exporter):
    name = "hf"
    summary = ("HF directory: a dense model as its HF architecture, a mixture as the remote-code BAM model "
               "(trust_remote_code=True)")
    Options = HFOptions

    def check(self, cfg: ModelConfig, *, recipe: str | None = None, architecture: str | None = None) -> None:
        if cfg.is_mixture:
            check_hf_bam(cfg)
            return
        if not architecture:
            raise CapabilityError(f"hf export of a dense model needs the architecture to write "
                                  f"(--architecture {DENSE.replace(', ', '|')})")
        arch = lookup_architecture(architecture)
        arch.config.write(cfg, arch.model_type)

    def carries(self, cfg: ModelConfig, *, architecture: str | None = None) -> bool:
        """A dense model: when some dense architecture writes it (--architecture)."""
        if cfg.is_mixture or architecture:
            return super().carries(cfg, architecture=architecture)
        return any(super(HFExporter, self).carries(cfg, architecture=m)
                   for m, a in ARCHITECTURES.items() if not a.mixture)

    def write(self, reader: Reader, out: Path, options: ExportOptions) -> Path:
        own = self.own(options)
        if reader.config.is_mixture:
            return export_hf_bam(reader, out, tokenizer_files=options.tokenizer_files, model_card=options.model_card,
                                 max_shard_bytes=options.max_shard_bytes, dtype=own.dtype,
                                 generation=options.generation, replace=options.replace)
        shards = options.max_shard_bytes if options.max_shard_bytes is not None else DEFAULT_SHARD_BYTES
        return export_with_options(reader, out, lookup_architecture(own.architecture),
                                   replace(options, max_shard_bytes=shards), always_generation=False)
