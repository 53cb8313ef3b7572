"""Names of a merge's inputs: `--experts code=PATH` (read by surgery/specs.py), kept in provenance (inputs[i]["name"]).

    input_names(["seed", "a.safetensors"], [None, None]) -> ["seed", "a"]

A name is an identifier (letters, digits, '_', not starting with a digit; at most 64 characters),
unique within the merge. Given names must be unique as given; default names (the seed: "seed";
an expert: its file stem, its folder's name for an HF folder, the repository name for a hub id)
are made identifiers and numbered on a clash (math, math_2). Evaluation, routing statistics and
model cards show experts by these names.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Sequence

from .errors import BamSurgeryError

NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
_HF_WEIGHT_FILE = re.compile(r"^model(-\d+-of-\d+)?\.safetensors$")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/(?P<repo>[A-Za-z0-9][\w.-]*)(@[\w./-]+)?$")


def default_name(spec: str) -> str:
    """An identifier for an input given without a name: its file stem, an HF folder's name (also
    for a weight file inside one), or a hub id's repository name."""
    path = Path(spec.rstrip("/"))
    hub = _HUB_ID.match(spec)
    if hub and not os.path.lexists(spec) and path.suffix not in (".safetensors", ".json", ".bin", ".pt", ".pth"):
        stem = hub.group("repo")
    elif _HF_WEIGHT_FILE.match(path.name):
        stem = path.parent.name or "model"
    else:
        stem = path.stem if path.suffix == ".safetensors" else path.name
    ident = re.sub(r"[^A-Za-z0-9_]", "_", stem)[:60] or "expert"
    return ident if not ident[0].isdigit() else f"_{ident}"


def input_names(labels: Sequence[str], given: Sequence[str | None]) -> list[str]:
    """One unique identifier per input (the seed first): given names checked, the others defaulted."""
    for name in given:
        if name is not None and not NAME.match(name):
            raise BamSurgeryError(f"expert name {name!r}: use letters, digits and '_' (not starting with a digit, "
                                  "at most 64 characters), e.g. --experts code=PATH")
    chosen = [n for n in given if n is not None]
    twice = next((n for n in chosen if chosen.count(n) > 1), None)
    if twice:
        raise BamSurgeryError(f"expert name {twice!r} is given twice; every input needs its own name")
    names: list[str] = []
    taken = set(chosen)
    for i, (label, name) in enumerate(zip(labels, given)):
        if name is None:
            base = "seed" if i == 0 else default_name(label)
            name, k = base, 2
            while name in taken:
                name, k = f"{base}_{k}", k + 1
            taken.add(name)
        names.append(name)
    return names
