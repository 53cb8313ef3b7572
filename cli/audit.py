"""`bam-surgery count-params` and `bam-surgery inspect`: declarations of app/params.py's use cases (count_params,
inspect); their tables are surgery/inspect.py's (render_audit, render_inspection). Both read checkpoint headers
only."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

import click

from bam_surgery.app.params import count_params, inspect
from bam_surgery.runtime.config import MAX_EXPERTS, PRESETS
from bam_surgery.surgery.audit import CONVENTIONS
from bam_surgery.surgery.options import MergeOptions

from .options import ALLOW_PICKLE, command_options, option, options_of


def natural_order(names) -> list[str]:
    """Names sorted with their numbers compared as numbers (some-64 before some-128)."""
    return sorted(names, key=lambda n: [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", n)])


# ---- commands -------------------------------------------------------------------------------
@dataclass(frozen=True)
class CountArgs:
    """count-params' options: what to count, the merge's options that change the count (MergeOptions' `counts`
    fields: the same flags as merge), and how."""

    ckpt: str | None = option(click.argument("ckpt", required=False))
    preset_name: str | None = option(
        "--preset", "preset_name", type=click.Choice(natural_order(PRESETS)),
        help="Count a built-in architecture (e.g. paper-small, Table 4) instead of a checkpoint.")
    recipe_name: str | None = option(
        "--recipe", "recipe_name", metavar="NAME",
        help="Count the mixture this recipe (name or YAML path) builds from the dense model.")
    experts: int | None = option(
        "--experts", type=click.IntRange(min=2, max=MAX_EXPERTS), metavar="N",
        help="Number of experts in the --recipe mixture (the seed counts as one; so do extra copies of the seed's "
             "FFN, as in the paper's Table 6).")
    options: MergeOptions = options_of(MergeOptions, only="counts")
    trainable: str | None = option(
        "--trainable", "trainable", metavar="PATTERNS",
        help="Count as trainable what `train --trainable PATTERNS` trains (groups or globs, '!' excludes; "
             "default: the preset's own patterns, e.g. some-64 freezes its experts, else every parameter).")
    convention: str = option(
        "--convention", type=click.Choice(CONVENTIONS), default="exact", show_default=True,
        help="exact: every parameter that runs; paper: the BAM paper's Table 5 counting (each deviation from exact "
             "is listed with its size), with the paper's routing (top-1 FFN expert, softmax gates) where the "
             "options above leave it to the recipe.")
    as_json: bool = option("--json", "as_json", is_flag=True, help="Print machine-readable JSON instead of a table.")
    allow_pickle: bool = option(ALLOW_PICKLE)


@click.command("count-params")
@command_options(CountArgs)
def count_params_cmd(args: CountArgs):
    """Total and active parameter counts by group, from shapes alone.

    CKPT is a canonical checkpoint (only its header is read); or give --preset. With --recipe and
    --experts, count the mixture the recipe would build from that dense model, with the merge's options
    (--ffn-top-k, --attention-routing, --extra-ffn-experts, the routers) as merge reads them.
    """
    count = count_params(args.ckpt, preset_name=args.preset_name, recipe=args.recipe_name, experts=args.experts,
                         options=args.options, trainable=args.trainable, convention=args.convention,
                         allow_pickle=args.allow_pickle)
    click.echo(json.dumps(count.to_dict(), indent=2) if args.as_json else count.table())


@click.command("inspect")
@click.argument("ckpt")
@click.option("--json", "as_json", is_flag=True, help="Print everything as machine-readable JSON.")
@ALLOW_PICKLE
def inspect_cmd(ckpt, as_json, allow_pickle):
    """Show a checkpoint's config, tensor groups (counts, bytes, dtypes) and provenance.

    Reads the header only. Layout mismatches (tensors that disagree with the checkpoint's own
    config) are listed and make the command exit with status 1.
    """
    ins = inspect(ckpt, allow_pickle)
    click.echo(json.dumps(ins.to_dict(), indent=2) if as_json else ins.table())
    if ins.audit.mismatches:
        click.get_current_context().exit(1)
