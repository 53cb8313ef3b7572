"""The export commands: `bam-surgery convert`, `export-onnx` and `export-gguf`, declarations over one use case,
app/exports.py:convert (open the input, export it, what every export carries gathered once). Each format's own
options are declared by the format (converters/base.py:Exporter.Options) and become the flags here.

    bam-surgery convert hf-llama/ --out llama.safetensors
    bam-surgery export-onnx mix.safetensors --out mix-onnx --verify
    bam-surgery export-onnx mix/ --out mix-onnx-fp16 --dtype fp16 --opset 20
    bam-surgery export-gguf btx/ --out btx-q8.gguf --dtype q8_0
    llama-cli -m btx-q8.gguf -p "def fib(n):"            # llama.cpp, or llama_cpp.Llama(model_path=...)

export-onnx writes one ONNX graph with its KV cache for onnxruntime (converters/onnx_export.py), and
genai_config.json for ONNX Runtime GenAI; export-gguf one GGUF file for llama.cpp (converters/gguf_export.py): what
llama.cpp runs is decided from the config before anything is read, a BAM mixture (attention experts) refused in one
line naming the formats that carry it. Every bad input (option value, checkpoint, generation config, OUT) is one
`bam-surgery: error:` line with exit status 2, checked before anything is written; OUT appears only when it is
complete (and verified, with --verify).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from bam_surgery.app.errors import OptionError
from bam_surgery.app.exports import convert as app_convert
from bam_surgery.app.exports import format_options

from .options import (ALLOW_PICKLE, OUT_FORCE, CommandReporter, Writing, command_options, format_option, option,
                      options_of)

CKPT = click.argument("checkpoint", metavar="CKPT")
GGUF_SUFFIX = ".gguf"


@dataclass(frozen=True)
class ConvertArgs:
    checkpoint: str = option(CKPT)
    out: str = option(
        "--out", required=True, type=click.Path(), metavar="OUT",
        help="Output path: .safetensors file or directory (canonical), a directory (hf, mixtral, onnx), or a "
             "FILE.gguf (gguf).")
    fmt: str = option(format_option(
        "Output format (from any input: canonical file or directory, HF directory, hub id, Mixtral or HF BAM "
        "export)."))
    hf: Any = options_of(format_options("hf"))  # --architecture
    writing: Writing = options_of(Writing)  # --max-shard-size, --force, --allow-pickle
    quiet: bool = option("--quiet", "-q", is_flag=True, help="No summary line (convert draws no progress bar).")


@click.command("convert")
@command_options(ConvertArgs)
def convert(args: ConvertArgs) -> None:
    """Convert one checkpoint between formats, streamed (e.g. an HF Llama to canonical and back).

    The tokenizer files, chat template and generation config go with the weights into every format
    (docs/deploy.md, "What every export carries"); a format that cannot carry them says so in one line.
    """
    app_convert(args.checkpoint, args.out, args.fmt, own=args.hf if args.fmt == "hf" else None,
                **args.writing.keywords(), reporter=CommandReporter(log=False))
    if not args.quiet:
        click.echo(f"wrote {args.out} ({args.fmt})", err=True)


def format_args(fmt: str, out_metavar: str, out_help: str) -> type:
    """The options of a format's own export command, in --help order: CKPT, --out, the format's own flags (its
    Exporter.Options), --force, --allow-pickle."""
    return dataclasses.make_dataclass(f"{fmt.title()}Args", [
        ("checkpoint", str, option(CKPT)),
        ("out", str, option("--out", required=True, type=click.Path(), metavar=out_metavar, help=out_help)),
        ("own", Any, options_of(format_options(fmt))),
        ("force", bool, option(OUT_FORCE)),
        ("allow_pickle", bool, option(ALLOW_PICKLE))], frozen=True)


OnnxArgs = format_args("onnx", "DIR", "Output folder: model.onnx (and model.onnx.data past 2 GB), README.md, "
                                      "genai_config.json (ONNX Runtime GenAI), tokenizer files.")
GGUFArgs = format_args("gguf", "FILE.gguf", "Output file (a name ending in .gguf): weights, tokenizer and model card "
                                            "in one file.")


@click.command("export-onnx")
@command_options(OnnxArgs)
def export_onnx_cmd(args) -> None:
    """Export a checkpoint as an ONNX graph with KV-cache inputs and outputs (onnxruntime)."""
    own = args.own
    app_convert(args.checkpoint, args.out, "onnx", own=own, force=args.force, allow_pickle=args.allow_pickle,
                reporter=CommandReporter())
    click.echo(f"wrote {args.out} (onnx, {own.dtype_name}, opset {own.opset}"
               f"{', KV cache' if own.kv_cache else ', no KV cache'})", err=True)


@click.command("export-gguf")
@command_options(GGUFArgs)
def export_gguf_cmd(args) -> None:
    """Export a checkpoint as one GGUF file for llama.cpp (Llama-family models and their BTX mixtures)."""
    out = Path(args.out)
    if not out.name.endswith(GGUF_SUFFIX) or out.name == GGUF_SUFFIX:
        raise OptionError(f"--out {out}: a GGUF file needs a name ending in {GGUF_SUFFIX} (e.g. model{GGUF_SUFFIX})")
    app_convert(args.checkpoint, out, "gguf", own=args.own, force=args.force, allow_pickle=args.allow_pickle,
                reporter=CommandReporter())
    click.echo(f"wrote {out} (gguf)", err=True)
