"""The one error type users see: a bad recipe, bad input, or a refused output path.

Every message is one line that names what is wrong and where (recipe field, input file, tensor)
and, where there is one, what to change. The CLI prints it as `bam-surgery: error: <message>` and
exits with status 2, without a traceback. Anything else that escapes is a bug and keeps its traceback.
"""
from __future__ import annotations

from bam_surgery.runtime.checkpoint import CheckpointError
from bam_surgery.runtime.config import ConfigError
from bam_surgery.train.errors import TrainError


class BamSurgeryError(Exception):
    """A user-facing error; str(e) is the whole message."""


class RecipeError(BamSurgeryError):
    """A recipe file or name is invalid; the message names the recipe and the field."""


class InputError(BamSurgeryError):
    """An input checkpoint is unusable for this merge; the message names the file and tensor."""


# Errors raised by the layers below (reading checkpoints, validating configs, training) already carry a
# one-line message naming file/field; the CLI reports them the same way.
USER_ERRORS: tuple[type[BaseException], ...] = (BamSurgeryError, CheckpointError, ConfigError, TrainError)


def one_line(err: BaseException) -> str:
    """The error's message on a single line (nested messages can carry newlines)."""
    return " ".join(str(err).split()) or type(err).__name__
