"""docs/cli.md, the command reference, is what docs/gen_cli.py writes from the commands' --help today."""
from __future__ import annotations

from pathlib import Path

from conftest import assert_doc_current, doc_generator

ROOT = Path(__file__).resolve().parents[2]


def _generator():
    return doc_generator("gen_cli")


def test_the_command_reference_is_current():
    assert_doc_current(_generator())


def test_the_command_reference_has_every_command_and_option():
    from bam_surgery.cli.commands import cli

    text = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    for name, command in cli.commands.items():
        assert f"## `bam-surgery {name}`" in text
        for param in command.params:
            for opt in param.opts:
                if opt.startswith("-"):
                    assert opt in text, f"docs/cli.md: {name} {opt} is missing"
