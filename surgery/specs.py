"""How merge's --seed and --experts values name checkpoints: [NAME=]CKPT, comma-separated lists.

    split_specs(("code=a.safetensors,law=b/",))   -> [("code", "a.safetensors"), ("law", "b/")]

Standard library only: the console entry (cli/launch.py) reads a merge's inputs with it before torch is
imported, to start hashing them; the merge reads them with it again (surgery/names.py names them).
"""
from __future__ import annotations

import os
import re
from typing import Sequence

_NAMED = re.compile(r"^(?P<name>[A-Za-z_][A-Za-z0-9_]*)=(?P<spec>.+)$")


def parse_named(value: str) -> tuple[str | None, str]:
    """'code=path' -> ('code', 'path'); a value that exists as a path is a path, even with '='."""
    m = _NAMED.match(value)
    if m is None or os.path.lexists(value):
        return None, value
    return m.group("name"), m.group("spec")


def split_specs(values: Sequence[str]) -> list[tuple[str | None, str]]:
    """--experts values -> [(name or None, spec)]. Each value is one checkpoint if it exists as
    given (so a path with a comma can be passed, one --experts each); otherwise a comma-separated
    list of them."""
    out: list[tuple[str | None, str]] = []
    for value in values:
        name, spec = parse_named(value.strip())
        if os.path.lexists(spec):
            out.append((name, spec))
            continue
        out.extend(parse_named(part.strip()) for part in value.split(",") if part.strip())
    return out


def merge_inputs(seed: str, experts: Sequence[str]) -> list[tuple[str | None, str]]:
    """merge's --seed (one checkpoint) and --experts values as [(name or None, spec)], the seed first."""
    return [parse_named(seed), *split_specs(experts)]
