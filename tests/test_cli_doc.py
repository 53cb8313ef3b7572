"""docs/cli.md, the command reference, is what docs/gen_cli.py writes from the commands' --help today."""
from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _generator():
    spec = importlib.util.spec_from_file_location("gen_cli", ROOT / "docs" / "gen_cli.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_command_reference_is_current():
    gen = _generator()
    want = gen.render()
    have = gen.DOC.read_text(encoding="utf-8")
    assert have == want, f"docs/cli.md is out of date with the commands' --help: run {gen.REGENERATE}"


def test_the_command_reference_has_every_command_and_option():
    from bam_surgery.cli.commands import cli

    text = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    for name, command in cli.commands.items():
        assert f"## `bam-surgery {name}`" in text
        for param in command.params:
            for opt in param.opts:
                if opt.startswith("-"):
                    assert opt in text, f"docs/cli.md: {name} {opt} is missing"
