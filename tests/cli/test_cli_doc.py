"""docs/cli.md, the command reference, is what docs/gen_cli.py writes from the commands' --help today."""
from __future__ import annotations

import difflib
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _generator():
    spec = importlib.util.spec_from_file_location("gen_cli", ROOT / "docs" / "gen_cli.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_command_reference_is_current():
    gen = _generator()
    want = gen.render()
    have = gen.DOC.read_text(encoding="utf-8")
    if have != want:
        diff = difflib.unified_diff(have.splitlines(), want.splitlines(), "docs/cli.md", "--help today", lineterm="", n=1)
        pytest.fail(f"docs/cli.md is out of date with the commands' --help: run {gen.REGENERATE}\n"
                    + "\n".join(list(diff)[:40]), pytrace=False)


def test_the_command_reference_has_every_command_and_option():
    from bam_surgery.cli.commands import cli

    text = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    for name, command in cli.commands.items():
        assert f"## `bam-surgery {name}`" in text
        for param in command.params:
            for opt in param.opts:
                if opt.startswith("-"):
                    assert opt in text, f"docs/cli.md: {name} {opt} is missing"
