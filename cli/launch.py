"""The console-script entry point: starts what can start before torch is imported, then the CLI.

    bam-surgery ...            (setup.py console script)
    python -m bam_surgery ...  (bam_surgery/__main__.py)

Importing the CLI imports torch, which takes 2-4 s (more on a cold page cache, where its 450 MB of
libraries are read from disk). A merge has to hash every input file for its provenance anyway
(surgery/hashing.py), so `merge` starts hashing the files it was given during that import
(surgery/digests.py: standard library and blake3 only); the merge takes those digests over, and
its own reads then find the inputs in the page cache. Only plain local paths are hashed early: a
.safetensors file, or a folder's weight files (those its model.safetensors.index.json names, or
model.safetensors); anything else (a hub id, a run folder, a pickle) is hashed by the merge as
before. Nothing starts for --dry-run (which reads no tensor data) or --help.
"""
from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import click

from bam_surgery.app.errors import UserError  # the app's errors and the runtime's leaf modules import no torch
from bam_surgery.runtime.shards import INDEX_NAME, read_index
from bam_surgery.surgery.specs import merge_inputs  # standard library only

from .early import INPUTS, INTERRUPTED_LINE


def _weight_files(path: Path) -> list[Path]:
    """A plain local checkpoint's weight files; [] when it is not one (the merge decides, later, and says why).
    The index is read by the one shard-index reader (runtime.shards.read_index: bounded, no torch)."""
    if path.is_file():
        return [path] if path.suffix == ".safetensors" else []
    if not path.is_dir():
        return []
    index = path / INDEX_NAME
    if index.is_file():
        try:
            weight_map, _ = read_index(index)
        except (OSError, UserError):
            return []
        names = sorted(set(weight_map.values()))
        return [path / n for n in names if n == os.path.basename(n) and n.endswith(".safetensors")
                and (path / n).is_file()]
    single = path / "model.safetensors"
    return [single] if single.is_file() else []


def merge_input_files(args: list[str]) -> list[Path]:
    """The weight files a `merge` command line names as --seed and --experts, read with merge's own options
    (cli/early.py) and spec lists (surgery/specs.py); a command line click would refuse names none."""
    if "--dry-run" in args or "--help" in args or "-h" in args:
        return []
    try:
        with INPUTS.make_context("merge", list(args), resilient_parsing=True) as ctx:
            seed, experts = ctx.params.get("seed"), ctx.params.get("experts") or ()
    except click.ClickException:
        return []
    files: list[Path] = []
    for _, spec in merge_inputs(seed, experts) if seed else []:
        try:
            files += _weight_files(Path(spec))
        except OSError:
            continue
    return list(dict.fromkeys(files))


def _exit_now(signum: int, frame) -> None:
    """Ctrl-C or SIGTERM while starting: nothing has been written, so the process ends here, at once. Raising
    KeyboardInterrupt instead let it land inside torch's imports, where library code caught it (7 of 68 merges
    and 14 of 41 converts completed anyway) or left modules half-initialised (ImportError tracebacks, and once
    a SIGSEGV when torch's extension was used half-loaded)."""
    os.write(2, (INTERRUPTED_LINE + "\n").encode())
    os._exit(128 + signum)


def main(argv: list[str] | None = None) -> None:
    previous = {sig: signal.signal(sig, _exit_now) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        args = sys.argv[1:] if argv is None else list(argv)
        if args[:1] == ["merge"]:
            files = merge_input_files(args[1:])
            if files:
                # lazy: only a merge with local inputs starts hashing, and before torch is imported
                from bam_surgery.surgery.digests import start_early
                start_early(files)
        # lazy: the commands import torch (seconds); merge's early hashing starts first, and Ctrl-C is caught
        from .commands import main as cli_main
    except KeyboardInterrupt:  # while starting (importing torch takes seconds): nothing has been written
        print(INTERRUPTED_LINE, file=sys.stderr, flush=True)
        sys.exit(130)
    for sig, handler in previous.items():  # from here the CLI's own handling (cli/commands.py: Group, main)
        signal.signal(sig, handler)
    cli_main(argv)


if __name__ == "__main__":
    main()
