"""Command-line options that several commands share, declared once (each with its help sentence).

    @cli.command()
    @OUT_FORCE
    @MAX_SHARD_SIZE
    def my_command(force, max_shard_size): ...
"""
from __future__ import annotations

import click

from bam_surgery.converters.export import exporters

FORMATS = {name: e.summary for name, e in exporters().items()}  # converters.export's table, in order

MAX_SHARD_SIZE = click.option("--max-shard-size", metavar="SIZE",
                              help="Largest shard of a directory output, e.g. 2GB, 500MB, 1GiB (default: one shard).")
OUT_FORCE = click.option("--force", is_flag=True, help="Replace OUT if it exists.")
ALLOW_PICKLE = click.option("--allow-pickle", is_flag=True,
                            help="Also read pickle (.bin) weights of Hugging Face inputs (torch.load with "
                                 "weights_only=True).")


def format_option(intro: str) -> callable:
    """--format, its choices and help from the exporter table."""
    return click.option("--format", "fmt", type=click.Choice(list(FORMATS)), default="canonical", show_default=True,
                        help=intro + " " + "; ".join(f"{k}: {v}" for k, v in FORMATS.items()) + ". Formats other "
                             "than canonical need a directory OUT.")
