"""Byte sizes as users write them on the command line (--max-shard-size)."""
from __future__ import annotations

import re
from fractions import Fraction

from .errors import OptionError

MAX_SIZE = 2**62  # bytes: past any disk, and still an exact integer everywhere
_SCALE = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_size(text: str, option: str = "--max-shard-size") -> int:
    """'2GB' -> 2_000_000_000, '500MiB' -> 524_288_000, '1000' -> 1000 bytes."""
    text = str(text)
    shown = text if len(text) <= 40 else f"{text[:20]}... ({len(text)} characters)"
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*", text, re.IGNORECASE)
    if not m:
        raise OptionError(f"{option}: cannot read {shown!r}; write e.g. 2GB, 500MB or 1GiB")
    if len(m.group(1)) > 30:
        raise OptionError(f"{option}: {shown!r} is more than {MAX_SIZE:,} bytes")
    size = int(Fraction(m.group(1)) * _SCALE[(m.group(2) or "").lower()])  # exact: no float overflow
    if size <= 0:
        raise OptionError(f"{option}: must be positive, got {text!r}")
    if size > MAX_SIZE:
        raise OptionError(f"{option}: {shown.strip()!r} is more than {MAX_SIZE:,} bytes")
    return size
