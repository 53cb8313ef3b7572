"""`bam-surgery export-gguf`: one GGUF file of a checkpoint for llama.cpp.

    bam-surgery export-gguf seed.safetensors --out seed.gguf
    bam-surgery export-gguf btx/ --out btx-q8.gguf --dtype q8_0
    llama-cli -m btx-q8.gguf -p "def fib(n):"            # llama.cpp, or llama_cpp.Llama(model_path=...)

The same exporter as `merge --format gguf` and `convert --format gguf` (converters/gguf_export.py), with the
matrices' type as an option. What llama.cpp runs (Llama/Mistral/Qwen2-shaped dense models, Mixtral-shaped BTX
mixtures, btx-shared-expert mixtures with softmax gates as qwen2moe) is decided from the config before anything is
read; a BAM mixture (attention experts) is refused in one line naming the formats that carry it. The tokenizer
goes into the file (app/exports.py gathers it, as for every export): the checkpoint's tokenizer.json (byte-level
BPE) with its chat template, or the byte tokenizer. Every bad input is
one `bam-surgery: error:` line with exit status 2; the file appears at OUT only when it is complete.
"""
from __future__ import annotations

from pathlib import Path

import click

from bam_surgery.app.exports import ExportRequest, export
from bam_surgery.app.inputs import open_input
from bam_surgery.converters.gguf_export import GGUF_DTYPES, SUFFIX
from bam_surgery.surgery.errors import BamSurgeryError

from .options import ALLOW_PICKLE, OUT_FORCE, output_written


@click.command("export-gguf")
@click.argument("checkpoint", metavar="CKPT")
@click.option("--out", required=True, type=click.Path(), metavar="FILE.gguf",
              help="Output file (a name ending in .gguf): weights, tokenizer and model card in one file.")
@click.option("--dtype", default=None, metavar="|".join(GGUF_DTYPES),
              help="Type of the weight matrices: f32, f16 or q8_0 (8-bit blocks of 32); norms, biases and routers "
                   "stay f32. Default: f32 for float32 checkpoints, f16 for 16-bit ones.")
@OUT_FORCE
@ALLOW_PICKLE
def export_gguf_cmd(checkpoint, out, dtype, force, allow_pickle) -> None:
    """Export a checkpoint as one GGUF file for llama.cpp (Llama-family models and their BTX mixtures)."""
    if dtype is not None and dtype not in GGUF_DTYPES:
        raise BamSurgeryError(f"--dtype: unknown dtype {dtype!r}; choose one of {', '.join(GGUF_DTYPES)}")
    out_path = Path(out)
    if not out_path.name.endswith(SUFFIX) or out_path.name == SUFFIX:
        raise BamSurgeryError(f"--out {out}: a GGUF file needs a name ending in {SUFFIX} (e.g. model{SUFFIX})")
    lines: list[str] = []
    with open_input(checkpoint, allow_pickle) as reader:  # a run folder stands for its latest checkpoint
        export(reader, out_path, "gguf", ExportRequest(gguf_dtype=dtype, force=force, log=lines.append),
               source=str(checkpoint))
        output_written(out_path)
    for line in lines:
        click.echo(line, err=True)
    click.echo(f"wrote {out_path} (gguf)", err=True)
