"""`bam-surgery export-onnx`: one ONNX graph of any checkpoint the tool opens, for onnxruntime.

    bam-surgery export-onnx mix.safetensors --out mix-onnx --verify
    bam-surgery export-onnx mix/ --out mix-onnx-fp16 --dtype fp16 --opset 20
    bam-surgery export-onnx mix/ --out mix-onnx-nocache --no-kv-cache

The same exporter as `convert --format onnx` (converters/onnx_export.py), with the options only this format
has. The folder also holds genai_config.json for ONNX Runtime GenAI (converters/onnx_genai.py: its token ids from
the checkpoint's generation config, as `bam-surgery generate` reads them) and what app/exports.py gathers for
every export: the checkpoint's tokenizer files and chat template, or, where the byte-tokenizer rule gives the
byte-level tokenizer, a tokenizer.json that writes it for GenAI's tokenizer. Every bad input (option value,
checkpoint, generation config, OUT) is one `bam-surgery: error:` line with exit status 2, checked before anything
is written; the folder appears at OUT only when it is complete (and verified, with --verify).
"""
from __future__ import annotations

from pathlib import Path

import click

from bam_surgery.app.exports import ExportRequest, export
from bam_surgery.app.inputs import open_input
from bam_surgery.converters.onnx_export import DTYPES, check_opset
from bam_surgery.converters.onnx_genai import GENAI_CONFIG
from bam_surgery.converters.onnx_graph import DEFAULT_OPSET
from bam_surgery.surgery.errors import BamSurgeryError

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
    with open_input(checkpoint, allow_pickle) as reader:  # a run folder stands for its latest checkpoint
        export(reader, out, "onnx", ExportRequest(dtype=DTYPES[dtype], opset=opset_number, kv_cache=not no_kv_cache,
                                                  verify=verify, force=force, log=lambda line: click.echo(line, err=True)),
               source=str(checkpoint))
        output_written(Path(out))
    click.echo(f"wrote {out} (onnx, {dtype}, opset {opset_number}"
               f"{', no KV cache' if no_kv_cache else ', KV cache'})", err=True)


def _integer(option: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise BamSurgeryError(f"{option}: {text!r} is not an integer") from None
