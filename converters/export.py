"""One entry point for every output format, with capability checks that run before any I/O.

    check_export(fmt, cfg, recipe=..., architecture=...)   raises CapabilityError (one line)
    export(reader, out_dir, fmt, ...)                      streams reader -> out_dir (atomic)

Formats:
    canonical   our own safetensors (file or directory); written by surgery.execute, not here
    mixtral     HF Mixtral directory (FFN-expert mixtures of Llama/Mistral-family models)
    hf          HF directory: a dense model as its own architecture (llama, gpt2, ...; needs
                `architecture`), a mixture as the remote-code BAM model (trust_remote_code=True)
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch

from bam_surgery.runtime.config import ConfigError, ModelConfig

from .hf.config_map import CapabilityError
from .mixtral import check_mixtral, export_mixtral

FORMATS = ("canonical", "mixtral", "hf")


def check_export(fmt: str, cfg: ModelConfig, *, recipe: str | None = None, architecture: str | None = None) -> None:
    """Refuse, in one line, a model the format cannot express, before any tensor is read."""
    if fmt not in FORMATS:
        raise CapabilityError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if fmt == "mixtral":
        check_mixtral(cfg, recipe)
    elif fmt == "hf":
        if cfg.is_mixture:
            from .hf_bam.export import check_hf_bam
            try:
                check_hf_bam(cfg)
            except ValueError as e:
                raise CapabilityError(str(e)) from None
        else:
            if not architecture:
                raise CapabilityError("hf export of a dense model needs the architecture to write "
                                      "(--architecture llama|mistral|qwen2|gpt_neox|gpt2|cohere|phi)")
            from .hf.architectures import architecture as lookup
            from .hf.config_map import model_config_to_hf
            arch = lookup(architecture)
            model_config_to_hf(cfg, arch.config, arch.model_type)  # raises the architecture's capability error


def export(reader, out_dir: str | os.PathLike, fmt: str, *, tokenizer_files: Iterable[Path] = (),
           tokenizer_source=None, model_card: str | None = None, max_shard_bytes: int | None = None,
           dtype: torch.dtype | None = None, architecture: str | None = None, recipe: str | None = None,
           generation: Mapping[str, Any] | None = None) -> Path:
    """Write `reader` (a canonical checkpoint or a surgery PlanReader) to out_dir in format `fmt`."""
    try:
        return _export(reader, Path(out_dir), fmt, list(tokenizer_files), tokenizer_source, model_card,
                       max_shard_bytes, dtype, architecture, recipe, generation)
    except ConfigError:
        raise
    except ValueError as e:  # exporters refuse bad requests with one-line ValueErrors; keep them one line
        raise CapabilityError(str(e)) from e


def _export(reader, out_dir, fmt, tokenizer_files, tokenizer_source, model_card, max_shard_bytes, dtype,
            architecture, recipe, generation) -> Path:
    cfg: ModelConfig = reader.config
    check_export(fmt, cfg, recipe=recipe, architecture=architecture)
    if fmt == "canonical":
        raise CapabilityError("canonical output is written by the merge itself, not by an exporter")
    if fmt == "mixtral":
        return export_mixtral(reader, out_dir, tokenizer_files=tokenizer_files, model_card=model_card,
                              max_shard_bytes=max_shard_bytes, generation_config=generation, recipe=recipe,
                              dtype=dtype)
    if cfg.is_mixture:
        from .hf_bam.export import export_hf_bam
        return export_hf_bam(reader, out_dir, tokenizer_files=tokenizer_files, model_card=model_card,
                             max_shard_bytes=max_shard_bytes, dtype=dtype, generation=generation)
    from .hf.writer import save_hf
    kwargs = {} if max_shard_bytes is None else {"max_shard_bytes": max_shard_bytes}
    return save_hf(reader, out_dir, architecture, tokenizer_from=tokenizer_source, model_card=model_card, **kwargs)


__all__ = ["FORMATS", "CapabilityError", "check_export", "export"]
