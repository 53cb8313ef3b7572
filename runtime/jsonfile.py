"""JSON read from files we did not write (configs, indexes, headers, metadata), parsed defensively.

Every failure is one ConfigError/CheckpointError naming the file, never a traceback: bytes that
are not UTF-8, text that is not JSON, nesting deeper than the parser's recursion limit, integers
longer than Python converts (4300 digits), NaN/Infinity (not JSON), and files too large to be a
config. `expect` checks the top-level type, the one check every caller needs.

    body = read_json(directory / "config.json", expect=dict)          # CheckpointError on failure
    cfg = parse_json(metadata["bam_config"], "x.safetensors: bam_config", error=ConfigError)
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .errors import CheckpointError, printable

MAX_JSON_BYTES = 64 << 20  # a config.json or an index of 100k tensors is a few MB


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


class _DuplicateKey(Exception):
    pass


def _unique_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        raise _DuplicateKey(next(k for k, _ in pairs if k in seen or seen.add(k)))
    return out


def parse_json(text: str | bytes, where: str, *, expect: type | None = None,
               error: type[Exception] = CheckpointError, unique_keys: bool = False) -> Any:
    """Parse JSON text; any failure raises `error` with a one-line message starting with `where`.
    unique_keys: a key given twice in one object is an error (json.loads keeps the last silently)."""
    if isinstance(text, (bytes, bytearray, memoryview)):
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError as e:
            raise error(f"{where}: not UTF-8 text (invalid byte at offset {e.start})") from None
    try:
        value = json.loads(text, parse_constant=_no_constants, object_pairs_hook=_unique_object if unique_keys else None)
    except _DuplicateKey as e:
        raise error(f"{where}: not valid here: key {printable(e.args[0])!r} appears twice in one object") from None
    except json.JSONDecodeError as e:
        raise error(f"{where}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except RecursionError:
        raise error(f"{where}: JSON nested too deeply") from None
    except ValueError as e:  # NaN/Infinity, or an integer past Python's 4300-digit conversion limit
        reason = str(e) if "JSON number" in str(e) else "a number has too many digits"
        raise error(f"{where}: not valid JSON ({reason})") from None
    if expect is not None and not isinstance(value, expect):
        names = {dict: "a JSON object", list: "a JSON array", str: "a JSON string"}
        raise error(f"{where}: expected {names.get(expect, expect.__name__)}, got {_kind(value)}")
    return value


def read_json(path: str | os.PathLike, *, expect: type | None = None, error: type[Exception] = CheckpointError,
              max_bytes: int = MAX_JSON_BYTES) -> Any:
    """Read and parse a JSON file (see parse_json); a file over max_bytes is refused unread."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > max_bytes:
            raise error(f"{path}: {size:,} bytes is too large for a JSON config or index (limit {max_bytes:,})")
        data = path.read_bytes()
    except OSError as e:
        raise error(f"{path}: cannot read ({e.strerror or e})") from None
    return parse_json(data, str(path), expect=expect, error=error)


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "a number",
            float: "a number"}.get(type(value), type(value).__name__)
