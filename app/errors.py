"""The one-line errors of the use cases, the same for the CLI and the Python API.

Every refusal is a runtime.errors.UserError (or a subclass: CheckpointError, ConfigError, TrainError, ...) whose
str() is one line naming the file, tensor, field or option: the CLI prints it as `bam-surgery: error: <line>`
with exit status 2; the Python API (bam_surgery.load, merge, ...) raises it. What the operating system or a
missing third-party package raise becomes the same kind of line here (`user_error`), for both. The error types
a caller catches are here too (the runtime defines them: runtime/errors.py).
"""
from __future__ import annotations

import errno
import functools
import os
from typing import Callable, TypeVar

from bam_surgery.runtime.errors import OptionError, UsageError, UserError, one_line, printable

F = TypeVar("F", bound=Callable)

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


def user_error(e: BaseException) -> UserError | None:
    """`e` as the UserError the API raises (its message one line): a UserError itself, an OSError (not a broken
    pipe) or a missing third-party package as their one line; None for anything else (a bug: its traceback)."""
    if isinstance(e, UserError):
        return e if "\n" not in str(e) else UserError(one_line(e))
    if isinstance(e, ModuleNotFoundError):
        message = missing_package_message(e)
        return UserError(message) if message is not None else None
    if isinstance(e, OSError) and e.errno != errno.EPIPE:
        return UserError(os_error_message(e))
    return None


def one_line_errors(function: F) -> F:
    """A public function whose refusals are UserErrors of one line (user_error)."""
    @functools.wraps(function)
    def checked(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except Exception as e:
            error = user_error(e)
            if error is None or error is e:
                raise
            raise error from e
    return checked


__all__ = ["OptionError", "UsageError", "UserError", "missing_package_message", "one_line", "one_line_errors",
           "os_error_message", "printable", "user_error"]
