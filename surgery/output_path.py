"""Where a command may write: the OUT policy shared by merge and convert.

OUT must not exist unless --force; --force replaces only what the tool itself writes (a directory
holding anything else is refused); OUT may never be, or contain, one of the inputs.
"""
from __future__ import annotations

import fnmatch
from pathlib import Path

from bam_surgery.converters.export import exporters
from bam_surgery.runtime.reader import Reader

from .errors import BamSurgeryError
from .plan import Plan
from .provenance import input_files


def own_file(name: str) -> bool:
    """A file name some output format writes (what a directory may hold for --force to replace it)."""
    return any(fnmatch.fnmatchcase(name, glob) for e in exporters().values() for glob in e.writes)


def check_output_path(out: Path, force: bool, inputs: list[tuple[str, Reader]]) -> None:
    """Refuse an existing OUT without --force, a directory OUT holding anything but output files,
    and an OUT that is (or contains) one of the inputs, given as (label, reader) pairs."""
    if out.exists() or out.is_symlink():
        if not force:
            raise BamSurgeryError(f"{out}: already exists; pass --force to replace it")
        if out.is_dir() and not out.is_symlink():
            stray = sorted(p.name for p in out.iterdir() if not (p.is_file() and own_file(p.name)))
            if stray:
                raise BamSurgeryError(f"{out}: is a directory holding more than a checkpoint ({stray[0]}); "
                                      "--force only replaces checkpoints, remove it yourself or pick another OUT")
    resolved = out.resolve()
    for label, reader in inputs:
        for f in input_files(reader) + ([Path(label)] if label else []):
            try:
                same = f.resolve() == resolved or resolved in f.resolve().parents
            except OSError:
                same = False
            if same:
                raise BamSurgeryError(f"{out}: is input {label}; write the output somewhere else")


def plan_inputs(plan: Plan) -> list[tuple[str, Reader]]:
    return [(inp.label, inp.reader) for inp in plan.inputs]
