"""The export use case: what an export carries, decided once, and the one function every route writes through.

    convert("hf-llama/", "llama.gguf", "gguf", own=GGUFOptions(dtype="q8_0"))   # open, export, close
    export(PlanReader(plan), "mix-hf", "hf", plan=plan)      # a merge's export: the seed's side files, its card

`convert` (bam-surgery convert, export-onnx and export-gguf: each a declaration of its options, the format's own
ones declared by the format, converters/base.py:Exporter.Options) and a merge's export (`merge --format`) call
`export`. `export_inputs` gathers, for any source (a canonical file or folder, an HF folder, a
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
    card                README.md of the HF formats: a merge's model card, else a card of the conversion (what the
                        model is, its source and the merge and training records it carries, config, load)

The formats themselves (converters/export.py's table) write what they are given; a format that cannot carry
what the source has says so in one line (a GGUF without a byte-level BPE, a binary tokenizer.model in a single
.safetensors file).
"""
from __future__ import annotations

import dataclasses
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from bam_surgery.converters.byte_tokenizer import (BYTE_VOCAB, BYTES, TOKENIZER_KEY, unavailable_tokenizer,
                                                   uses_byte_tokenizer)
from bam_surgery.converters.export import REFUSED_FORMATS, ExportOptions, check_export, exporter, exporters, side_files
from bam_surgery.converters.onnx_genai import byte_tokenizer_files
from bam_surgery.runtime.output_path import check_output_path
from bam_surgery.runtime.reader import Reader
from bam_surgery.runtime.sizes import parse_size
from bam_surgery.surgery.card import (HF_FORMATS, check_tokenizers, conversion_card, generation_config, model_card,
                                      tokenizer_files)
from bam_surgery.surgery.errors import BamSurgeryError

from .inputs import open_input
from .reporter import Reporter

# the files that say how text becomes ids (the rest: special tokens, templates)
VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


@dataclass(frozen=True)
class ExportInputs:
    """What an export carries besides the weights (module docstring)."""

    files: tuple[Path, ...] = ()  # copied into the export by name (never generation_config.json: see generation)
    generation: Mapping[str, Any] | None = None  # generation_config.json's entries
    byte_tokenizer: bool = False  # the model reads UTF-8 bytes (train's byte tokenizer)
    model_card: str | None = None  # README.md: a merge's card, or the conversion's


def export_inputs(reader: Reader, fmt: str, *, plan=None, out: str | Path | None = None,
                  warn: Callable[[str], None] | None = None, source: str | None = None) -> ExportInputs:
    """The side files, generation config, byte-tokenizer fact and card of an export of `reader` in format `fmt`;
    of a merge (`plan`), the seed's (the specialists' tokenizers checked against it, a differing one warned)."""
    if plan is not None:
        seed = plan.inputs[0].reader
        files = check_tokenizers(plan, warn or (lambda msg: None))
        card = model_card(plan, fmt, str(out)) if fmt != "canonical" else None
    else:
        seed, files = reader, tokenizer_files(reader)
        card = conversion_card(reader, fmt, str(out), source) if fmt in HF_FORMATS and out is not None else None
    says_bytes = reader.metadata.get(TOKENIZER_KEY) == BYTES or seed.metadata.get(TOKENIZER_KEY) == BYTES
    missing = unavailable_tokenizer(seed.metadata)
    if missing is not None and warn is not None and fmt != "canonical":  # the canonical format keeps the fact
        warn(f"{seed.path}: its tokenizer could not be rebuilt, so the output carries none ({missing})")
    has_vocabulary = any(f.name in VOCABULARY_FILES for f in files) or missing is not None
    return ExportInputs(files=tuple(files), generation=generation_config(seed),
                        byte_tokenizer=uses_byte_tokenizer(says_bytes, has_vocabulary, reader.config.vocab_size)
                        and reader.config.vocab_size >= BYTE_VOCAB,  # ids 1..255 are bytes: the vocabulary holds them
                        model_card=card)


@dataclass(frozen=True)
class ExportRequest:
    """How an export is written besides what it carries: directory shards, whether OUT may be replaced, and the
    format's own options (an instance of its Exporter.Options; None: their defaults)."""

    max_shard_bytes: int | None = None
    force: bool = False
    own: Any = None


def formats() -> dict[str, str]:
    """The output formats, {name: a few words}, in --format order; REFUSED_FORMATS: the ones refused saying why."""
    return {name: e.summary for name, e in exporters().items()}


def format_options(fmt: str) -> type:
    """The dataclass of a format's own options (converters/base.py:Exporter.Options)."""
    return exporter(fmt).Options


def convert(source: str, out: str | os.PathLike, fmt: str = "canonical", *, own: Any = None,
            max_shard_size: str | None = None, force: bool = False, allow_pickle: bool = False,
            reporter: Reporter | None = None) -> Path:
    """The use case of `bam-surgery convert` (and export-onnx, export-gguf: the same with their format's options):
    open `source` (any checkpoint, a run folder as its newest checkpoint) and export it to `out` in format `fmt`.
    own: the format's own options (format_options(fmt)); reporter: the format's lines (an ONNX verification's
    summary, the GGUF tokenizer's notes) and OUT once it is in place."""
    reporter = reporter or Reporter()
    shard_bytes = parse_size(max_shard_size) if max_shard_size else None
    check_format_out(fmt, out)
    with open_input(source, allow_pickle) as reader:
        path = export(reader, out, fmt, ExportRequest(max_shard_bytes=shard_bytes, force=force, own=own),
                      source=str(source), reporter=reporter)
        reporter.written(path)
    return path


def check_format_out(fmt: str, out: str | os.PathLike | None) -> None:
    """A format that writes a directory refuses an OUT named like one file."""
    if out is not None and exporter(fmt).writes_directory and str(out).endswith(".safetensors"):
        raise BamSurgeryError(f"--format {fmt}: writes a directory; {out} names a .safetensors file")


def export(reader: Reader, out: str | Path, fmt: str, request: ExportRequest = ExportRequest(), *,
           source: str | None = None, plan=None, reporter: Reporter | None = None) -> Path:
    """Write `reader` (a checkpoint, or a merge's PlanReader with its `plan`) to `out` in format `fmt`, carrying
    what export_inputs gathers. Refused before anything is written: a format that cannot express the model, a bad
    OUT (runtime.output_path); `source` names the input in the output's metadata and card."""
    out = Path(out)
    recipe = plan.recipe.name if plan is not None else None
    own = _own(reader, fmt, request, plan)
    # from the config, before any read
    check_export(fmt, reader.config, recipe=recipe, architecture=getattr(own, "architecture", None))
    inputs = [(inp.label, inp.reader) for inp in plan.inputs] if plan is not None else [(source or "", reader)]
    check_output_path(out, request.force, inputs)
    return write_export(reader, out, fmt, request, source=source, plan=plan, reporter=reporter)


def write_export(reader: Reader, out: Path, fmt: str, request: ExportRequest = ExportRequest(), *,
                 source: str | None = None, plan=None, reporter: Reporter | None = None) -> Path:
    """export's writing, once the format and OUT are checked (app/merge.py checks them itself, once). The format's
    lines go to reporter.log, but for a merge's export (the merge prints its own summary)."""
    reporter = reporter or Reporter()
    recipe = plan.recipe.name if plan is not None else None
    warnings: list[str] = []  # said once the output is written: a format that refuses says one line only
    inputs = export_inputs(reader, fmt, plan=plan, out=out, warn=warnings.append, source=source)
    with tempfile.TemporaryDirectory(prefix="bam-surgery-tokenizer-") as scratch:
        options = ExportOptions(
            tokenizer_files=inputs.files + _byte_tokenizer_files(fmt, inputs, Path(scratch)),
            generation=inputs.generation, model_card=inputs.model_card, metadata=_metadata(fmt, source, reader),
            recipe=recipe, max_shard_bytes=request.max_shard_bytes, replace=request.force,
            log=reporter.log if plan is None else None, own=_own(reader, fmt, request, plan))
        path = exporter(fmt).write(reader, out, options)
    for line in warnings:
        reporter.warning(line)
    return path


def _own(reader: Reader, fmt: str, request: ExportRequest, plan) -> Any:
    """The format's own options; a dense hf export's architecture defaults to the source's own (a merge has none)."""
    own = request.own if request.own is not None else format_options(fmt)()
    if getattr(own, "architecture", "") is None and plan is None and reader.architecture:
        own = dataclasses.replace(own, architecture=reader.architecture)
    return own


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


__all__ = ["REFUSED_FORMATS", "ExportInputs", "ExportRequest", "carried_files", "check_format_out", "convert",
           "export", "export_inputs", "format_options", "formats"]
