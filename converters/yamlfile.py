"""YAML read from files we did not write (recipes, training configs, pipelines), parsed with bounds.

The one YAML reader of the tool: every YAML file it reads goes through `read_yaml` or `parse_yaml`. It
lives in converters, the lowest layer that may import PyYAML (runtime imports torch & co. only), so train
and surgery both use it.
PyYAML's safe_load builds no objects from tags, but it still trusts the size of what it is given;
this reader refuses, before building it, a document past any of these bounds:

    MAX_YAML_BYTES   1 MiB    the file (a recipe or pipeline is a few KB; refused unread)
    MAX_YAML_DEPTH   64       nesting of mappings and sequences (ours are < 10 deep; PyYAML's composer
                              recurses, so 50k nested brackets were a RecursionError)
    MAX_YAML_NODES   100,000  values once every alias (*name) is expanded, counted while composing: an
                              alias costs the expanded size of what it names, so a 426-byte "billion
                              laughs" is refused after reading a few hundred nodes, never expanded (the
                              objects built share the aliased value, but printing, comparing or merging
                              with `<<:` expands it)
    MAX_INT_DIGITS   100      characters of an integer scalar (Python refuses past 4300 digits with a
                              ValueError; sexagesimal 1:2:3... grows without bound)

Aliases themselves stay allowed: yaml.safe_dump writes anchors for a value shared in what it dumps
(our own resolved pipelines and run configs can hold them). An alias to a value that contains it
(`&a [*a]`) is refused: nothing the tool reads is recursive.

Every failure is one `error` (the caller's error type) whose message starts with `where` and names
the bound; no message quotes more than a short piece of the input.

    doc = read_yaml(path, error=TrainError)                 # TrainError("cfg.yaml: ...") on failure
    doc = parse_yaml(text, "recipe r.yaml", error=RecipeError)
"""
from __future__ import annotations

import os
import reprlib
from pathlib import Path
from typing import Any

import yaml
from yaml.composer import Composer
from yaml.constructor import SafeConstructor
from yaml.events import AliasEvent
from yaml.resolver import Resolver

from bam_surgery.runtime.errors import printable
from bam_surgery.runtime.jsonfile import read_bounded

MAX_YAML_BYTES = 1 << 20
MAX_YAML_DEPTH = 64
MAX_YAML_NODES = 100_000
MAX_INT_DIGITS = 100
_SHOWN = 300  # characters of PyYAML's own message kept in ours


class _Refused(Exception):
    """A bound is exceeded; the message (without `where`) says which."""


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxlong, _REPR.maxother = 3, 80, 40, 80
_REPR.maxdict = _REPR.maxlist = _REPR.maxtuple = _REPR.maxset = 4


def shown(value: Any, limit: int = 100) -> str:
    """repr(value) for an error message, cut short and printable (reprlib: the work is bounded too, for a
    list of 100,000 items or a 4000-digit integer): a message never quotes a whole value read from a file."""
    text = printable(_REPR.repr(value))
    return text if len(text) <= limit else text[:limit] + "..."


class _BoundedComposer(Composer):
    """PyYAML's composer, counting nesting depth and nodes (aliases by their expanded size)."""

    def __init__(self, max_depth: int, max_nodes: int):
        super().__init__()
        self._max_depth, self._max_nodes = max_depth, max_nodes
        self._depth = 0
        self._nodes = 0
        self._expanded: dict[int, int] = {}  # id(node) -> its size with aliases expanded, once composed

    def _count(self, n: int) -> None:
        self._nodes += n
        if self._nodes > self._max_nodes:
            raise _Refused(f"more than {self._max_nodes:,} values once its aliases (*name) are expanded")

    def compose_node(self, parent, index):
        if self.check_event(AliasEvent):
            anchor = self.peek_event().anchor
            node = self.anchors.get(anchor)
            if node is not None:
                size = self._expanded.get(id(node))
                if size is None:  # the anchored value is still being composed: it contains its alias
                    raise _Refused(f"alias *{printable(anchor)[:40]} refers to the value that contains it")
                self._count(size)
            return super().compose_node(parent, index)  # PyYAML's own error for an undefined alias
        self._depth += 1
        if self._depth > self._max_depth:
            raise _Refused(f"nested too deeply (more than {self._max_depth} levels)")
        start = self._nodes
        self._count(1)
        node = super().compose_node(parent, index)
        self._expanded[id(node)] = self._nodes - start
        self._depth -= 1
        return node


class _BoundedConstructor(SafeConstructor):
    def construct_yaml_int(self, node):
        if isinstance(node.value, str) and len(node.value) > MAX_INT_DIGITS:
            raise _Refused(f"a number has too many digits (more than {MAX_INT_DIGITS})")
        return super().construct_yaml_int(node)


_BoundedConstructor.add_constructor("tag:yaml.org,2002:int", _BoundedConstructor.construct_yaml_int)

# libyaml's parser (events only: composing stays ours) where PyYAML was built with it; else PyYAML's
try:
    from yaml._yaml import CParser as _Parser
except ImportError:  # PyYAML built without libyaml
    _Parser = None


if _Parser is not None:
    class _Loader(_BoundedComposer, _Parser, _BoundedConstructor, Resolver):  # type: ignore[misc, valid-type]
        def __init__(self, text: str, max_depth: int, max_nodes: int):
            _Parser.__init__(self, text)
            _BoundedComposer.__init__(self, max_depth, max_nodes)
            _BoundedConstructor.__init__(self)
            Resolver.__init__(self)
else:
    from yaml.parser import Parser
    from yaml.reader import Reader
    from yaml.scanner import Scanner

    class _Loader(Reader, Scanner, Parser, _BoundedComposer, _BoundedConstructor, Resolver):  # type: ignore[no-redef]
        def __init__(self, text: str, max_depth: int, max_nodes: int):
            Reader.__init__(self, text)
            Scanner.__init__(self)
            Parser.__init__(self)
            _BoundedComposer.__init__(self, max_depth, max_nodes)
            _BoundedConstructor.__init__(self)
            Resolver.__init__(self)


def parse_yaml(text: str, where: str, *, error: type[Exception] = ValueError, max_bytes: int = MAX_YAML_BYTES,
               max_depth: int = MAX_YAML_DEPTH, max_nodes: int = MAX_YAML_NODES) -> Any:
    """The one YAML document in `text` (None when empty), as yaml.safe_load builds it; any failure or
    exceeded bound raises `error` with a one-line message starting with `where`."""
    if len(text) > max_bytes:  # characters: at least as many bytes
        raise error(f"{where}: {len(text):,} characters is too large for this YAML file (limit {max_bytes:,} bytes)")
    loader = _Loader(text, max_depth, max_nodes)
    try:
        return loader.get_single_data()
    except _Refused as e:
        raise error(f"{where}: not valid here: {e}") from None
    except yaml.YAMLError as e:
        reason = " ".join(str(e).replace(' in "<unicode string>",', ",").split())  # where: named already
        raise error(f"{where}: not valid YAML ({_cut(reason)})") from None
    except RecursionError:  # not expected past the depth bound; kept so no input can give a traceback
        raise error(f"{where}: not valid here: nested too deeply") from None
    except (ValueError, TypeError, AttributeError, OverflowError, IndexError, KeyError) as e:
        # a scalar that does not fit its explicit tag (!!int x, !!timestamp 2020-13-45)
        raise error(f"{where}: not valid YAML (a value does not fit its tag: {_cut(printable(e), 120)})") from None
    finally:
        loader.dispose()


def read_yaml_text(path: str | os.PathLike, where: str | None = None, *, error: type[Exception] = ValueError,
                   max_bytes: int = MAX_YAML_BYTES) -> str:
    """The text of a YAML file (runtime/jsonfile.py:read_bounded: a regular file, read up to max_bytes), refused
    unless UTF-8. FileNotFoundError propagates (callers say 'not found' in their own words)."""
    where = str(path) if where is None else where
    data = read_bounded(path, where, error=error, max_bytes=max_bytes, what="this YAML file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{where}: not UTF-8 text (invalid byte at offset {e.start})") from None


def read_yaml(path: str | os.PathLike, where: str | None = None, *, error: type[Exception] = ValueError,
              max_bytes: int = MAX_YAML_BYTES, max_depth: int = MAX_YAML_DEPTH,
              max_nodes: int = MAX_YAML_NODES) -> Any:
    """Read and parse a YAML file (read_yaml_text, then parse_yaml)."""
    where = str(path) if where is None else where
    text = read_yaml_text(path, where, error=error, max_bytes=max_bytes)
    return parse_yaml(text, where, error=error, max_bytes=max_bytes, max_depth=max_depth, max_nodes=max_nodes)


def _cut(text: str, limit: int = _SHOWN) -> str:
    return text if len(text) <= limit else text[:limit] + "..."
