"""`bam-surgery extend`: the declaration of app/extend.py's use case (specialists added to a trained mixture)."""
from __future__ import annotations

from dataclasses import dataclass

import click

from bam_surgery.app.extend import extend
from bam_surgery.surgery.options import ExtendOptions
from bam_surgery.surgery.specs import split_specs

from .options import CommandReporter, Writing, command_options, option, options_of


@dataclass(frozen=True)
class ExtendArgs:
    """Every option of `bam-surgery extend`: its inputs and output here, the rest one ExtendOptions
    (surgery/options.py: its fields declare their flags)."""

    mixture: str = option(click.argument("mixture", metavar="MIXTURE"))
    experts: tuple[str, ...] = option(
        "--experts", "experts", multiple=True, required=True, metavar="[NAME=]CKPT,...",
        help="Dense specialists branched from the mixture's seed, as NAME=CKPT or CKPT (named after its file or "
             "folder), comma-separated or the option repeated; they become the experts after the mixture's, in this "
             "order.")
    out: str = option("--out", "out", required=True, type=click.Path(), metavar="OUT",
                      help="Output path: a name ending in .safetensors writes one file, anything else a directory of "
                           "shards (canonical; `convert` exports it).")
    options: ExtendOptions = options_of(ExtendOptions)
    writing: Writing = options_of(Writing)  # --max-shard-size, --force, --allow-pickle
    quiet: bool = option("--quiet", "-q", is_flag=True, help="No progress lines and no summary line.")


@click.command("extend")
@command_options(ExtendArgs)
def extend_cmd(args: ExtendArgs) -> None:
    """Add specialists to a trained mixture: their FFN (and attention) experts after the mixture's, one new router
    row each, everything else the mixture's as training left it.

    MIXTURE is a mixture checkpoint or a train run folder (its newest checkpoint). docs/merging.md, "Adding
    experts to a trained mixture", has the identities and the rules for the new rows.
    """
    result = extend(args.mixture, split_specs(args.experts), args.out, options=args.options,
                    **args.writing.keywords(), reporter=CommandReporter(log=not args.quiet))
    if not args.quiet:
        before, cfg = result.extension.before, result.extension.config
        click.echo(f"wrote {result.path}: {before.ffn_experts} -> {cfg.ffn_experts} FFN experts, "
                   f"{before.attn_experts} -> {cfg.attn_experts} attention experts", err=True)
