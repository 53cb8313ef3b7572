"""Where a command may write: the OUT policy of every command that writes (merge, convert, ...); atomic.py,
beside it, does the writing.

    check_output_path(out, force, inputs)     before any work: refuse early, in one line

* OUT must not exist unless --force; with --force it is replaced only if it is an output of
  bam-surgery (runtime.outputs.not_own_output: our metadata or our marker, nothing foreign in a
  folder), never `.`, `..`, the working directory or its parents, the home folder, `/`, a symlink.
* OUT may never be, or contain, one of the inputs.
The same ownership test runs again at the final rename (runtime.atomic), so what appears at OUT
while a run writes is never removed.
"""
from __future__ import annotations

import os
from pathlib import Path

from .errors import OptionError
from .outputs import not_own_output
from .reader import Reader


def check_output_path(out: Path, force: bool, inputs: list[tuple[str, Reader]]) -> None:
    """Refuse a bad OUT before any work: no usable name, an existing OUT without --force, an OUT
    that is (or contains) an input, and with --force anything that is not our own output."""
    raw = os.fspath(out)
    if raw in ("", ".", "..") or Path(raw).name in ("", ".", ".."):
        raise OptionError(f"--out {raw!r}: not a name an output can be written to; give a file or folder name "
                              "(e.g. out/mix.safetensors or out/mix)")
    out = Path(raw)
    exists = os.path.lexists(out)
    if exists and not force:
        raise OptionError(f"{out}: already exists; pass --force to replace it")
    resolved = out.resolve()
    for label, reader in inputs:
        for f in input_files(reader) + ([Path(label)] if label else []):
            try:
                same = f.resolve() == resolved or resolved in f.resolve().parents
            except OSError:
                same = False
            if same:
                raise OptionError(f"{out}: is input {label}; write the output somewhere else")
    if exists:
        reason = not_own_output(out)
        if reason:
            raise OptionError(f"{out}: {reason}; --force replaces only outputs of bam-surgery, so remove it "
                                  "yourself or write elsewhere")


def input_files(reader: Reader) -> list[Path]:
    """The files a reader reads, resolved (what provenance hashes and OUT may not overwrite)."""
    return [Path(f).resolve() for f in reader.files()]
