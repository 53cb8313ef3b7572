"""Output formats: one `Exporter` per format, all in one table (`exporters()`). The protocol, its options and
its error live in converters/base.py, which every format imports (so no format imports this table).

`merge --format`, `convert --format` and the Python API pick formats from this table; a new format
is a class with a name, a capability check from the config alone and a `write(reader, out,
options)`, plus one line in `exporters()`.

    exporter("mixtral").check(cfg, recipe="btx")      CapabilityError (one line), before any I/O
    exporter("mixtral").write(reader, out, ExportOptions(...))   streams reader -> out (atomic)
    exporter("onnx").Options                          the format's own options (converters/base.py)

Formats:
    canonical   our own safetensors (file or directory); a merge writes it itself (surgery.execute),
                with its provenance
    mixtral     HF Mixtral directory (FFN-expert mixtures of Llama/Mistral-family models, no biases)
    qwen2_moe   HF Qwen2-MoE directory (FFN-expert mixtures of Llama/Mistral/Qwen2-family models, q/k/v biases too;
                a shared expert, or an all-zero one for a mixture without)
    qwen3_moe   HF Qwen3-MoE directory (FFN-expert mixtures of Qwen3 models: per-head QK-norm)
    flex_olmo   HF FlexOlmo directory (FFN-expert mixtures of OLMo 2 models: post-norms, full-width QK-norm)
    qwen3_5_moe HF Qwen3.5-MoE directory (FFN-expert mixtures of Qwen3.5 models: Gated DeltaNet layers, a shared
                expert, zero when the mixture has none)
    hf          HF directory: a dense model as its own architecture (llama, gpt2, ...; needs
                `architecture`), a mixture as the remote-code BAM model (trust_remote_code=True)
    onnx        ONNX graph with KV-cache inputs/outputs for onnxruntime (converters/onnx_export.py)
    gguf        one GGUF file for llama.cpp: Llama-shaped dense models, Mixtral-shaped mixtures, shared-expert
                mixtures (qwen2moe), with the tokenizer (converters/gguf_export.py)

Refused (`REFUSED_FORMATS`): a native format no mixture of ours computes the same function in; asking for one is a
one-line CapabilityError saying why.

A format's refusal (`check_export`, `export`) ends with the formats that do carry the model (`carriers`: every
format's own check, from the config alone), so no refusal sends the user to a format that refuses too.
"""
from __future__ import annotations

import os
from dataclasses import fields as fields_of, replace
from pathlib import Path
from typing import Any

from bam_surgery.runtime.checkpoint import write_checkpoint
from bam_surgery.runtime.config import ModelConfig
from bam_surgery.runtime.reader import Reader, check_layout
from bam_surgery.runtime.shards import read_side_file

from .base import CapabilityError, Exporter, ExportOptions
from .gguf_export import GGUFExporter
from .hf.families import NATIVE_MIXTURES, REFUSED_NATIVE
from .hf.files import GENERATION_CONFIG, generation_config_text
from .hf_export import HFExporter
from .native_moe import NativeMixtureExporter
from .onnx_export import OnnxExporter

# native formats asked for that cannot carry our mixtures -> why (docs/deploy.md)
REFUSED_FORMATS: dict[str, str] = {
    "phimoe": "PhiMoE normalizes with LayerNorm where Phi-3 has RMSNorm, and its sparsemixer router gates each of its "
              "two picks by a softmax over the experts within a relative threshold of the best one, which no gate_norm "
              "computes, so a Phi-3 mixture would compute another function there; --format hf writes it (the HF BAM "
              "model)",
    **{r.model_type: r.why for r in REFUSED_NATIVE},  # a family record's (hf/families.py)
}


class CanonicalExporter(Exporter):
    name = "canonical"
    summary = "our safetensors, loads with runtime.load_model"
    writes_directory = False

    def check(self, cfg, *, recipe=None, architecture=None) -> None:
        pass  # every ModelConfig has a canonical layout

    def write(self, reader, out, options) -> Path:
        self.own(options)
        check_layout(reader)  # a checkpoint whose tensors contradict its own config is never written
        return write_checkpoint(reader, out, options.metadata, options.max_shard_bytes, replace=options.replace,
                                side_files=side_files(options))


def side_files(options: ExportOptions) -> dict[str, bytes]:
    """{name: content} a canonical checkpoint carries: the tokenizer files and chat template as they are, the
    generation config as generation_config.json (when it has entries)."""
    files = {Path(f).name: read_side_file(Path(f)) for f in options.tokenizer_files}
    if options.generation:
        files[GENERATION_CONFIG] = generation_config_text(options.generation).encode()
    return files


def exporters() -> dict[str, Exporter]:
    """The table of output formats, in --format order. Adding a format: one entry here."""
    natives = [NativeMixtureExporter(f) for f in NATIVE_MIXTURES]  # one per native mixture record (hf/families.py)
    return {e.name: e for e in (CanonicalExporter(), *natives, HFExporter(), OnnxExporter(), GGUFExporter())}


def exporter(fmt: str) -> Exporter:
    if fmt in REFUSED_FORMATS:
        raise CapabilityError(f"--format {fmt} is not offered: {REFUSED_FORMATS[fmt]}")
    table = exporters()
    if fmt not in table:
        raise CapabilityError(f"unknown format {fmt!r}; choose one of {', '.join(table)}")
    return table[fmt]


def carriers(cfg: ModelConfig, *, architecture: str | None = None) -> list[str]:
    """The formats besides canonical (which carries every model) that carry `cfg`, in the table's order."""
    return [name for name, chosen in exporters().items()
            if name != "canonical" and chosen.carries(cfg, architecture=architecture)]


def check_export(fmt: str, cfg: ModelConfig, *, recipe: str | None = None, architecture: str | None = None) -> None:
    """Refuse, in one line, a model the format cannot express, before any tensor is read; the line ends with the
    formats that do carry it."""
    chosen = exporter(fmt)
    try:
        chosen.check(cfg, recipe=recipe, architecture=architecture)
    except CapabilityError as e:
        others = [name for name in carriers(cfg, architecture=architecture) if name != fmt]
        where = (f"--format {others[0]} carries it" if len(others) == 1 else
                 f"the {', '.join(others[:-1])} or {others[-1]} formats carry it" if others else
                 "only the canonical format carries it (the bundled runtime)")
        raise CapabilityError(f"{e}; {where}") from None


def export(reader: Reader, out: str | os.PathLike, fmt: str, options: ExportOptions | None = None,
           **fields: Any) -> Path:
    """Write `reader` (a checkpoint or a merge's PlanReader) to `out` in format `fmt`; `fields` override entries
    of `options` (ExportOptions) or of the format's own (export(r, out, "onnx", verify=True, log=print)). What
    travels with the weights is the caller's to give (app/exports.py gathers it for every route of the tool)."""
    chosen = exporter(fmt)
    common = {f.name for f in fields_of(ExportOptions)}
    options = replace(options or ExportOptions(), **{k: v for k, v in fields.items() if k in common})
    own = {k: v for k, v in fields.items() if k not in common}
    if own:
        options = replace(options, own=replace(chosen.own(options), **own))
    check_export(fmt, reader.config, recipe=options.recipe,
                 architecture=getattr(chosen.own(options), "architecture", None))
    return chosen.write(reader, Path(out), options)


__all__ = ["REFUSED_FORMATS", "CapabilityError", "Exporter", "ExportOptions", "carriers", "check_export", "export", "exporter", "exporters"]
