"""Atomic outputs: write under a temporary sibling path, rename onto the target only on success.

An interrupted or failed write leaves nothing at the target (and an existing target untouched).
"""
from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


@contextmanager
def atomic_path(target: str | os.PathLike, is_dir: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling path; rename it onto `target` only if the block succeeds."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent))
    work = tmp if is_dir else tmp / target.name
    try:
        yield work
        if target.exists():
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            else:
                target.unlink()
        os.replace(work, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def atomic_dir(target: str | os.PathLike) -> Iterator[Path]:
    """atomic_path for a directory, created empty."""
    with atomic_path(target, is_dir=True) as tmp:
        tmp.mkdir(parents=True, exist_ok=True)
        yield tmp
