"""The runtime's user-facing errors, and how text read from files is shown.

CheckpointError (files on disk) and OutputError (a refused or failed output path) live here;
ConfigError (configs) lives in config.py. Their messages are one line naming the file, tensor or
field; the CLI prints them as `bam-surgery: error: <message>`.
"""
from __future__ import annotations

import re


class CheckpointError(ValueError):
    """A checkpoint file is unreadable, truncated or inconsistent; the message names file and tensor."""


class OutputError(CheckpointError):
    """An output path is refused (it exists, it is not ours to replace, something appeared there while
    writing) or could not be written; the message names the path."""


class OutputWriteError(OutputError, OSError):
    """Writing an output failed in the operating system (no space, read-only file system, quota):
    an OSError too, with the original errno, so callers that catch OSError still do."""

    def __init__(self, message: str, errno_: int | None = None):
        super().__init__(message)
        self.errno = errno_


# C0 and C1 control characters, DEL, and the Unicode line and paragraph separators: anything that
# could end a line or drive a terminal when a name read from a file is printed.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def printable(text: object) -> str:
    """`text` with control characters escaped as Python writes them (\\n, \\x1b, \\u2028): a tensor
    name, a config string or a path read from a file cannot start a new output line or send escape
    sequences to the terminal."""
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], str(text))
