"""The root of every user-facing error (UserError), the runtime's own, and how text read from files is shown.

Every error a user can fix derives from UserError: CheckpointError (files on disk), OutputError (a refused
or failed output path), OptionError (a value given on the command line) and UsageError here, ConfigError (configs) in
config.py, TrainError (train/errors.py), BamSurgeryError (surgery/errors.py). Their messages are one line
naming the file, tensor, field or option; the CLI catches UserError and prints it as
`bam-surgery: error: <message>` (exit status 2). Anything else that escapes is a bug and keeps its traceback.
"""
from __future__ import annotations

import re
import sys


class UserError(Exception):
    """An error the user can fix (a bad file, option, config or output path); str(e) is the whole message."""


class OptionError(UserError):
    """A value given on the command line (a size, a path's name) is unusable; the message names the option."""


class UsageError(OptionError):
    """Options that cannot go together (or a value click would have refused); the CLI shows it as click shows its
    own usage errors, with the command's --help named."""


class CheckpointError(UserError, ValueError):
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


def one_line(err: BaseException | str) -> str:
    """The error's message as one printable line: surrounding whitespace dropped, and control
    characters (a newline in a tensor name read from a file) escaped, so no message can forge a
    second output line."""
    text = str(err).strip()
    return printable(text) or type(err).__name__


def print_warning(msg: str) -> None:
    """A warning on stderr, the library's default where a caller gives no warn callback (the CLI passes its own,
    which holds warnings back behind a progress bar)."""
    print(f"bam-surgery: warning: {one_line(msg)}", file=sys.stderr)
