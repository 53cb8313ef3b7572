"""GGUF metadata values read by one rule: every key's value is checked, where it is read, against the kind its reader
needs, and a value of another kind is one message naming the key, what the file holds and what was expected.

    arch = metadata_value(fields, "general.architecture", STRING)                  # required
    window = metadata_value(fields, key, INTEGER, default=0, low=0)                # absent: the default
    scores = metadata_value(fields, "tokenizer.ggml.scores", NUMBERS, length=n)    # a numpy array, all finite
    metadata_value(fields, key, STRING, where="model.gguf")                        # CheckpointError "model.gguf: ..."

The kinds (a GGUF value type of any width counts: a u32 key written as int64 is an integer):

    STRING    a string                     STRINGS   an array of strings (a list)
    INTEGER   an integer (not a boolean)   INTEGERS  an array of integers (a numpy array)
    NUMBER    a finite number              NUMBERS   an array of finite numbers (a numpy array)
    BOOLEAN   a boolean                    BOOLEANS  an array of booleans (a numpy array)

`low` / `high` bound an integer or number, `length` an array's item count. gguf_file.parse_gguf gives numeric arrays
as numpy arrays (never one Python object per item: a 240 MB array of floats stays 240 MB), strings and string arrays
as str and lists; a caller's plain lists (tests) are taken as well. Without `where`, a wrong value raises
MetadataError (a ValueError whose message starts with the key), for callers that say which file themselves.
"""
from __future__ import annotations

import math
from itertools import repeat
from typing import Any, Mapping

import numpy as np

from bam_surgery.runtime.errors import CheckpointError, printable

STRING, INTEGER, NUMBER, BOOLEAN = "string", "integer", "number", "boolean"
STRINGS, INTEGERS, NUMBERS, BOOLEANS = "strings", "integers", "numbers", "booleans"
_EXPECTED = {STRING: "a string", INTEGER: "an integer", NUMBER: "a finite number", BOOLEAN: "a boolean",
             STRINGS: "an array of strings", INTEGERS: "an array of integers", NUMBERS: "an array of finite numbers",
             BOOLEANS: "an array of booleans"}
_ABSENT = object()


class MetadataError(ValueError):
    """A GGUF metadata value of the wrong kind or out of range; the message starts with the key."""


def describe(value: Any) -> str:
    """What a metadata value is, in a few words: "the string '32'", "inf", "an array of 2 strings"."""
    if isinstance(value, bool):
        return f"the boolean {str(value).lower()}"
    if isinstance(value, int):
        return f"the integer {value}" if abs(value) < 10**20 else "an integer of more than 20 digits"
    if isinstance(value, float):
        return f"{value}" if not math.isfinite(value) else f"the number {value:g}"
    if isinstance(value, str):
        shown = printable(value[:40]) + ("..." if len(value) > 40 else "")
        return f"the string {shown!r}"
    if isinstance(value, np.ndarray):
        item = ("booleans" if value.dtype == np.bool_ else "integers" if value.dtype.kind in "iu" else "numbers"
                if value.dtype.kind == "f" else "values")
        return f"an array of {len(value):,} {item if len(value) != 1 else item[:-1]}"
    if isinstance(value, (list, tuple)):
        kinds = {describe(v).split(" ")[1] if not isinstance(v, (list, tuple, np.ndarray)) else "arrays"
                 for v in value[:1000]}
        item = {"string": "strings", "integer": "integers", "number": "numbers", "boolean": "booleans"}.get(
            kinds.pop(), "values") if len(kinds) == 1 else "values"
        return f"an array of {len(value):,} {item if len(value) != 1 else item[:-1]}"
    return f"a {type(value).__name__}"


def _scalar_ok(value: Any, kind: str) -> bool:
    if kind == STRING:
        return isinstance(value, str)
    if kind == BOOLEAN:
        return isinstance(value, bool)
    if kind == INTEGER:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)  # NUMBER


def _array(value: Any, kind: str) -> Any:
    """The array `value` as `kind` gives it, or None when it is not one."""
    if kind == STRINGS:
        return value if isinstance(value, list) and all(map(isinstance, value, repeat(str))) else None
    if isinstance(value, list):  # a caller's plain list
        item = {INTEGERS: INTEGER, NUMBERS: NUMBER, BOOLEANS: BOOLEAN}[kind]
        if not all(_scalar_ok(v, item) for v in value):
            return None
        value = np.asarray(value, dtype=np.bool_ if kind == BOOLEANS else np.int64 if kind == INTEGERS
                           else np.float64)
    if not isinstance(value, np.ndarray) or value.ndim != 1:
        return None
    dtype = value.dtype
    if kind == BOOLEANS:
        return value if dtype == np.bool_ else None
    if kind == INTEGERS:
        return value if dtype.kind in "iu" else None
    if dtype.kind not in "iuf" or (dtype.kind == "f" and not np.isfinite(value).all()):  # NUMBERS
        return None
    return value


def metadata_value(fields: Mapping[str, Any], key: str, kind: str, default: Any = _ABSENT, *,
                   low: float | None = None, high: float | None = None, length: int | None = None,
                   per: str = "", where: str | None = None) -> Any:
    """fields[key] checked to be of `kind` (the module docstring), within [low, high] and of `length` items (`per`
    says what they count: "one per token"); absent: `default` (none given: the key is required). A wrong value:
    MetadataError, or CheckpointError "WHERE: ..." when `where` names the file."""
    try:
        return _checked(fields, key, kind, default, low, high, length, per)
    except MetadataError as e:
        if where is None:
            raise
        raise CheckpointError(f"{where}: {e}") from None


def _checked(fields: Mapping[str, Any], key: str, kind: str, default: Any, low: float | None, high: float | None,
             length: int | None, per: str) -> Any:
    shown = printable(key)
    if key not in fields:
        if default is _ABSENT:
            raise MetadataError(f"{shown} is missing, expected {_EXPECTED[kind]}")
        return default
    value = fields[key]
    expected = _EXPECTED[kind]
    if kind in (STRING, INTEGER, NUMBER, BOOLEAN):
        ok = _scalar_ok(value, kind)
        checked = value
    else:
        checked = _array(value, kind)
        ok = checked is not None
    if ok and (low is not None or high is not None) and kind in (INTEGER, NUMBER):
        ok = (low is None or value >= low) and (high is None or value <= high)
        expected += f" {_range(low, high)}"
    if not ok:
        bad = _first_bad(value, kind)
        if bad is not None:  # an array of the right shape with one wrong item: that item named
            raise MetadataError(f"{shown}[{bad}] is {describe(_item(value[bad]))}, expected {expected} (each item "
                                f"{_EXPECTED[_ITEM[kind]]})")
        raise MetadataError(f"{shown} is {describe(value)}, expected {expected}")
    if length is not None and len(checked) != length:
        raise MetadataError(f"{shown} has {len(checked):,} items, expected {length:,}{f' ({per})' if per else ''}")
    return checked


_ITEM = {STRINGS: STRING, INTEGERS: INTEGER, NUMBERS: NUMBER, BOOLEANS: BOOLEAN}


def _item(value: Any) -> Any:
    return value.item() if isinstance(value, np.generic) else value


def _first_bad(value: Any, kind: str) -> int | None:
    """The index of the first item of a list or 1-D array that is not of the array kind's item kind, when the array
    is otherwise of that kind (its other items right), else None."""
    if kind not in _ITEM or not (isinstance(value, list) or (isinstance(value, np.ndarray) and value.ndim == 1)):
        return None
    if isinstance(value, np.ndarray):
        if kind == NUMBERS and value.dtype.kind == "f":
            return int(np.flatnonzero(~np.isfinite(value))[0])
        return None
    item = _ITEM[kind]
    return next((i for i, v in enumerate(value) if not _scalar_ok(v, item)), None)


def _range(low: float | None, high: float | None) -> str:
    def num(x: float) -> str:
        return f"{x:,}" if isinstance(x, int) else f"{x:g}"
    if low is not None and high is not None:
        return f"from {num(low)} to {num(high)}"
    return f"of at least {num(low)}" if low is not None else f"of at most {num(high)}"
