"""A training run's folder as a checkpoint input: it stands for its newest checkpoint.

    RUN/config.yaml  RUN/checkpoints/step-00000200/ ...     (train/checkpoints.py writes it; the layout is here so
                                                           that converters.open_checkpoint reads it too)
"""
from __future__ import annotations

import re
from pathlib import Path

from bam_surgery.runtime.errors import CheckpointError

CHECKPOINTS = "checkpoints"
_STEP_DIR = re.compile(r"^step-(\d{8,})$")


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def is_run_folder(path: Path) -> bool:
    return (path / "config.yaml").is_file() and (path / CHECKPOINTS).is_dir()


def list_checkpoints(run: Path) -> list[tuple[int, Path]]:
    root = Path(run) / CHECKPOINTS
    if not root.is_dir():
        return []
    out = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return sorted(out)


def latest_checkpoint(run: Path) -> Path | None:
    """The newest checkpoint: the highest step folder (every step folder is complete, since it is
    renamed into place whole; `latest` may lag it by one if a crash came between the two renames)."""
    found = list_checkpoints(run)
    return found[-1][1] if found else None


def resolve_run_folder(spec: str) -> str:
    """A run folder stands for its newest checkpoint (a CheckpointError when it has none yet); anything else is
    returned as is."""
    path = Path(spec)
    if path.is_dir() and is_run_folder(path):
        latest = latest_checkpoint(path)
        if latest is None:
            raise CheckpointError(f"{spec}: run folder has no checkpoint yet")
        return str(latest)
    return spec
