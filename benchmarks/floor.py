"""The I/O floor of a merge: read every input byte, write as many bytes as the merge's output, fsync.

    python -m benchmarks.floor OUT NBYTES INPUT [INPUT ...]

A merge has to read its inputs and write its output, so no merge can be faster than this plain
copy on the same disk with the same page-cache state. Reads and writes go through one reusable
64 MiB buffer (no mmap, no per-tensor work); the output gets the first NBYTES bytes read (cycled
if the inputs are smaller), so it is incompressible in the same way the merge's output is.
Imports nothing but the standard library, so start-up costs milliseconds, not a torch import.
"""
from __future__ import annotations

import os
import sys

CHUNK = 64 * 1024 * 1024


def copy_floor(out_path: str, n_out: int, inputs: list[str]) -> int:
    """Read all of `inputs`, write `n_out` bytes of what was read to `out_path`, fsync. Returns bytes read."""
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    n_read = 0
    left = n_out
    with open(out_path, "wb", buffering=0) as out:
        while True:
            for path in inputs:
                with open(path, "rb", buffering=0) as f:
                    while True:
                        n = f.readinto(view)
                        if not n:
                            break
                        n_read += n
                        if left:
                            k = min(n, left)
                            out.write(view[:k])
                            left -= k
            if not left or n_read == 0:
                break
            inputs = inputs[:1]  # output bigger than the inputs: keep writing (re-reading the first input)
        os.fsync(out.fileno())
    return n_read


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 3:
        sys.exit("usage: python -m benchmarks.floor OUT NBYTES INPUT [INPUT ...]")
    copy_floor(argv[0], int(argv[1]), argv[2:])


if __name__ == "__main__":
    main()
