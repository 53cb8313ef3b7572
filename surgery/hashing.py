"""sha256 of every input file, in background threads, while the merge reads the same files.

Hashing reads every input byte once more and costs ~1 s of CPU per GB (sha256 with SHA-NI); it runs
in at most half the cores while the merge reads, so the page cache serves one of the two readers.
Measured on 2 cores, warm cache, four 0.6 GB bf16 inputs: 6.4 s without hashing, 6.9 s with.
"""
from __future__ import annotations

import hashlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .errors import InputError

_HASH_CHUNK = 16 << 20


class InputHasher:
    """sha256 of every input file, computed in background threads (hashlib releases the GIL)."""

    def __init__(self, files: list[Path], workers: int = 4):
        self.files = list(dict.fromkeys(files))
        self._cancel = threading.Event()
        # half the cores at most: the merge itself needs the others
        workers = max(1, min(workers, len(self.files), (os.cpu_count() or 2) // 2))
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="bam-hash")
        self._futures = {f: self._pool.submit(self._hash, f) for f in self.files}

    def _hash(self, path: Path) -> str:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(_HASH_CHUNK):
                if self._cancel.is_set():
                    raise RuntimeError("cancelled")
                h.update(chunk)
        return h.hexdigest()

    def result(self) -> dict[Path, str]:
        try:
            return {f: fut.result() for f, fut in self._futures.items()}
        except OSError as e:
            raise InputError(f"{e.filename}: could not be read for hashing ({e.strerror})") from e
        finally:
            self._pool.shutdown(wait=True)

    def cancel(self) -> None:
        self._cancel.set()
        self._pool.shutdown(wait=True, cancel_futures=True)
