"""The console script's start (cli/launch.py): a Ctrl-C while the CLI is still being imported (torch
takes seconds) keeps the contract of every command: one line, exit status 130, no traceback."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# A Ctrl-C landing inside the import of torch (where the first seconds of any command go), injected rather
# than timed: an import hook raises KeyboardInterrupt when torch is imported.
INTERRUPT_IMPORT = """
import sys
class Interrupt:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            raise KeyboardInterrupt
sys.meta_path.insert(0, Interrupt())
from bam_surgery.cli.launch import main
main(sys.argv[1:])
"""


@pytest.mark.parametrize("command", [["inspect", "nothing.safetensors"], ["merge", "--seed", "a.safetensors",
                                     "--experts", "b.safetensors", "--out", "mix.safetensors"], ["train", "--help"]])
def test_ctrl_c_while_starting_is_one_line(tmp_path, command):
    proc = subprocess.run([sys.executable, "-c", INTERRUPT_IMPORT, *command], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr == "bam-surgery: interrupted; nothing was written\n"
    assert list(tmp_path.iterdir()) == []


# A Ctrl-C (or SIGTERM) delivered while torch imports, inside library code that swallows KeyboardInterrupt (as
# some of torch's optional imports do): it used to be lost, and the command ran to completion (issue 33).
SWALLOWED_SIGNAL = """
import os, signal, sys, time
class Signal:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            sys.meta_path.remove(self)
            try:
                os.kill(os.getpid(), signal.SIG{sig})
                time.sleep(0.5)
            except BaseException:
                pass
sys.meta_path.insert(0, Signal())
from bam_surgery.cli.launch import main
main(sys.argv[1:])
"""


@pytest.mark.slow  # a fresh interpreter
@pytest.mark.parametrize("sig,code", [("INT", 130), ("TERM", 143)])
def test_a_signal_while_starting_is_never_lost(tmp_path, sig, code):
    (tmp_path / "seed.safetensors").write_bytes(b"x")
    proc = subprocess.run([sys.executable, "-c", SWALLOWED_SIGNAL.replace("{sig}", sig), "inspect",
                           "seed.safetensors"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == code, proc.stderr
    assert proc.stderr == "bam-surgery: interrupted; nothing was written\n"
