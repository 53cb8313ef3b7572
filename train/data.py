"""Data sources: the domain SPEC, and documents read from text, JSONL, Parquet or `datasets` data.

SPEC is comma-separated domains `NAME=SOURCE[:WEIGHT]`:

    code=data/domains/code:0.25,law=data/domains/law:0.25,math=data/domains/math:0.25,general=data/domains/general:0.25

NAME defaults to the source's file or folder name; WEIGHT (a number >= 0) defaults to 1; weights are
normalized. SOURCE is one of
    FILE.txt, FILE.txt.gz          documents separated by DOC_SEPARATOR ("\\n\\n<|doc|>\\n")
    FILE.jsonl, FILE.jsonl.gz      one JSON object per line, the text in --text-field ("text")
    FILE.parquet                   the text in column --text-field
    FOLDER                         its files of the kinds above, in name order; if some are named train*,
                                   those are the training split and val* / valid* / validation* the
                                   held-out split (the repository's data/domains/NAME/ layout)
    FOLDER saved by `datasets`     Dataset.save_to_disk / DatasetDict.save_to_disk output
    hf:NAME[#CONFIG]               a hub dataset through datasets.load_dataset (set HF_HUB_OFFLINE=1 to
                                   read the local cache only)
Splits: "train" and "val". A DatasetDict's held-out split is validation, val or valid.
"""
from __future__ import annotations

import gzip
import hashlib
import io
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from bam_surgery.runtime.jsonfile import parse_json

from .errors import TrainError

DOC_SEPARATOR = "\n\n<|doc|>\n"
TEXT_SUFFIXES = (".txt", ".txt.gz")
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz")
PARQUET_SUFFIXES = (".parquet",)
FILE_SUFFIXES = TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES
HUB_PREFIX = "hf:"
SPLITS = ("train", "val")
VAL_NAMES = ("val", "valid", "validation")
_NAME = re.compile(r"^[A-Za-z0-9_][\w.+-]*$")
_HASH_CHUNK = 8 << 20
# One document (the text between separators, one JSONL line) is held in memory whole and tokenized at
# once: past this it is refused, so a small .gz that expands to a GiB with no separator costs at most
# this much (a book is about 1 MB of text).
MAX_DOCUMENT_CHARS = 1 << 24
MAX_PARQUET_CHUNK = 1 << 28  # bytes of one row group's text column, decompressed
_ARROW_ROWS = 256  # rows of a Parquet or datasets source in memory at once
_READ_CHARS = 1 << 22


@dataclass(frozen=True)
class Domain:
    name: str
    source: str
    weight: float  # normalized over the spec


def parse_data_spec(spec: str, option: str = "--data") -> list[Domain]:
    """'code=data/code:0.25,law=data/law' -> [Domain('code', 'data/code', 0.25/1.25), ...]."""
    entries = [e.strip() for e in (spec or "").split(",")]
    if not any(entries):
        raise TrainError(f"{option}: empty; give NAME=SOURCE[:WEIGHT],... (e.g. code=data/domains/code:0.5)")
    raw: list[tuple[str, str, float]] = []
    for entry in entries:
        if not entry:
            raise TrainError(f"{option}: empty entry in {spec!r} (two commas in a row?)")
        name, _, rest = entry.partition("=") if "=" in entry and _NAME.match(entry.split("=", 1)[0]) \
            else ("", "", entry)
        source, weight = _split_weight(rest, entry, option)
        if not source:
            raise TrainError(f"{option}: {entry!r} names no source")
        name = name or default_name(source)
        if any(n == name for n, _, _ in raw):
            raise TrainError(f"{option}: domain {name!r} appears twice; give each source its own NAME=")
        raw.append((name, source, weight))
    total = sum(w for _, _, w in raw)
    if total <= 0:
        raise TrainError(f"{option}: every domain weight is 0; at least one must be positive")
    return [Domain(n, s, w / total) for n, s, w in raw]


def _split_weight(rest: str, entry: str, option: str) -> tuple[str, float]:
    """SOURCE[:WEIGHT]. The weight is the text after the last ':' unless that text holds a '/' (a path
    or a hub name); it must then be a number >= 0."""
    body, prefix = (rest[len(HUB_PREFIX):], HUB_PREFIX) if rest.startswith(HUB_PREFIX) else (rest, "")
    head, sep, tail = body.rpartition(":")
    if not sep or "/" in tail or "\\" in tail:
        return rest, 1.0
    try:
        weight = float(tail)
    except ValueError:
        raise TrainError(f"{option}: {entry!r}: weight {tail!r} is not a number (write NAME=SOURCE:0.25)") from None
    if not math.isfinite(weight) or weight < 0:
        raise TrainError(f"{option}: {entry!r}: weight {tail} must be a finite number >= 0")
    return prefix + head, weight


def default_name(source: str) -> str:
    if source.startswith(HUB_PREFIX):
        source = source[len(HUB_PREFIX):].split("#")[0]
    name = Path(source.rstrip("/\\")).name
    for suffix in (".gz", ".txt", ".jsonl", ".parquet"):
        name = name.removesuffix(suffix)
    return name or "data"


# ---- one source, one split -------------------------------------------------------------------
@dataclass
class Source:
    """The documents of one domain's split: files, or a `datasets` dataset. `fingerprint()` is a
    sha256 over the content (files) or the dataset's own fingerprint, so the token cache is keyed by
    what is read, not by where it lives."""

    name: str
    spec: str
    split: str
    text_field: str
    files: list[Path] = field(default_factory=list)
    dataset: object | None = None  # a datasets.Dataset

    def describe(self) -> str:
        return f"{self.name}={self.spec}" + (f" ({self.split} split)" if self.split else "")

    def fingerprint(self) -> str:
        h = hashlib.sha256(f"text_field={self.text_field}\n".encode())
        if self.dataset is not None:
            h.update(f"datasets:{getattr(self.dataset, '_fingerprint', '')}:{len(self.dataset)}".encode())
        for f in self.files:
            h.update(f"{f.name}:{file_sha256(f)}\n".encode())
        return h.hexdigest()

    def hashes(self) -> list[dict]:
        """[{file, sha256, bytes}] for provenance (a dataset: its fingerprint and row count)."""
        if self.dataset is not None:
            return [{"dataset": self.spec, "fingerprint": getattr(self.dataset, "_fingerprint", None),
                     "rows": len(self.dataset)}]
        return [{"file": str(f), "sha256": file_sha256(f), "bytes": f.stat().st_size} for f in self.files]

    def documents(self) -> Iterator[str]:
        """Every non-empty document, in a fixed order."""
        if self.dataset is not None:
            yield from _dataset_documents(self.dataset, self.text_field, self.spec)
            return
        for f in self.files:
            yield from file_documents(f, self.text_field)


_sha_cache: dict[tuple[str, int, int], str] = {}


def file_sha256(path: Path) -> str:
    """The sha256 of a file's bytes, hex; train's one file hash (data files, tokenizers, the --init
    checkpoint's files in run.json). Remembered per (path, size, mtime), so a file is read once per process."""
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _sha_cache:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(_HASH_CHUNK):
                h.update(chunk)
        _sha_cache[key] = h.hexdigest()
    return _sha_cache[key]


def open_source(domain: Domain, split: str, text_field: str = "text") -> Source:
    """Resolve a domain's source for one split ("train" or "val"); errors name the domain and path."""
    spec, where = domain.source, f"{domain.name}={domain.source}"
    src = Source(domain.name, spec, split, text_field)
    if spec.startswith(HUB_PREFIX):
        src.dataset = _hub_dataset(spec[len(HUB_PREFIX):], split, where)
        return src
    path = Path(spec).expanduser()
    if not path.exists():
        raise TrainError(f"{where}: no such file or folder")
    if path.is_file():
        if not path.name.endswith(FILE_SUFFIXES):
            raise TrainError(f"{where}: unsupported file type (expected {', '.join(FILE_SUFFIXES)}, a folder, "
                             f"or a datasets folder)")
        src.files = [path]
        return src
    if _is_saved_dataset(path):
        src.dataset = _disk_dataset(path, split, where)
        return src
    files = sorted(p for p in path.iterdir() if p.is_file() and p.name.endswith(FILE_SUFFIXES))
    if not files:
        raise TrainError(f"{where}: folder holds no data files ({', '.join(FILE_SUFFIXES)})")
    train = [p for p in files if p.name.lower().startswith("train")]
    if not train:  # no split layout: the whole folder is one source
        src.files = files
        return src
    if split == "train":
        src.files = train
    else:
        src.files = [p for p in files if p.name.lower().startswith(VAL_NAMES)]
        if not src.files:
            raise TrainError(f"{where}: folder has train* files but no held-out val* file")
    return src


def has_split(domain: Domain, split: str) -> bool:
    """Whether the source has a split of its own (folders with train*/val*, DatasetDicts)."""
    try:
        src = open_source(domain, split)
        other = open_source(domain, "train" if split == "val" else "val")
    except TrainError:
        return False
    if src.dataset is not None:
        return src.dataset is not other.dataset
    return src.files != other.files


# ---- file readers ----------------------------------------------------------------------------
def _open_text(path: Path):
    if path.name.endswith(".gz"):
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8")
    return open(path, encoding="utf-8")


def file_documents(path: Path, text_field: str) -> Iterator[str]:
    name = path.name
    try:
        if name.endswith(TEXT_SUFFIXES):
            with _open_text(path) as f:
                yield from split_documents(iter(lambda: f.read(_READ_CHARS), ""), str(path))
        elif name.endswith(JSONL_SUFFIXES):
            with _open_text(path) as f:
                for lineno, line in enumerate(iter(lambda: f.readline(MAX_DOCUMENT_CHARS + 1), ""), 1):
                    if len(line) > MAX_DOCUMENT_CHARS:
                        raise TrainError(f"{path}:{lineno}: a line of more than {MAX_DOCUMENT_CHARS:,} characters "
                                         "(the limit of one document)")
                    if not line.strip():
                        continue
                    row = parse_json(line, f"{path}:{lineno}", error=TrainError)  # bounded: depth, digits, surrogates
                    if not isinstance(row, dict) or text_field not in row:
                        raise TrainError(f"{path}:{lineno}: no field {text_field!r} (set --text-field)")
                    doc = row[text_field]
                    if not isinstance(doc, str):
                        raise TrainError(f"{path}:{lineno}: field {text_field!r} is {type(doc).__name__}, "
                                         "not text")
                    if doc.strip():
                        yield doc
        else:
            yield from _parquet_documents(path, text_field)
    except (OSError, EOFError, UnicodeDecodeError, gzip.BadGzipFile) as e:
        raise TrainError(f"{path}: cannot read ({type(e).__name__}: {e})") from None


def split_documents(chunks, where: str = "text") -> Iterator[str]:
    """Documents from a stream of text chunks, split on DOC_SEPARATOR; blank documents dropped. A document
    longer than MAX_DOCUMENT_CHARS is refused once that much of it is read (nothing past it is read)."""
    pending = ""
    for chunk in chunks:
        pending += chunk
        *docs, pending = pending.split(DOC_SEPARATOR)
        yield from (d for d in docs if d.strip())
        if len(pending) > MAX_DOCUMENT_CHARS:
            raise TrainError(f"{where}: a document of more than {MAX_DOCUMENT_CHARS:,} characters (the limit of "
                             f"one document; separate documents with a {DOC_SEPARATOR.strip()!r} line)")
    if pending.strip():
        yield pending


def _parquet_documents(path: Path, text_field: str) -> Iterator[str]:
    import pyarrow.parquet as pq  # lazy: 0.07 s, for Parquet sources only

    try:
        names = pq.ParquetFile(path).schema_arrow.names
        if text_field not in names:
            raise TrainError(f"{path}: no column {text_field!r} (columns: {', '.join(names)}; set --text-field)")
        # the text column stays dictionary-encoded: a value repeated a million times is not decoded for each row
        pf = pq.ParquetFile(path, read_dictionary=[text_field])
    except TrainError:
        raise
    except Exception as e:  # pyarrow raises ArrowInvalid and friends
        raise TrainError(f"{path}: not a readable Parquet file ({' '.join(str(e).split())[:200]})") from None
    column = names.index(text_field)
    for g in range(pf.metadata.num_row_groups):  # what decompression would allocate, from the footer
        size = pf.metadata.row_group(g).column(column).total_uncompressed_size
        if size > MAX_PARQUET_CHUNK:
            raise TrainError(f"{path}: row group {g} holds {size:,} bytes of {text_field!r} once decompressed "
                             f"(limit {MAX_PARQUET_CHUNK:,}); write it in smaller row groups")
    for batch in pf.iter_batches(columns=[text_field], batch_size=_ARROW_ROWS):
        yield from arrow_documents(batch.column(0), str(path))


def arrow_documents(column, where: str) -> Iterator[str]:
    """The text documents of an Arrow array (Parquet and `datasets` sources), each checked against
    MAX_DOCUMENT_CHARS from Arrow's own lengths before it becomes a Python string: a 21 KB Parquet file of one
    long value repeated reached 5.2 GB when whole batches were turned into lists. Non-text values are skipped."""
    import pyarrow as pa  # lazy: for Parquet and datasets sources only
    import pyarrow.compute as pc  # lazy: as above

    values = column.dictionary if pa.types.is_dictionary(column.type) else column
    if not (pa.types.is_string(values.type) or pa.types.is_large_string(values.type)):
        return
    longest = pc.max(pc.binary_length(values)).as_py() or 0
    for i in range(len(column)):
        doc = column[i].as_py()
        if longest > MAX_DOCUMENT_CHARS and isinstance(doc, str) and len(doc) > MAX_DOCUMENT_CHARS:
            raise TrainError(f"{where}: a document of more than {MAX_DOCUMENT_CHARS:,} characters (the limit of one "
                             "document)")
        if isinstance(doc, str) and doc.strip():
            yield doc


# ---- datasets ---------------------------------------------------------------------------------
def _is_saved_dataset(path: Path) -> bool:
    return any((path / f).is_file() for f in ("dataset_info.json", "state.json", "dataset_dict.json"))


def _pick_split(ds, split: str, where: str):
    """A Dataset as is; from a DatasetDict, train or the first of validation/val/valid."""
    if not hasattr(ds, "keys"):
        return ds
    names = ["train"] if split == "train" else ["validation", "val", "valid"]
    for n in names:
        if n in ds:
            return ds[n]
    raise TrainError(f"{where}: no {'/'.join(names)} split (splits: {', '.join(ds.keys())})")


def _disk_dataset(path: Path, split: str, where: str):
    import datasets  # lazy: 1.2 s, for datasets sources only

    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:  # datasets raises FileNotFoundError, ValueError, ...
        raise TrainError(f"{where}: cannot load the saved dataset ({type(e).__name__}: "
                         f"{' '.join(str(e).split())[:200]})") from None
    return _pick_split(ds, split, where)


def _hub_dataset(name: str, split: str, where: str):
    import datasets  # lazy: 1.2 s, for datasets sources only

    repo, _, config = name.partition("#")
    try:
        ds = datasets.load_dataset(repo, config or None)
    except Exception as e:  # offline without a cache, unknown names, ...
        raise TrainError(f"{where}: cannot load the hub dataset ({type(e).__name__}: "
                         f"{' '.join(str(e).split())[:200]})") from None
    return _pick_split(ds, split, where)


def _dataset_documents(ds, text_field: str, where: str) -> Iterator[str]:
    if text_field not in ds.column_names:
        raise TrainError(f"{where}: no column {text_field!r} (columns: {', '.join(ds.column_names)}; "
                         "set --text-field)")
    col = ds.select_columns([text_field]).with_format("arrow")
    for start in range(0, len(col), _ARROW_ROWS):
        for chunk in col[start:start + _ARROW_ROWS].column(0).chunks:
            yield from arrow_documents(chunk, where)
