"""What the console entry (cli/launch.py) needs before the commands, and torch, are imported; click and the
standard library only. cli/commands.py uses the same objects, so each is declared once:

* the line a Ctrl-C before anything was written prints;
* merge's --seed and --experts, and INPUTS, a command of those two alone: launch.py reads a merge's inputs
  with it (click's own parsing of the same options) to start hashing them while torch is imported.
"""
from __future__ import annotations

import click

INTERRUPTED = "interrupted; nothing was written"
INTERRUPTED_LINE = f"bam-surgery: {INTERRUPTED}"

SEED = click.option(
    "--seed", "seed", required=True, metavar="[NAME=]CKPT",
    help="The dense seed checkpoint every expert was branched from; it joins as expert 0 unless "
         "--no-seed-expert. Named 'seed' unless given NAME=CKPT.")
EXPERTS = click.option(
    "--experts", "experts", multiple=True, metavar="[NAME=]CKPT,...",
    help="Dense expert checkpoints branched from the seed, as NAME=CKPT (e.g. code=ckpt/code) or CKPT "
         "(named after its file or folder), comma-separated or the option repeated (one each, for a "
         "path holding a comma); they become experts 1, 2, ... in this order.")

# merge's input options alone, every other option and argument of the command line passed over
INPUTS = EXPERTS(SEED(click.Command("merge", add_help_option=False, context_settings=dict(
    ignore_unknown_options=True, allow_extra_args=True))))
