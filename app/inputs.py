"""One way for every command to open a checkpoint argument.

Anything `converters.open_checkpoint` reads (canonical file or folder, HF folder, hub id, our exports),
or a training run folder, which stands for its latest checkpoint (`train.checkpoints.resolve_checkpoint`).
Errors come back as one user-error line that names the argument.
"""
from __future__ import annotations

from bam_surgery import converters  # called as converters.open_checkpoint: one seam for tests to replace
from bam_surgery.runtime.reader import Reader
from bam_surgery.train.checkpoints import resolve_checkpoint

from bam_surgery.runtime.errors import UserError, one_line
from bam_surgery.surgery.errors import BamSurgeryError


def resolved_input(spec: str) -> str:
    """The checkpoint a spec stands for: a run folder's newest checkpoint, anything else as it is."""
    return resolve_checkpoint(spec)


def open_input(spec: str, allow_pickle: bool = False) -> Reader:
    try:
        return converters.open_checkpoint(resolved_input(spec), allow_pickle=allow_pickle)
    except (UserError, OSError) as e:
        msg = one_line(e) if not isinstance(e, OSError) else f"cannot open ({e.strerror or e})"
        raise BamSurgeryError(msg if spec in msg else f"{spec}: {msg}") from e
