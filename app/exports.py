"""The export use case: what an export carries, decided once, and the one function every route writes through.

    with open_input("hf-llama/") as reader:
        export(reader, "llama.gguf", "gguf", source="hf-llama/", gguf_dtype="q8_0")
    export(PlanReader(plan), "mix-hf", "hf", plan=plan)      # a merge's export: the seed's side files, its card

`convert`, a merge's export (`merge --format`), `export-onnx` and `export-gguf` call `export`; each is a
declaration of its options. `export_inputs` gathers, for any source (a canonical file or folder, an HF folder, a
GGUF file, a train run's checkpoint, a merge's seed), what travels with the weights:

    tokenizer files     tokenizer.json (or tokenizer.model / vocab.json + merges.txt), tokenizer_config.json with
                        its special tokens, special_tokens_map.json, added_tokens.json (reader.tokenizer_files():
                        an HF folder's, a canonical folder's or single file's carried ones, a GGUF's rebuilt ones)
    chat template       chat_template.jinja (or tokenizer_config.json's chat_template, inside that file)
    generation config   generation_config.json's entries (bos/eos/pad ids, stop ids), else config.json's token ids;
                        every format but the GGUF writes generation_config.json from them (the HF formats also
                        the ids into config.json, the ONNX folder into genai_config.json), the GGUF its
                        tokenizer.ggml.* ids
    byte tokenizer      converters/byte_tokenizer.py:uses_byte_tokenizer (the one rule): the canonical format
                        keeps its metadata key, the GGUF embeds its vocabulary, the ONNX folder a tokenizer.json
    card                a merge's model card (README.md of the HF formats)

The formats themselves (converters/export.py's table) write what they are given; a format that cannot carry
what the source has says so in one line (a GGUF without a byte-level BPE, a binary tokenizer.model in a single
.safetensors file).
"""
from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from bam_surgery.converters.byte_tokenizer import (BYTE_VOCAB, BYTES, TOKENIZER_KEY, unavailable_tokenizer,
                                                   uses_byte_tokenizer)
from bam_surgery.converters.export import ExportOptions, check_export, exporter, side_files
from bam_surgery.converters.onnx_genai import byte_tokenizer_files
from bam_surgery.runtime.output_path import check_output_path
from bam_surgery.runtime.reader import Reader
from bam_surgery.surgery.card import check_tokenizers, generation_config, model_card, tokenizer_files

# the files that say how text becomes ids (the rest: special tokens, templates)
VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


@dataclass(frozen=True)
class ExportInputs:
    """What an export carries besides the weights (module docstring)."""

    files: tuple[Path, ...] = ()  # copied into the export by name (never generation_config.json: see generation)
    generation: Mapping[str, Any] | None = None  # generation_config.json's entries
    byte_tokenizer: bool = False  # the model reads UTF-8 bytes (train's byte tokenizer)
    hf_source: Reader | None = None  # an HF folder: a dense hf export copies its files as they are
    model_card: str | None = None  # a merge's card


def export_inputs(reader: Reader, fmt: str, *, plan=None, out: str | Path | None = None,
                  warn: Callable[[str], None] | None = None) -> ExportInputs:
    """The side files, generation config, byte-tokenizer fact and card of an export of `reader` in format `fmt`;
    of a merge (`plan`), the seed's (the specialists' tokenizers checked against it, a differing one warned)."""
    if plan is not None:
        seed = plan.inputs[0].reader
        files = check_tokenizers(plan, warn or (lambda msg: None))
        card = model_card(plan, fmt, str(out)) if fmt != "canonical" else None
    else:
        seed, files, card = reader, tokenizer_files(reader), None
    says_bytes = reader.metadata.get(TOKENIZER_KEY) == BYTES or seed.metadata.get(TOKENIZER_KEY) == BYTES
    missing = unavailable_tokenizer(seed.metadata)
    if missing is not None and warn is not None and fmt != "canonical":  # the canonical format keeps the fact
        warn(f"{seed.path}: its tokenizer could not be rebuilt, so the output carries none ({missing})")
    has_vocabulary = any(f.name in VOCABULARY_FILES for f in files) or missing is not None
    return ExportInputs(files=tuple(files), generation=generation_config(seed),
                        byte_tokenizer=uses_byte_tokenizer(says_bytes, has_vocabulary, reader.config.vocab_size)
                        and reader.config.vocab_size >= BYTE_VOCAB,  # ids 1..255 are bytes: the vocabulary holds them
                        hf_source=seed if seed.source_dir is not None and files and plan is None else None,
                        model_card=card)


@dataclass(frozen=True)
class ExportRequest:
    """The options of an export besides its inputs: each format reads the ones it has (converters/base.py)."""

    architecture: str | None = None  # dense hf: the HF model_type (default: the source's own)
    max_shard_bytes: int | None = None
    dtype: Any = None  # a torch dtype every tensor is cast to (onnx: fp16)
    gguf_dtype: str | None = None
    opset: int | None = None
    kv_cache: bool = True
    verify: bool = False
    force: bool = False
    log: Callable[[str], None] | None = None


def export(reader: Reader, out: str | Path, fmt: str, request: ExportRequest = ExportRequest(), *,
           source: str | None = None, plan=None, warn: Callable[[str], None] | None = None) -> Path:
    """Write `reader` (a checkpoint, or a merge's PlanReader with its `plan`) to `out` in format `fmt`, carrying
    what export_inputs gathers. Refused before anything is written: a format that cannot express the model, a bad
    OUT (runtime.output_path); `source` names the input in the output's metadata and card."""
    out = Path(out)
    recipe = plan.recipe.name if plan is not None else None
    # from the config, before any read
    check_export(fmt, reader.config, recipe=recipe, architecture=_architecture(reader, request, plan))
    inputs = [(inp.label, inp.reader) for inp in plan.inputs] if plan is not None else [(source or "", reader)]
    check_output_path(out, request.force, inputs)
    return write_export(reader, out, fmt, request, source=source, plan=plan, warn=warn)


def write_export(reader: Reader, out: Path, fmt: str, request: ExportRequest = ExportRequest(), *,
                 source: str | None = None, plan=None, warn: Callable[[str], None] | None = None) -> Path:
    """export's writing, once the format and OUT are checked (app/merge.py checks them itself, once)."""
    arch = _architecture(reader, request, plan)
    recipe = plan.recipe.name if plan is not None else None
    inputs = export_inputs(reader, fmt, plan=plan, out=out, warn=warn)
    with tempfile.TemporaryDirectory(prefix="bam-surgery-tokenizer-") as scratch:
        options = ExportOptions(
            tokenizer_files=inputs.files + _byte_tokenizer_files(fmt, inputs, Path(scratch)),
            tokenizer_source=inputs.hf_source, generation=inputs.generation, model_card=inputs.model_card,
            max_shard_bytes=request.max_shard_bytes, dtype=request.dtype, architecture=arch, recipe=recipe,
            metadata=_metadata(fmt, source, reader), replace=request.force, opset=request.opset,
            kv_cache=request.kv_cache, verify=request.verify, gguf_dtype=request.gguf_dtype, log=request.log)
        return exporter(fmt).write(reader, out, options)


def _architecture(reader: Reader, request: ExportRequest, plan) -> str | None:
    """The HF model_type a dense hf export writes: the one asked for, else the source's own (a merge has none)."""
    return request.architecture or (reader.architecture if plan is None else None)


def carried_files(inputs: ExportInputs) -> dict[str, bytes]:
    """{name: content} of what a canonical checkpoint carries (a merge's canonical output, written by
    surgery.execute, takes them so): converters/export.py:side_files, the canonical format's own rule."""
    return side_files(ExportOptions(tokenizer_files=inputs.files, generation=inputs.generation))


def _byte_tokenizer_files(fmt: str, inputs: ExportInputs, scratch: Path) -> tuple[Path, ...]:
    """The byte tokenizer as a tokenizer.json (converters/onnx_genai.py) for the ONNX folder, whose GenAI
    tokenizer needs one; the other formats keep the fact otherwise (canonical: its metadata key, gguf: its
    vocabulary)."""
    texts = byte_tokenizer_files()
    if fmt != "onnx" or not inputs.byte_tokenizer or any(f.name in texts for f in inputs.files):
        return ()
    for name, text in texts.items():
        (scratch / name).write_text(text, encoding="utf-8")
    return tuple(scratch / name for name in texts)


def _metadata(fmt: str, source: str | None, reader: Reader) -> dict[str, str]:
    """The canonical file's (and the GGUF card's) extra metadata: the source, and the byte tokenizer's key where
    the source says it (a model without a tokenizer and a small vocabulary needs no key: the rule finds it), or that
    its own tokenizer is unavailable (a GGUF's not rebuilt: no later command reads bytes in its place)."""
    out = {"bam_source": source} if source else {}
    if fmt == "canonical" and (reader.metadata.get(TOKENIZER_KEY) == BYTES or unavailable_tokenizer(reader.metadata)):
        out[TOKENIZER_KEY] = reader.metadata[TOKENIZER_KEY]  # bytes, or why its own tokenizer is unavailable
    return out


__all__ = ["ExportInputs", "ExportRequest", "carried_files", "export", "export_inputs"]
