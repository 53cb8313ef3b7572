"""Digests of every input file for the provenance: known ones reused, the others BLAKE3 in the background.

Each input file gets a FileDigest: the algorithm, the hex digest, and how it was obtained
(`source`), all recorded in the provenance and shown by `inspect`:

    hf-blob   the file is a Hugging Face cache blob, which the cache names by the sha256 of its
              bytes (huggingface_hub checks that on download): sha256, read from the name, no I/O
    cache     hashed by an earlier run, and the file is provably the same one: the digest cache
              ($BAM_SURGERY_CACHE/input-digests/hashes/hashes.json, under runtime/cache.py's trust rule) is
              keyed by path, device, inode, size, mtime_ns and ctime_ns (ctime changes on every write and
              cannot be set back)
    read      BLAKE3 of the file's bytes, computed now, in background threads while the merge
              reads the same files (blake3 releases the GIL; ~3 GB/s per core, against ~0.4-1.5
              GB/s for sha256), then stored in the cache. The `bam-surgery merge` command starts
              these threads at launch (cli/launch.py, surgery/digests.py), before torch is
              imported; InputHasher takes over each digest whose file is provably the same.

Why not hash the bytes the merge itself reads: the merge reads tensors in canonical order, which
is not file order (an HF file sorts layers.10 before layers.2), so a file digest would need the
whole file buffered. Instead every read checks the file is still the one opened (surgery/
execute.py, runtime.safetensors_file.FileIdentity), which also covers the hashing thread's read.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from bam_surgery.runtime.safetensors_file import FileIdentity

from .digests import (ALGORITHM, DigestCache, FileChanged, FileDigest, FileKey, cache_file, claim_early, file_key,
                      hash_file, hash_workers, hf_blob_digest, stop_early)
from .errors import InputError

__all__ = ["ALGORITHM", "DigestCache", "FileDigest", "InputHasher", "cache_file", "hf_blob_digest"]


class InputHasher:
    """Digests of every input file: known ones at once (hf-blob, cache), those hashed since launch
    taken over, the others BLAKE3 in background threads. `pending()` says, before anything is
    hashed, each file's algorithm and source (a header written first carries placeholders of the
    final length)."""

    def __init__(self, files: list[Path], workers: int = 4, cache: DigestCache | None = None):
        self.files = list(dict.fromkeys(files))
        self._cancel_event = threading.Event()
        self._cache = cache if cache is not None else DigestCache()
        self._known: dict[Path, FileDigest] = {}
        self._key: dict[Path, FileKey] = {}
        for f in self.files:
            try:
                self._key[f] = file_key(os.stat(f))  # the key the early hashing took, by the same function
            except OSError as e:
                raise InputError(f"{f}: could not be read for hashing ({e.strerror})") from e
            known = hf_blob_digest(f) or self._cache.get(f, self._key[f])
            if known is not None:
                self._known[f] = known
        todo = [f for f in self.files if f not in self._known]
        early = claim_early({f: self._key[f] for f in todo})
        self._pool = ThreadPoolExecutor(max_workers=hash_workers(len(todo), workers), thread_name_prefix="bam-hash")
        self._futures = {f: self._pool.submit(self._digest, f, early.get(f)) for f in todo}

    def pending(self) -> dict[Path, FileDigest]:
        """Every file's digest as far as known now: the hex of files still being hashed is a
        placeholder of the same length ("pending-000000----...")."""
        out = dict(self._known)
        for k, f in enumerate(self._futures):
            out[f] = FileDigest(ALGORITHM, f"pending-{k:06d}".ljust(64, "-"), "read")
        return {f: out[f] for f in self.files}

    def _digest(self, path: Path, early: Future | None) -> FileDigest:
        digest = None
        if early is not None:
            try:
                digest = early.result()
            except Exception:  # changed since launch, or stopped: hash it here
                pass
        if digest is None:
            digest = self._hash(path)
        self._cache.put(path, self._key[path], digest)
        return digest

    def _hash(self, path: Path) -> FileDigest:
        try:
            return hash_file(path, self._key[path], self._cancel_event)
        except FileChanged as e:  # the bytes hashed must be the file the merge opened
            FileIdentity(*self._key[path]).check_path(path)  # says replaced or modified, and how
            raise InputError(str(e)) from e

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
        self._cancel_event.set()
        stop_early()
        self._pool.shutdown(wait=True, cancel_futures=True)
