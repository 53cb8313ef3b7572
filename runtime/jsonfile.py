"""JSON and JSON Lines read from files we did not write (configs, indexes, headers, metadata, tokenizer
files, generation configs, provenance, a run's state and metrics, training data), parsed with bounds.

The one JSON reader of the tool: every JSON or JSONL file it opens goes through `read_json`,
`iter_jsonl` or (text already in memory) `parse_json`. Each refuses, with one `error` (the caller's
type) whose message starts with the file (and line) and never a traceback:

    MAX_JSON_BYTES  64 MiB     the file (a 30 MB tokenizer.json is the largest we read whole), read
                               through one descriptor up to the bound, so /dev/zero, a sparse 4 GB file
                               or a file growing while read cost 64 MiB at most
    MAX_LINE_BYTES  64 MiB     one line of a JSONL file (read line by line, never whole)
    MAX_JSON_DEPTH  64         nesting of arrays and objects (ours are < 10 deep; deeper values were
                               RecursionErrors wherever they were printed or walked)
    MAX_INT_DIGITS  40         characters of an integer (2**128 has 39 digits; Python converts
                               4300 at most and no field takes more than 2**64)
    anything not a regular file (a FIFO would block the open, a device never ends), bytes that are not
    UTF-8, text that is not JSON, NaN/Infinity or a float overflowing to it (1e400), lone UTF-16 surrogates
    (\\ud800: valid JSON, but no UTF-8 text, so a UnicodeEncodeError wherever it was written).

`expect` checks the top-level type and `json_field` the type of one field where it is used, so every
message names the file and the field:

    body = read_json(directory / "config.json", expect=dict)          # CheckpointError on failure
    cfg = parse_json(metadata["bam_config"], "x.safetensors: bam_config", error=ConfigError)
    eos = json_field(body, "eos_token_id", (int, list), "generation_config.json")
    for where, record in iter_jsonl(run / "metrics.jsonl", error=TrainError): ...
"""
from __future__ import annotations

import json
import math
import os
import re
import stat
from pathlib import Path
from typing import Any, Iterator

from .errors import CheckpointError, printable

MAX_JSON_BYTES = 64 << 20
MAX_LINE_BYTES = 64 << 20
MAX_JSON_DEPTH = 64
MAX_INT_DIGITS = 40
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # a UTF-16 surrogate written as an escape; pairs are fine


class _Refused(ValueError):
    """A bound is exceeded; the message says which."""


def _no_constants(name: str) -> Any:
    raise _Refused(f"{name} is not a JSON number")


def _bounded_int(text: str) -> int:
    if len(text) > MAX_INT_DIGITS:
        raise _Refused(f"an integer has too many digits ({len(text):,}; at most {MAX_INT_DIGITS})")
    return int(text)


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _Refused(f"the number {text[:20]} is out of range")
    return value


class _DuplicateKey(Exception):
    pass


def _unique_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        raise _DuplicateKey(next(k for k, _ in pairs if k in seen or seen.add(k)))
    return out


def _check_tree(value: Any, strings: bool) -> None:
    """Nesting within MAX_JSON_DEPTH and, with `strings`, no lone surrogate in any key or string: one
    walk without recursion (so the check itself cannot overflow the stack)."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            items: Any = node.values()
            if strings:
                for k in node:
                    _check_text(k)
        elif isinstance(node, list):
            items = node
        else:
            if strings and isinstance(node, str):
                _check_text(node)
            continue
        if depth > MAX_JSON_DEPTH:
            raise _Refused(f"nested more than {MAX_JSON_DEPTH} deep")
        stack.extend((v, depth + 1) for v in items)


def _check_text(s: str) -> None:
    if not s.isascii():
        try:
            s.encode("utf-8")
        except UnicodeEncodeError as e:
            raise _Refused(f"a string holds a lone UTF-16 surrogate ({s[e.start]!a})") from None


def parse_json(text: str | bytes, where: str, *, expect: type | None = None,
               error: type[Exception] = CheckpointError, unique_keys: bool = False, allow_nan: bool = False) -> Any:
    """Parse JSON text within the bounds above; any failure raises `error` with a one-line message starting
    with `where`. unique_keys: a key given twice in one object is an error (json.loads keeps the last
    silently). allow_nan: NaN and +-Infinity are numbers (what Python's json.dumps writes for them: our own
    metrics.jsonl records a diverged loss so)."""
    if isinstance(text, (bytes, bytearray, memoryview)):
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError as e:
            raise error(f"{where}: not UTF-8 text (invalid byte at offset {e.start})") from None
    try:
        value = json.loads(text, parse_constant=float if allow_nan else _no_constants, parse_int=_bounded_int,
                           parse_float=float if allow_nan else _finite_float,
                           object_pairs_hook=_unique_object if unique_keys else None)
        _check_tree(value, strings=_SURROGATE_ESCAPE.search(text) is not None)
    except _DuplicateKey as e:
        raise error(f"{where}: not valid here: key {printable(e.args[0])!r} appears twice in one object") from None
    except json.JSONDecodeError as e:
        raise error(f"{where}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except RecursionError:
        raise error(f"{where}: JSON nested too deeply") from None
    except _Refused as e:
        raise error(f"{where}: not valid here: {e}") from None
    except ValueError as e:  # Python's own 4300-digit conversion limit, should a caller lift ours
        raise error(f"{where}: not valid JSON (a number has too many digits)") from None
    if expect is not None and not isinstance(value, expect):
        names = {dict: "a JSON object", list: "a JSON array", str: "a JSON string"}
        raise error(f"{where}: expected {names.get(expect, expect.__name__)}, got {_kind(value)}")
    return value


def open_regular(path: str | os.PathLike, where: str, *, error: type[Exception] = CheckpointError, flags: int = 0):
    """A binary file object on `path` if it is a regular file: opened without blocking (a FIFO would wait
    for a writer) and checked after opening (fstat), so what is read is what was checked. OSErrors other
    than FileNotFoundError (callers say 'not found' in their own words) become `error`."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | flags)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise error(f"{where}: cannot read ({e.strerror or e})") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise error(f"{where}: not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bounded(path: str | os.PathLike, where: str | None = None, *, error: type[Exception] = CheckpointError,
                 max_bytes: int = MAX_JSON_BYTES, what: str = "this file") -> bytes:
    """The bytes of a regular file, refused past max_bytes: by its size unread, and never more than
    max_bytes + 1 bytes read (a file growing meanwhile)."""
    where = str(path) if where is None else where
    with open_regular(path, where, error=error) as f:
        size = os.fstat(f.fileno()).st_size
        if size > max_bytes:
            raise error(f"{where}: {size:,} bytes is too large for {what} (limit {max_bytes:,} bytes)")
        try:
            data = f.read(max_bytes + 1)  # the file may grow while read
        except OSError as e:
            raise error(f"{where}: cannot read ({e.strerror or e})") from None
    if len(data) > max_bytes:
        raise error(f"{where}: too large for {what} (limit {max_bytes:,} bytes)")
    return data


def read_json(path: str | os.PathLike, *, expect: type | None = None, error: type[Exception] = CheckpointError,
              max_bytes: int = MAX_JSON_BYTES, where: str | None = None) -> Any:
    """Read and parse a JSON file (read_bounded, then parse_json)."""
    where = str(path) if where is None else where
    try:
        data = read_bounded(path, where, error=error, max_bytes=max_bytes, what="a JSON file")
    except FileNotFoundError as e:
        raise error(f"{where}: cannot read ({e.strerror})") from None
    return parse_json(data, where, expect=expect, error=error)


def iter_jsonl(path: str | os.PathLike, *, error: type[Exception] = CheckpointError,
               max_line: int = MAX_LINE_BYTES, torn_last: bool = False, allow_nan: bool = False
               ) -> Iterator[tuple[str, Any]]:
    """(where, value) for each non-blank line of a JSON Lines file, `where` being 'FILE line N'; read line by
    line (never the whole file), each line within max_line and parsed by parse_json. torn_last: a last line
    without its newline that does not parse (a crash while it was written) is skipped."""
    with open_regular(path, str(path), error=error) as f:
        n = 0
        while True:
            try:
                raw = f.readline(max_line + 1)
            except OSError as e:
                raise error(f"{path}: cannot read ({e.strerror or e})") from None
            if not raw:
                return
            n += 1
            where = f"{path} line {n}"
            if len(raw) > max_line:
                raise error(f"{where}: longer than {max_line:,} bytes")
            if not raw.strip():
                continue
            try:
                value = parse_json(raw, where, error=error, allow_nan=allow_nan)
            except error:
                if torn_last and not raw.endswith(b"\n") and not f.read(1):
                    return
                raise
            yield where, value


def json_field(body: dict, key: str, types: type | tuple[type, ...], where: str, *, default: Any = None,
          error: type[Exception] = CheckpointError) -> Any:
    """body[key] if it is of `types` (a bool is not a number here), `default` if absent or null; else `error`
    naming `where` and the field."""
    value = body.get(key)
    if value is None:
        return default
    types = types if isinstance(types, tuple) else (types,)
    if isinstance(value, types) and not (isinstance(value, bool) and bool not in types):
        return value
    wanted = " or ".join(_TYPE_NAMES.get(t, t.__name__) for t in types)
    raise error(f"{where}: field {printable(key)!r} must be {wanted}, got {_kind(value)}")


_TYPE_NAMES = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "an integer",
               float: "a number"}


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "a number",
            float: "a number"}.get(type(value), type(value).__name__)
