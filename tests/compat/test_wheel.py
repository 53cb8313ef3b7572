"""The package as a user gets it: a wheel built from this checkout, installed into a fresh venv with the pinned
requirements (requirements.txt: no transformers), run from another directory.

Run by `make test-compat` (it installs torch and the rest into a new venv: about a minute); BAM_COMPAT_STAGE=1
there. Checked: `pip check`, the wheel's version is bam_surgery.__version__, `bam-surgery --help`,
`python -m bam_surgery merge` on tiny branched models, and `merge --format hf` / `--format mixtral` written
without transformers installed, each output read back by the installed package.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import bam_surgery

ROOT = Path(__file__).resolve().parents[2]
if os.environ.get("BAM_COMPAT_STAGE") != "1":
    pytest.skip("builds a venv with torch (about a minute): run by make test-compat", allow_module_level=True)

TINY_MODELS = """
import sys, torch
from bam_surgery.runtime import Model, ModelConfig, save_model
cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, ffn_hidden=48, max_positions=32, name="tiny")
seed = Model(cfg)
seed.reset_parameters(std=0.05, seed=0)
save_model(seed, "seed.safetensors")
for i, name in enumerate(["code", "law"]):
    torch.manual_seed(i + 1)
    with torch.no_grad():
        for p in seed.parameters():
            p.add_(0.001 * torch.randn_like(p))
    save_model(seed, name + ".safetensors")
"""


def _run(cmd, cwd, env, timeout=600) -> subprocess.CompletedProcess:
    result = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{cmd}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(venv bin dir, environment, a working directory outside the checkout)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"  # build from a copy: the checkout gets no build/ or egg-info
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", ".venv*", "build", "dist", "*.egg-info",
                                                             "__pycache__", "demo-out", "reproduce-out", "bench-out"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", tmp / "dist", src],
         cwd=tmp, env=env)
    wheels = list((tmp / "dist").glob("bam_surgery-*.whl"))
    assert len(wheels) == 1 and wheels[0].name.startswith(f"bam_surgery-{bam_surgery.__version__}-"), wheels
    base = getattr(sys, "_base_executable", sys.executable)
    _run([base, "-m", "venv", tmp / "venv"], cwd=tmp, env=env)
    bin_dir = tmp / "venv" / "bin"
    _run([bin_dir / "python", "-m", "pip", "install", "-q", "-r", ROOT / "requirements.txt", wheels[0]], cwd=tmp,
         env=env)
    work = tmp / "elsewhere"
    work.mkdir()
    return bin_dir, env, work


def test_installed_environment_is_consistent_and_has_no_transformers(installed):
    bin_dir, env, work = installed
    _run([bin_dir / "python", "-m", "pip", "check"], cwd=work, env=env)
    probe = _run([bin_dir / "python", "-c", "import importlib.util, bam_surgery; "
                  "print(bam_surgery.__version__, importlib.util.find_spec('transformers') is None, bam_surgery.__file__)"],
                 cwd=work, env=env).stdout.split()
    assert probe[0] == bam_surgery.__version__ and probe[1] == "True"
    assert str(ROOT) not in probe[2] and "site-packages" in probe[2]  # the installed copy, not the checkout


def test_console_script_and_module_run_a_merge_and_both_exports(installed):
    bin_dir, env, work = installed
    help_text = _run([bin_dir / "bam-surgery", "--help"], cwd=work, env=env).stdout
    assert "merge" in help_text and "count-params" in help_text
    _run([bin_dir / "python", "-c", TINY_MODELS], cwd=work, env=env)
    experts = "code=code.safetensors,law=law.safetensors"
    _run([bin_dir / "python", "-m", "bam_surgery", "merge", "--seed", "seed.safetensors", "--experts", experts,
          "--out", "mix.safetensors"], cwd=work, env=env)
    _run([bin_dir / "bam-surgery", "merge", "--seed", "seed.safetensors", "--experts", experts, "--format", "hf",
          "--out", "mix-hf"], cwd=work, env=env)
    _run([bin_dir / "bam-surgery", "merge", "--seed", "seed.safetensors", "--experts", experts, "--recipe", "btx",
          "--gate-norm", "topk_softmax", "--format", "mixtral", "--out", "mix-mixtral"], cwd=work, env=env)
    assert {p.name for p in (work / "mix-hf").glob("*.py")} >= {"modeling_bam.py", "configuration_bam.py",
                                                                "schema_bam.py", "blocks_bam.py", "routers.py"}
    for out, words in [("mix.safetensors", "3 FFN experts"), ("mix-hf", "3 FFN experts"),
                       ("mix-mixtral", "3 FFN experts")]:
        shown = _run([bin_dir / "bam-surgery", "inspect", out], cwd=work, env=env).stdout
        assert words in shown or "ffn_experts" in shown, (out, shown[:2000])
    counted = _run([bin_dir / "bam-surgery", "count-params", "mix-hf"], cwd=work, env=env).stdout
    assert "attention_experts" in counted and "total" in counted
