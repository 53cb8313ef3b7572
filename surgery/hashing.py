"""Digests of every input file for the provenance: known ones reused, the others BLAKE3 in the background.

Each input file gets a FileDigest: the algorithm, the hex digest, and how it was obtained
(`source`), all recorded in the provenance and shown by `inspect`:

    hf-blob   the file is a Hugging Face cache blob, which the cache names by the sha256 of its
              bytes (huggingface_hub checks that on download): sha256, read from the name, no I/O
    cache     hashed by an earlier run, and the file is provably the same one: the digest cache
              ($XDG_CACHE_HOME/bam-surgery/hashes.json) is keyed by path, device, inode, size,
              mtime_ns and ctime_ns (ctime changes on every write and cannot be set back)
    read      BLAKE3 of the file's bytes, computed now, in background threads while the merge
              reads the same files (blake3 releases the GIL; ~3 GB/s per core, against ~0.4-1.5
              GB/s for sha256), then stored in the cache

Why not hash the bytes the merge itself reads: the merge reads tensors in canonical order, which
is not file order (an HF file sorts layers.10 before layers.2), so a file digest would need the
whole file buffered. Instead every read checks the file is still the one opened (surgery/
execute.py, runtime.safetensors_file.FileIdentity), which also covers the hashing thread's read.
"""
from __future__ import annotations

import json
import os
import re
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import blake3

from bam_surgery.runtime.safetensors_file import FileIdentity

from .errors import InputError

ALGORITHM = "blake3"
_HASH_CHUNK = 16 << 20
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_CACHE_ENTRIES = 20_000  # most recently used kept


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


# ---- the digest cache --------------------------------------------------------------------------------
def cache_file() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "bam-surgery" / "hashes.json"


class DigestCache:
    """{resolved path: identity + BLAKE3}, one JSON file, written atomically; any I/O trouble makes
    it a cache that misses (never an error)."""

    def __init__(self, file: Path | None = None):
        self.file = file or cache_file()
        self._lock = threading.Lock()
        self._new: dict[str, list] = {}
        try:
            body = json.loads(self.file.read_text())
            self._entries: dict[str, list] = body["entries"] if body.get("version") == 1 else {}
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            self._entries = {}

    @staticmethod
    def _key(identity: FileIdentity) -> list:
        return [identity.dev, identity.ino, identity.size, identity.mtime_ns, identity.ctime_ns]

    def get(self, path: Path, identity: FileIdentity) -> FileDigest | None:
        entry = self._entries.get(str(path))
        if isinstance(entry, list) and len(entry) == 8 and entry[:5] == self._key(identity) \
                and entry[5] == ALGORITHM and isinstance(entry[6], str) and _HEX64.match(entry[6]):
            self._new[str(path)] = [*entry[:7], time.time()]  # refresh its last use
            return FileDigest(ALGORITHM, entry[6], "cache")
        return None

    def put(self, path: Path, identity: FileIdentity, digest: FileDigest) -> None:
        with self._lock:
            self._new[str(path)] = [*self._key(identity), digest.algorithm, digest.hex, time.time()]

    def save(self) -> None:
        if not self._new:
            return
        try:
            try:  # merge with what other runs wrote meanwhile
                current = json.loads(self.file.read_text()).get("entries", {})
            except (OSError, ValueError, AttributeError):
                current = {}
            entries = {**(current if isinstance(current, dict) else {}), **self._new}
            keep = sorted(entries.items(), key=lambda kv: kv[1][-1] if isinstance(kv[1], list) and kv[1] else 0)
            body = json.dumps({"version": 1, "entries": dict(keep[-_CACHE_ENTRIES:])})
            self.file.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".hashes.", dir=self.file.parent)
            with os.fdopen(fd, "w") as f:
                f.write(body)
            os.replace(tmp, self.file)
        except OSError:
            pass


# ---- hashing ------------------------------------------------------------------------------------
class InputHasher:
    """Digests of every input file: known ones at once (hf-blob, cache), the others BLAKE3 in
    background threads. `pending()` says, before anything is hashed, each file's algorithm and
    source (a header written first carries placeholders of the final length)."""

    def __init__(self, files: list[Path], workers: int = 4, cache: DigestCache | None = None):
        self.files = list(dict.fromkeys(files))
        self._cancel = threading.Event()
        self._cache = cache if cache is not None else DigestCache()
        self._known: dict[Path, FileDigest] = {}
        self._identity: dict[Path, FileIdentity] = {}
        for f in self.files:
            try:
                self._identity[f] = FileIdentity.of(os.stat(f))
            except OSError as e:
                raise InputError(f"{f}: could not be read for hashing ({e.strerror})") from e
            known = hf_blob_digest(f) or self._cache.get(f, self._identity[f])
            if known is not None:
                self._known[f] = known
        todo = [f for f in self.files if f not in self._known]
        # half the cores at most: the merge itself needs the others
        workers = max(1, min(workers, len(todo) or 1, (os.cpu_count() or 2) // 2))
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="bam-hash")
        self._futures = {f: self._pool.submit(self._hash, f) for f in todo}

    def pending(self) -> dict[Path, FileDigest]:
        """Every file's digest as far as known now: the hex of files still being hashed is a
        placeholder of the same length ("pending-000000----...")."""
        out = dict(self._known)
        for k, f in enumerate(self._futures):
            out[f] = FileDigest(ALGORITHM, f"pending-{k:06d}".ljust(64, "-"), "read")
        return {f: out[f] for f in self.files}

    def _hash(self, path: Path) -> FileDigest:
        h = blake3.blake3()
        buf = bytearray(_HASH_CHUNK)
        view = memoryview(buf)
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                if self._cancel.is_set():
                    raise RuntimeError("cancelled")
                h.update(view[:n])
            self._identity[path].check(os.fstat(f.fileno()), path)  # the bytes hashed are the file opened
        digest = FileDigest(ALGORITHM, h.hexdigest(), "read")
        self._cache.put(path, self._identity[path], digest)
        return digest

    def result(self) -> dict[Path, FileDigest]:
        try:
            computed = {f: fut.result() for f, fut in self._futures.items()}
        except OSError as e:
            raise InputError(f"{e.filename}: could not be read for hashing ({e.strerror})") from e
        finally:
            self._pool.shutdown(wait=True)
        self._cache.save()
        return {f: computed.get(f) or self._known[f] for f in self.files}

    def cancel(self) -> None:
        self._cancel.set()
        self._pool.shutdown(wait=True, cancel_futures=True)
