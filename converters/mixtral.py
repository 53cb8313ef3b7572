"""The `mixtral` format: FFN-expert mixtures (BTX, sparse upcycling) of Llama/Mistral-family models
as HF Mixtral, and back.

On disk (what `MixtralForCausalLM.save_pretrained` writes in transformers 5.x, and what
`from_pretrained` converts into its fused in-memory `mlp.experts.gate_up_proj` / `down_proj`):

    model.layers.{i}.block_sparse_moe.gate.weight            [E, D]   router
    model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight  [F, D]   gate projection of expert e
    model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight  [F, D]   up projection
    model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight  [D, F]   down projection

Mixtral is one more HF architecture: its record is in hf/families.py (its weight table: canonical expert
tensors are stacked [E, ...]; the STACK op turns one into E Mixtral tensors and back; its config.json map and
capability check: hf/moe_family.py RenormalizedMoe), its exporter native_moe.py's. Export runs the table backwards
(hf/writer.py); import is the HF reader with the same table.

    from bam_surgery.converters.mixtral import export_mixtral, import_mixtral
    export_mixtral(open_checkpoint("btx.safetensors"), "btx-mixtral/", tokenizer_files=[...])
    reader = import_mixtral("btx-mixtral/")     # canonical names, lazy, the reader protocol
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch

from bam_surgery.runtime.config import ModelConfig
from bam_surgery.runtime.errors import CheckpointError
from bam_surgery.runtime.reader import Reader

from .base import CapabilityError, CastOptions, ExportOptions
from .hf.architectures import ARCHITECTURES
from .hf.reader import HFCheckpointReader
from .native_moe import NativeMixtureExporter

__all__ = ["CapabilityError", "check_mixtral", "export_mixtral", "import_mixtral", "load_state"]

MODEL_TYPE = "mixtral"


def check_mixtral(cfg: ModelConfig, recipe: str | None = None) -> None:
    """Raise CapabilityError (one line) if Mixtral cannot compute exactly what this model computes."""
    ARCHITECTURES[MODEL_TYPE].config.check(cfg, recipe)


def export_mixtral(reader: Reader, out_dir: str | os.PathLike, tokenizer_files: Iterable[str | os.PathLike] = (),
                   model_card: str | None = None, max_shard_bytes: int | None = None,
                   generation_config: Mapping[str, Any] | None = None, *, recipe: str | None = None,
                   dtype: torch.dtype | None = None) -> Path:
    """Write an HF Mixtral directory from a canonical mixture reader, one canonical tensor in memory at a time.

    tokenizer_files  copied into the directory by file name (tokenizer.json, tokenizer_config.json, ...)
    model_card       markdown text written as README.md
    generation_config  generation_config.json fields; its bos/eos/pad token ids also go to config.json
    recipe           recipe name used in capability error messages
    dtype            cast every tensor (default: keep each tensor's dtype)
    Nothing is left at out_dir if anything fails.
    """
    exporter = NativeMixtureExporter(ARCHITECTURES[MODEL_TYPE])
    exporter.check(reader.config, recipe=recipe or reader.metadata.get("recipe"))
    options = ExportOptions(tokenizer_files=tuple(map(Path, tokenizer_files)), generation=generation_config,
                            model_card=model_card, max_shard_bytes=max_shard_bytes, recipe=recipe, own=CastOptions(dtype))
    return exporter.write(reader, Path(out_dir), options)


def import_mixtral(path: str | os.PathLike) -> HFCheckpointReader:
    """Open an HF Mixtral directory as a lazy canonical reader (use load_state to materialize it)."""
    reader = HFCheckpointReader(path)
    if reader.architecture != MODEL_TYPE:
        raise CheckpointError(f"{Path(path) / 'config.json'}: model_type {reader.architecture!r} is not "
                              f"{MODEL_TYPE!r}")
    return reader


def load_state(reader: Reader) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Materialize every tensor of a reader: (config, canonical state dict). Small models only."""
    return reader.config, {n: reader.get(n) for n in reader.names()}
