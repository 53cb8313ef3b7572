"""What the pipeline writes and reads back besides checkpoints: its records (JSON, YAML, Markdown: atomic, their
folder made as needed), the training seconds a unit's checkpoint records, and the provenance every record
carries (the code's commit, the machine). Shared by run.py and report.py."""
from __future__ import annotations

import functools
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch

import bam_surgery
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


def _git(root: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


@functools.lru_cache(maxsize=1)
def code_commit() -> str:
    """The commit of the code that runs: `git rev-parse HEAD` of the checkout the package is imported from
    (suffixed `+dirty` when tracked files differ from it), else `bam-surgery VERSION` (an installed wheel)."""
    root = Path(bam_surgery.__file__).resolve().parents[1]
    head = _git(root, "rev-parse", "--short=12", "HEAD") if (root / ".git").exists() else None
    if not head:
        return f"bam-surgery {bam_surgery.__version__}"
    dirty = _git(root, "status", "--porcelain", "--untracked-files=no")
    return head + ("+dirty" if dirty else "")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@functools.lru_cache(maxsize=1)
def machine() -> str:
    """One line naming the machine: CPU model, the cores this process may use, memory, OS."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    try:
        mem = f", {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB"
    except (ValueError, OSError, AttributeError):
        mem = ""
    return f"{_cpu_model()}, {cores} cores{mem}, {platform.system()} {platform.machine()}"


def provenance(short: bool = False) -> dict[str, Any]:
    """The commit and machine (short: those two), and the versions that decide the numbers."""
    out = {"commit": code_commit(), "machine": machine()}
    if not short:
        out.update(python=platform.python_version(), torch=torch.__version__, threads=torch.get_num_threads())
    return out
