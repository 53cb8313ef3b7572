"""`bam-surgery export-onnx`: one ONNX graph of any checkpoint the tool opens, for onnxruntime.

    bam-surgery export-onnx mix.safetensors --out mix-onnx --verify
    bam-surgery export-onnx mix/ --out mix-onnx-fp16 --dtype fp16 --opset 20
    bam-surgery export-onnx mix/ --out mix-onnx-nocache --no-kv-cache

The same exporter as `convert --format onnx` (converters/onnx_export.py), with the options only this format
has. The folder also holds genai_config.json for ONNX Runtime GenAI (converters/onnx_genai.py: its token ids from
the checkpoint's generation config, as `bam-surgery generate` reads them) and the checkpoint's tokenizer files:
an HF folder's, a run checkpoint's tokenizer.json with its siblings, or, where train/tokenize.py's rules give the
byte-level tokenizer, a tokenizer.json that writes it for GenAI's tokenizer. Every bad input (option value,
checkpoint, generation config, OUT) is one `bam-surgery: error:` line with exit status 2, checked before anything
is written; the folder appears at OUT only when it is complete (and verified, with --verify).
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import click

from bam_surgery.app.inputs import open_input
from bam_surgery.converters.export import ExportOptions, check_export, export
from bam_surgery.converters.hf.files import side_file
from bam_surgery.converters.onnx_export import DTYPES, check_opset
from bam_surgery.converters.onnx_genai import GENAI_CONFIG, byte_tokenizer_files
from bam_surgery.converters.onnx_graph import DEFAULT_OPSET
from bam_surgery.runtime.output_path import check_output_path
from bam_surgery.surgery.card import generation_config, tokenizer_files
from bam_surgery.surgery.errors import BamSurgeryError
from bam_surgery.train.tokenize import BYTE_FALLBACK_MAX_VOCAB, BYTE_VOCAB, BYTES, checkpoint_tokenizer

from .options import ALLOW_PICKLE, OUT_FORCE, output_written

DTYPE_NAMES = ("fp32", "fp16")


@click.command("export-onnx")
@click.argument("checkpoint", metavar="CKPT")
@click.option("--out", required=True, type=click.Path(), metavar="DIR",
              help=f"Output folder: model.onnx (and model.onnx.data past 2 GB), README.md, {GENAI_CONFIG} (ONNX "
                   "Runtime GenAI), tokenizer files.")
@click.option("--opset", default=None, metavar="N",
              help="ONNX opset to write (14 to 20; default 17).")
@click.option("--dtype", default="fp32", show_default=True, metavar="|".join(DTYPE_NAMES),
              help="Weight and KV-cache dtype of the graph.")
@click.option("--no-kv-cache", "no_kv_cache", is_flag=True,
              help=f"Export input_ids, attention_mask, position_ids -> logits only (no past/present key values; no "
                   f"{GENAI_CONFIG}: GenAI needs the cache).")
@click.option("--verify", is_flag=True,
              help="Run the export in onnxruntime before writing it: logits of a left-padded prompt batch against "
                   "the runtime (fp32: within 1e-4) and greedy tokens through its KV cache against "
                   "runtime.generate; a mismatch writes nothing.")
@OUT_FORCE
@ALLOW_PICKLE
def export_onnx_cmd(checkpoint, out, opset, dtype, no_kv_cache, verify, force, allow_pickle) -> None:
    """Export a checkpoint as an ONNX graph with KV-cache inputs and outputs (onnxruntime)."""
    if dtype not in DTYPE_NAMES:
        raise BamSurgeryError(f"--dtype: unknown dtype {dtype!r}; choose one of {', '.join(DTYPE_NAMES)}")
    opset_number = DEFAULT_OPSET if opset is None else _integer("--opset", opset)
    check_opset(opset_number)
    out_path = Path(out)
    reader = open_input(checkpoint, allow_pickle)  # a run folder stands for its latest checkpoint
    with reader, tempfile.TemporaryDirectory(prefix="bam-surgery-tokenizer-") as scratch:
        check_export("onnx", reader.config)
        check_output_path(out_path, force, [(str(checkpoint), reader)])
        options = ExportOptions(tokenizer_files=tuple(export_tokenizer(reader, Path(scratch))), dtype=DTYPES[dtype],
                                generation=generation_config(reader), opset=opset_number, kv_cache=not no_kv_cache,
                                verify=verify, replace=force, log=lambda line: click.echo(line, err=True))
        export(reader, out_path, "onnx", options)
        output_written(out_path)
    click.echo(f"wrote {out_path} (onnx, {dtype}, opset {opset_number}"
               f"{', no KV cache' if no_kv_cache else ', KV cache'})", err=True)


def export_tokenizer(reader, scratch: Path) -> list[Path]:
    """The tokenizer files the export carries: an HF input's; else a canonical folder's tokenizer.json with its
    tokenizer_config.json and special_tokens_map.json; else, where train/tokenize.py's rules give the byte-level
    tokenizer (the checkpoint says so, or no tokenizer and a vocabulary of 256 to 512), tokenizer.json and
    tokenizer_config.json for GenAI (converters/onnx_genai.py), written into scratch."""
    files = tokenizer_files(reader)
    if any(f.name == "tokenizer.json" for f in files):
        return files
    carried = checkpoint_tokenizer(reader)
    if carried not in (None, BYTES):
        path = Path(carried)
        siblings = (side_file(path.parent, n) for n in ("tokenizer_config.json", "special_tokens_map.json"))
        return [path, *(p for p in siblings if p is not None and p.is_file())]
    if carried == BYTES or (not files and BYTE_VOCAB <= reader.config.vocab_size <= BYTE_FALLBACK_MAX_VOCAB):
        for name, text in byte_tokenizer_files().items():
            (scratch / name).write_text(text, encoding="utf-8")
            files.append(scratch / name)
    return files


def _integer(option: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise BamSurgeryError(f"{option}: {text!r} is not an integer") from None
