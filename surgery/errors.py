"""The one error type users see: a bad recipe, bad input, or a refused output path.

Every message is one line that names what is wrong and where (recipe field, input file, tensor)
and, where there is one, what to change. The CLI prints it as `bam-surgery: error: <message>` and
exits with status 2, without a traceback. Anything else that escapes is a bug and keeps its traceback.
"""
from __future__ import annotations

import errno
import os

from bam_surgery.runtime.config import ConfigError
from bam_surgery.runtime.errors import CheckpointError, OutputError, printable
from bam_surgery.train.errors import TrainError

__all__ = ["BamSurgeryError", "CheckpointError", "ConfigError", "InputError", "OutputError", "RecipeError",
           "USER_ERRORS", "missing_package_message", "one_line", "os_error_message"]


class BamSurgeryError(Exception):
    """A user-facing error; str(e) is the whole message."""


class RecipeError(BamSurgeryError):
    """A recipe file or name is invalid; the message names the recipe and the field."""


class InputError(BamSurgeryError):
    """An input checkpoint is unusable for this merge; the message names the file and tensor."""


# Errors raised by the layers below (reading checkpoints, validating configs, output paths, training)
# already carry a one-line message naming file/field; the CLI reports them the same way.
USER_ERRORS: tuple[type[BaseException], ...] = (BamSurgeryError, CheckpointError, ConfigError, TrainError)


def one_line(err: BaseException | str) -> str:
    """The error's message as one printable line: surrounding whitespace dropped, and control
    characters (a newline in a tensor name read from a file) escaped, so no message can forge a
    second output line."""
    text = str(err).strip()
    return printable(text) or type(err).__name__


# import name -> the distribution pip installs it from, where they differ
_DISTRIBUTIONS = {"yaml": "PyYAML", "lm_eval": "lm_eval", "onnxruntime_genai": "onnxruntime-genai",
                  "llama_cpp": "llama-cpp-python", "sklearn": "scikit-learn"}


def missing_package_message(e: ModuleNotFoundError) -> str | None:
    """A third-party package a command needs and this environment lacks, as one line saying what to install;
    None when the missing module is part of bam-surgery itself (a broken install, a bug: keep its traceback)."""
    name = (e.name or "").split(".")[0]
    if not name or name == "bam_surgery":
        return None
    dist = _DISTRIBUTIONS.get(name, name.replace("_", "-"))
    return (f"this command needs the Python package {dist!r}, which is not installed here "
            f"(pip install {dist}; requirements.txt pins the tested version)")


def os_error_message(e: OSError) -> str:
    """An OSError as one line naming the path: 'out/mix.safetensors: No space left on device'."""
    reason = e.strerror or (os.strerror(e.errno) if e.errno else None) or str(e) or type(e).__name__
    if e.errno == errno.ENOSPC:
        reason += " (free some space or write elsewhere; nothing was left half-written)"
    paths = [str(p) for p in (e.filename, e.filename2) if p is not None]
    return one_line(f"{' -> '.join(paths)}: {reason}" if paths else reason)
