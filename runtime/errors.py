"""The runtime's user-facing error for files on disk (ConfigError, for configs, lives in config.py)."""
from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint file is unreadable, truncated or inconsistent; the message names file and tensor."""
