"""The training layer's user error: bad data, a tokenizer that does not fit, a refused run folder.

Its message is one line naming the file, field or option; the CLI prints it as
`bam-surgery: error: <message>` and exits with status 2 (a runtime.errors.UserError).
"""
from __future__ import annotations

from bam_surgery.runtime.errors import UserError


class TrainError(UserError, ValueError):
    """A user-facing error of `train` / `eval` / `plot`; str(e) is the whole message."""
