"""File digests for the provenance, without torch: BLAKE3 of a file, the digest cache, HF blob names,
and hashing started at launch, before the runtime is imported.

Imports only the standard library, blake3 and the runtime's torch-free leaf modules (the one bounded JSON
reader, the caches' trust rule), so `cli/launch.py` can start hashing a merge's input files while the interpreter is still importing torch (seconds, and more on a cold page
cache). surgery/hashing.py (InputHasher) takes those digests over when the merge's plan names the
same files, provably unchanged; see its docstring for the sources of a digest.
"""
from __future__ import annotations

import atexit
import json
import os
import queue
import re
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import blake3

from bam_surgery.runtime.cache import cache_folder, find_entry, replace_entry
from bam_surgery.runtime.errors import UserError
from bam_surgery.runtime.jsonfile import read_json

ALGORITHM = "blake3"
HASH_CHUNK = 16 << 20
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_CACHE_ENTRIES = 20_000  # most recently used kept

FileKey = tuple  # (st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns): runtime.safetensors_file.FileIdentity's fields


def file_key(st: os.stat_result) -> FileKey:
    """What a file is: ctime changes with every write and cannot be set back (touch sets mtime only),
    so a file rewritten in place, even to the same size and mtime, gets a new key."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


class FileChanged(OSError):
    """The file is no longer the one whose key was taken (rewritten or replaced while hashed)."""


@dataclass(frozen=True)
class FileDigest:
    algorithm: str  # blake3 | sha256
    hex: str
    source: str  # read | cache | hf-blob

    @property
    def text(self) -> str:
        """'blake3:<64 hex>': self-describing, what the provenance stores."""
        return f"{self.algorithm}:{self.hex}"


def hf_blob_digest(path: Path) -> FileDigest | None:
    """The sha256 a Hugging Face cache names a blob by: .../models--org--name/blobs/<sha256>.
    (Small non-LFS files are named by their 40-hex git hash instead: not used.)"""
    if path.parent.name == "blobs" and path.parent.parent.name.startswith(("models--", "datasets--")) \
            and _HEX64.match(path.name):
        return FileDigest("sha256", path.name, "hf-blob")
    return None


def hash_file(path: Path, key: FileKey, cancel: threading.Event | None = None) -> FileDigest:
    """BLAKE3 of the file's bytes, read in 16 MiB chunks (bounded memory). Raises FileChanged if the
    open file is not (or no longer) the one `key` describes: the digest is of the file opened."""
    h = blake3.blake3()
    buf = bytearray(HASH_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        if file_key(os.fstat(f.fileno())) != key:
            raise FileChanged(f"{path}: changed before it was hashed")
        while n := f.readinto(buf):
            if cancel is not None and cancel.is_set():
                raise RuntimeError("cancelled")
            h.update(view[:n])
        if file_key(os.fstat(f.fileno())) != key:
            raise FileChanged(f"{path}: changed while it was hashed")
    return FileDigest(ALGORITHM, h.hexdigest(), "read")


def hash_workers(n_files: int, limit: int = 4) -> int:
    """Half the cores at most: the merge itself needs the others."""
    return max(1, min(limit, n_files or 1, (os.cpu_count() or 2) // 2))


# ---- the digest cache --------------------------------------------------------------------------------
DIRECTORY = "input-digests"  # below runtime.cache.cache_root()
_ENTRY, _FILE = "hashes", "hashes.json"  # one mutable entry of the cache, rewritten by every merge that hashed


def cache_file() -> Path:
    return cache_folder(DIRECTORY) / _ENTRY / _FILE


class DigestCache:
    """{resolved path: file key + BLAKE3}, one JSON file, the entry cache_root() / input-digests / hashes, trusted
    only by runtime/cache.py's rule (private, never a link, verified against its DIGEST: a planted or changed
    digest never reaches a provenance) and replaced as a whole; a cache that is not trusted, or any I/O trouble,
    makes it a cache that misses (never an error)."""

    def __init__(self, directory: str | Path = DIRECTORY):
        self.directory = directory
        self._lock = threading.Lock()
        self._new: dict[str, list] = {}
        self._entries: dict[str, list] = self._read()

    def _read(self) -> dict[str, list]:
        """The entry's digests; {} for a missing, untrusted, unreadable or malformed one (runtime.jsonfile's
        bounds)."""
        files = find_entry(self.directory, _ENTRY, [_FILE])
        try:
            body = read_json(files[0], expect=dict) if files else {}
        except (OSError, UserError):
            return {}
        entries = body.get("entries")
        return entries if body.get("version") == 1 and isinstance(entries, dict) else {}

    def get(self, path: Path, key: FileKey) -> FileDigest | None:
        entry = self._entries.get(str(path))
        if isinstance(entry, list) and len(entry) == 8 and entry[:5] == list(key) \
                and entry[5] == ALGORITHM and isinstance(entry[6], str) and _HEX64.match(entry[6]):
            self._new[str(path)] = [*entry[:7], time.time()]  # refresh its last use
            return FileDigest(ALGORITHM, entry[6], "cache")
        return None

    def put(self, path: Path, key: FileKey, digest: FileDigest) -> None:
        with self._lock:
            self._new[str(path)] = [*key, digest.algorithm, digest.hex, time.time()]

    def save(self) -> None:
        if not self._new:
            return
        entries = {**self._read(), **self._new}  # merged with what other runs wrote meanwhile
        keep = sorted(entries.items(), key=lambda kv: kv[1][-1] if isinstance(kv[1], list) and kv[1] else 0)
        body = json.dumps({"version": 1, "entries": dict(keep[-_CACHE_ENTRIES:])})

        def write(folder: Path) -> None:
            (folder / _FILE).write_text(body, encoding="utf-8")
        replace_entry(self.directory, _ENTRY, [_FILE], write)


# ---- hashing started early ---------------------------------------------------------------------------
class EarlyHashing:
    """Files hashed in daemon threads from launch on, before anything knows whether the merge will
    use them; `claim(path, key)` hands a file's future to the merge if the file is still the one
    hashed. Daemon threads, so a command that fails at once exits at once (the atexit hook stops
    them between chunks); a file never claimed only cost a read."""

    def __init__(self, files: Iterable[Path], cache: DigestCache | None = None):
        self.cancel = threading.Event()
        self._jobs: dict[Path, tuple[FileKey, Future]] = {}  # not claimed yet
        cache = cache if cache is not None else DigestCache()
        todo: queue.SimpleQueue = queue.SimpleQueue()
        for path in dict.fromkeys(files):
            try:
                key = file_key(os.stat(path))
            except OSError:
                continue
            if hf_blob_digest(path) is None and cache.get(path, key) is None:  # else known without a read
                self._jobs[path] = (key, Future())
                todo.put((path, *self._jobs[path]))
        self._futures = [fut for _, fut in self._jobs.values()]
        for _ in range(hash_workers(len(self._jobs)) if self._jobs else 0):
            threading.Thread(target=self._work, args=(todo,), name="bam-hash-early", daemon=True).start()
        atexit.register(self.stop)

    def _work(self, todo: queue.SimpleQueue) -> None:
        while not self.cancel.is_set():
            try:
                path, key, fut = todo.get_nowait()
            except queue.Empty:
                return
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(hash_file(path, key, self.cancel))
                except BaseException as e:  # the merge hashes the file itself instead
                    fut.set_exception(e)

    def claim(self, path: Path, key: FileKey) -> Future | None:
        """The future of `path`'s digest if it is being (or was) hashed as the file `key` describes."""
        job = self._jobs.pop(path, None)
        return job[1] if job is not None and job[0] == key else None

    def drop_unclaimed(self) -> None:
        """Skip the files nobody claimed (not started yet): the merge does not read them."""
        for _, fut in self._jobs.values():
            fut.cancel()

    def stop(self) -> None:
        """Stop hashing: files not started are cancelled, one being hashed stops at its next chunk
        (its future then holds the error); a claimer falls back to hashing itself."""
        self.cancel.set()
        for fut in self._futures:
            fut.cancel()


_early: EarlyHashing | None = None


def start_early(files: Iterable[str | os.PathLike]) -> EarlyHashing:
    """Begin hashing these files now (resolved paths; missing ones are skipped)."""
    global _early
    if _early is not None:
        _early.stop()
    _early = EarlyHashing([Path(f).resolve() for f in files])
    return _early


def claim_early(paths: dict[Path, FileKey]) -> dict[Path, Future]:
    """The early digests of these files (path -> key) that are for the same files; the other files
    hashed early are dropped."""
    if _early is None:
        return {}
    claimed = {p: fut for p, key in paths.items() if (fut := _early.claim(p, key)) is not None}
    _early.drop_unclaimed()
    return claimed


def stop_early() -> None:
    if _early is not None:
        _early.stop()
