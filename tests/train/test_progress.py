"""train and eval print progress lines when stderr is not a terminal (a log file, a scheduler): a user saw
nothing for 10-40 minutes. Tested without waiting: the interval set to 0 gives a line per step / batch."""
from __future__ import annotations

from pathlib import Path

import pytest

from conftest import run_cli, seed_and_experts, tiny_config
from bam_surgery.train import progress

ROOT = Path(__file__).resolve().parents[2]
DATA = f"code={ROOT / 'data/domains/code'}"


@pytest.fixture
def every_tick(monkeypatch):
    monkeypatch.setattr(progress, "PROGRESS_EVERY_S", 0.0)


@pytest.mark.slow
def test_train_and_eval_print_progress_lines_without_a_terminal(tmp_path, every_tick, one_thread):
    seed = seed_and_experts(tmp_path, tiny_config(vocab_size=256, max_positions=32), names=("seed",))[0]
    run = tmp_path / "run"
    result = run_cli("train", "--init", seed, "--data", DATA, "--out", run, "--steps", "3", "--seq-len", "16",
                     "--micro-batch", "2", "--eval-tokens", "32", "--no-plot")
    lines = [ln for ln in result.stderr.splitlines() if ln.startswith("step: ")]
    assert [ln.split(" (")[0] for ln in lines] == ["step: 1/3", "step: 2/3", "step: 3/3"], result.stderr
    assert "loss " in lines[0] and "tokens/s" in lines[0]
    result = run_cli("eval", run, "--data", DATA, "--seq-len", "16", "--max-tokens", "64", "--batch-size", "1")
    assert "eval batches: 1/" in result.stderr and "(code)" in result.stderr, result.stderr


def test_no_lines_before_the_interval(tmp_path, one_thread):
    lines: list[str] = []
    ticker = progress.ProgressLines("step", 10, lines.append)
    ticker.tick(1)
    assert lines == []  # 30 s have not passed
    progress.ProgressLines("step", 10, lines.append, enabled=False).tick(1)
    assert lines == []
