"""Sizes a user gives are checked against a bound before memory is allocated (issue 20, item 7): each
refusal is one line with the bound, reached through the error path before any large allocation (the
tests would run out of memory otherwise)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from conftest import cli_error_line, random_state, tiny_config
from bam_surgery.runtime.checkpoint import save_checkpoint
from bam_surgery.runtime.memory import check_fits, memory_limit
from bam_surgery.pipeline.schema import MAX_THREADS

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "data" / "domains"


def test_memory_limit_is_known_and_check_fits_names_both_numbers():
    limit = memory_limit()
    assert limit and limit > 2**28
    check_fits(limit // 2, "x", ValueError)
    with pytest.raises(ValueError, match=r"x needs at least .* GiB of memory; this machine has .* GiB"):
        check_fits(limit + 1, "x", ValueError)


@pytest.mark.parametrize("extra", [["--micro-batch", 1_000_000_000], ["--micro-batch", 2**40]])
def test_a_micro_batch_past_memory_is_refused_before_the_model_is_built(tmp_path, extra):
    line = cli_error_line("train", "--preset", "tiny", "--data", f"code={CORPUS}/code", "--out", tmp_path / "run",
                          "--steps", 1, "--token-cache", tmp_path / "cache", "--no-plot", "--no-progress", *extra)
    assert f"micro_batch {extra[1]}" in line and "GiB of RAM at its peak" in line and "GiB is available to it" in line


def test_a_model_config_that_cannot_fit_is_refused(tmp_path):
    body = {"vocab_size": 256, "d_model": 65536, "n_layers": 512, "n_heads": 64, "ffn_hidden": 262144,
            "max_positions": 128}
    path = tmp_path / "huge.json"
    path.write_text(json.dumps(body))
    line = cli_error_line("train", "--model-config", path, "--data", f"code={CORPUS}/code", "--out",
                          tmp_path / "run", "--steps", 1, "--token-cache", tmp_path / "cache", "--no-plot")
    assert "parameters) with micro_batch" in line and "GiB of RAM at its peak" in line
    assert "use a machine with more memory" in line  # no option makes 2 TB of weights fit


def test_a_router_hidden_width_past_memory_is_refused(tmp_path):
    cfg = tiny_config()
    seed = save_checkpoint(random_state(cfg), cfg, tmp_path / "seed.safetensors")
    for extra in (["--dry-run"], []):
        line = cli_error_line("merge", "--seed", seed, "--experts", seed, "--recipe", "bam", "--router", "mlp",
                              "--router-hidden", 2_000_000_000, "--out", tmp_path / "m.safetensors", *extra)
        assert "2000000000" in line and "GiB of memory" in line
    assert not (tmp_path / "m.safetensors").exists()


@pytest.mark.parametrize("threads", [10**9, MAX_THREADS + 1])
def test_pipeline_threads_are_bounded_dry_run_included(tmp_path, threads):
    doc = yaml.safe_load((ROOT / "recipes" / "pipelines" / "tiny.yaml").read_text())
    doc["threads"] = threads
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(doc))
    for extra in (["--dry-run"], []):
        line = cli_error_line("pipeline", path, "--out", tmp_path / "out", *extra)
        assert f"threads: must be in [1, {MAX_THREADS}]" in line
