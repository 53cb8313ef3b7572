"""Two processes under torchrun (gloo, CPU), DDP and FSDP2, against one process with the same global
batch; checkpoints of a sharded run load and resume in one process."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from bam_surgery.runtime import Model, load_checkpoint, load_model, preset, save_model
from bam_surgery.cli.commands import cli

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "data" / "domains"
pytestmark = pytest.mark.slow  # torchrun with two processes


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    model = Model(preset("tiny", d_model=32, n_layers=2, n_heads=4, n_kv_heads=4, ffn_hidden=48, max_positions=32,
                         ffn_experts=3, attn_experts=3))
    model.reset_parameters(seed=2)
    mix = save_model(model, root / "mix.safetensors")
    # 2 processes x micro-batch 2 = one process accumulating 2 micro-batches of 2; eval of 64 tokens is one
    # batch, so the second process runs a discarded one (both must make the same collective calls)
    args = ["train", "--init", mix, "--data", f"code={CORPUS}/code,law={CORPUS}/law:0.5", "--seq-len", 32,
            "--micro-batch", 2, "--batch-tokens", 2 * 2 * 32, "--steps", 3, "--warmup-steps", 1, "--lr", 2e-3,
            "--eval-tokens", 64, "--token-cache", root / "cache", "--trainable", "*,!norms", "--no-plot",
            "--save-every", 0]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = CliRunner().invoke(cli, [str(a) for a in args + ["--out", root / "one"]])
    finally:
        torch.set_num_threads(threads)
    assert result.exit_code == 0, result.output
    return root, [str(a) for a in args]


def _records(run: Path, kind: str) -> list[dict]:
    return [r for r in map(json.loads, open(run / "metrics.jsonl")) if r["kind"] == kind]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_processes_match_one(setup, strategy):
    root, args = setup
    out = root / strategy
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "bam_surgery", *args, "--out", str(out), "--strategy", strategy]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    one, two = _records(root / "one", "train"), _records(out, "train")
    assert len(two) == 3
    for a, b in zip(one, two):
        for key in ("loss", "nll", "lb_loss", "z_loss", "grad_norm"):
            assert b[key] == pytest.approx(a[key], abs=1e-5), (key, a["step"])
    ev1, ev2 = _records(root / "one", "eval")[-1], _records(out, "eval")[-1]
    for dom in ("code", "law"):
        assert ev2["domains"][dom]["tokens"] == ev1["domains"][dom]["tokens"] == 64
        assert ev2["domains"][dom]["loss"] == pytest.approx(ev1["domains"][dom]["loss"], abs=1e-5)
        assert ev2["domains"][dom]["routing"]["ffn"]["share"] == pytest.approx(
            ev1["domains"][dom]["routing"]["ffn"]["share"], abs=1e-6)
    ckpt = out / "checkpoints" / "step-00000003"
    load_model(ckpt)  # the gathered checkpoint loads in one process
    _, a = load_checkpoint(root / "one" / "checkpoints" / "step-00000003")
    _, b = load_checkpoint(ckpt)
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5
    if strategy == "fsdp":  # and the sharded run resumes in one process
        runner = CliRunner()
        for run in (out, root / "one"):
            result = runner.invoke(cli, ["train", "--out", str(run), "--resume", "--steps", "4"])
            assert result.exit_code == 0, result.output
        assert _records(out, "train")[-1]["loss"] == pytest.approx(_records(root / "one", "train")[-1]["loss"],
                                                                   abs=1e-5)
