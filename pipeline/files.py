"""What the pipeline writes and reads back besides checkpoints: its records (JSON, YAML, Markdown: atomic, their
folder made as needed) and the training seconds a unit's checkpoint records. Shared by run.py and report.py."""
from __future__ import annotations

from pathlib import Path

from bam_surgery.runtime.atomic import write_text_atomic
from bam_surgery.train.checkpoints import checkpoint_elapsed


def write_record(path: Path, text: str) -> None:
    """`text` at `path`, whole or not at all (runtime.atomic.write_text_atomic), its folder made as needed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, text)


def training_seconds(ckpt: Path | None) -> float | None:
    """Seconds of training steps over every attempt (the checkpoint's timing.json), to the millisecond."""
    elapsed = checkpoint_elapsed(Path(ckpt)) if ckpt is not None else None
    return None if elapsed is None else round(elapsed, 3)
