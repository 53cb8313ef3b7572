"""Checkpoint surgery's user errors: a bad recipe, a bad input, a merge that cannot be made.

Every message is one line that names what is wrong and where (recipe field, input file, tensor)
and, where there is one, what to change. They derive from runtime.errors.UserError, the one root the CLI
catches (printed as `bam-surgery: error: <message>`, exit status 2).
"""
from __future__ import annotations

from bam_surgery.runtime.errors import UserError


class BamSurgeryError(UserError):
    """A user-facing error of a merge; str(e) is the whole message."""


class RecipeError(BamSurgeryError):
    """A recipe file or name is invalid; the message names the recipe and the field."""


class InputError(BamSurgeryError):
    """An input checkpoint is unusable for this merge; the message names the file and tensor."""
