"""A quick run of benchmarks/kill9.py: merges killed with SIGKILL at random points leave OUT absent
or complete (byte-identical to an uninterrupted run), and the next run on the same OUT removes the
killed run's work folder and completes. `python -m benchmarks.kill9 --trials 50` is the long run."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.kill9 import run_trials  # noqa: E402

pytestmark = pytest.mark.slow  # merges in subprocesses, killed


def test_killed_merges_leave_out_absent_or_complete_and_no_debris(tmp_path):
    lines: list[str] = []
    problems = run_trials(tmp_path / "kill9", trials=3, layers=2, seed=1, log=lines.append)
    assert problems == [], "\n".join(lines + problems)
    assert lines[-1].startswith("3 trials:")
