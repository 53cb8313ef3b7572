"""Resolve a checkpoint spec (path or hub id) to a lazy reader with canonical tensor names."""
from __future__ import annotations

from runtime.checkpoint import CheckpointReader


def open_checkpoint(spec: str, allow_pickle: bool = False):
    """Open a canonical .safetensors file or canonical directory. (HF dirs and hub ids: converters issue.)"""
    return CheckpointReader(spec)
