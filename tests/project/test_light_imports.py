"""A light foundation: the runtime's leaf modules, the console entry's start-up path and the public package
(bam_surgery) import with torch (and numpy, safetensors, transformers) blocked, in a fresh interpreter; so the start-up path uses
the one JSON reader (runtime/jsonfile.py) and the one shard-index reader (runtime/shards.py) instead of standard-
library copies of them."""
from __future__ import annotations

import subprocess
import sys

import pytest

# the runtime's modules that need no torch (the package itself is lazy: runtime/__init__.py)
LEAF_MODULES = ("errors", "jsonfile", "text", "sizes", "cache", "locks", "config", "config_rules", "shards")
# what cli/launch.py imports before torch: the interrupt line, merge's input options, early hashing
START_UP = ("bam_surgery.cli.launch", "bam_surgery.cli.early", "bam_surgery.surgery.digests",
            "bam_surgery.surgery.specs")
HEAVY = ("torch", "numpy", "safetensors", "transformers")

BLOCKER = f"""
import sys
class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {HEAVY!r}:
            raise ImportError("blocked: " + name)
sys.meta_path.insert(0, Blocked())
"""


def import_blocked(modules: tuple[str, ...]) -> subprocess.CompletedProcess:
    code = BLOCKER + "".join(f"import {m}\n" for m in modules)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)


def test_leaf_modules_and_start_up_path_import_without_torch():
    proc = import_blocked((*(f"bam_surgery.runtime.{m}" for m in LEAF_MODULES), *START_UP))
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_the_package_imports_without_torch_and_promises_its_list():
    """`import bam_surgery` (the public API, docs/api.md) loads nothing heavy, and its public names are __all__
    (tests/app/test_api.py: each documented)."""
    proc = import_blocked(("bam_surgery",))
    assert proc.returncode == 0, proc.stderr[-2000:]
    code = BLOCKER + ("import bam_surgery as bs\n"
                      "public = sorted(n for n in dir(bs) if not n.startswith('_'))\n"
                      "assert public == sorted(set(bs.__all__) - {'__version__'}), public\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_the_blocker_blocks():
    """The check can fail: a module that needs torch is refused under the blocker."""
    proc = import_blocked(("bam_surgery.runtime.model",))
    assert proc.returncode != 0 and "blocked: torch" in proc.stderr


def test_runtime_names_load_lazily():
    """The package's names (load_model, Model, ...) still come from `bam_surgery.runtime`, each loaded when
    asked for; an unknown one is an AttributeError."""
    import bam_surgery.runtime as runtime
    from bam_surgery.runtime.loading import load_model

    assert runtime.load_model is load_model and set(runtime.__all__) <= set(dir(runtime))
    with pytest.raises(AttributeError):
        runtime.no_such_name
