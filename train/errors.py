"""The training layer's user error: bad data, a tokenizer that does not fit, a refused run folder.

Its message is one line naming the file, field or option; the CLI prints it as
`bam-surgery: error: <message>` and exits with status 2 (surgery/errors.py lists it).
"""
from __future__ import annotations


class TrainError(ValueError):
    """A user-facing error of `train` / `eval` / `plot`; str(e) is the whole message."""
