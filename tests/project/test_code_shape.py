"""No function over MAX_FUNCTION_LINES (60) lines outside tests/ and benchmarks/ (issue 21, item 4).

Lines are counted as benchmarks/code_shape.py counts them (`.venv/bin/python -m benchmarks.code_shape`
lists the longest): from `def` to the function's last line, nested functions counted in their parent too.
A function that has to stay longer goes into ALLOWED with its line count and the reason; the list may only
shrink: an entry whose function got shorter, or is gone, fails until it is removed or lowered.
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.code_shape import MAX_FUNCTION_LINES, functions  # noqa: E402

SKIPPED = {"tests", "benchmarks", "build", "docs", "data"}  # not package code (docs/data hold no .py of ours)

# "file:qualified name" -> its line count today. Empty: every function is within the limit.
ALLOWED: dict[str, int] = {}


def _sources() -> list[Path]:
    top = [p for p in ROOT.iterdir() if not p.name.startswith(".") and p.name not in SKIPPED
           and not p.name.endswith(".egg-info")]
    return sorted(f for p in top for f in ([p] if p.suffix == ".py" else p.rglob("*.py") if p.is_dir() else []))


def _lengths() -> dict[str, int]:
    return {f"{f.relative_to(ROOT)}:{name}": n for f in _sources() for n, name in functions(f)}


def test_the_scan_sees_every_layer():
    seen = {where.split("/")[0] for where in _lengths()}
    assert {"runtime", "converters", "train", "surgery", "pipeline", "cli"} <= seen


def test_no_function_is_over_the_limit():
    lengths = _lengths()
    over = {where: n for where, n in lengths.items() if n > MAX_FUNCTION_LINES and where not in ALLOWED}
    assert not over, (f"functions over {MAX_FUNCTION_LINES} lines (split them by what they do): "
                      + ", ".join(f"{w} ({n})" for w, n in sorted(over.items(), key=lambda kv: -kv[1])))


def test_the_allow_list_only_shrinks():
    lengths = _lengths()
    stale = {where: (n, lengths.get(where)) for where, n in ALLOWED.items() if lengths.get(where, 0) < n}
    grown = {where: (n, lengths[where]) for where, n in ALLOWED.items() if lengths.get(where, 0) > n}
    assert not stale, f"shorter or gone: lower or remove their ALLOWED entries: {stale}"
    assert not grown, f"allowed functions grew (allowed, now): {grown}"
