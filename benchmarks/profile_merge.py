"""Where one merge spends its CPU: cProfile of the main thread, and CPU seconds per thread.

    BAM_SURGERY_CACHE=/tmp/empty .venv/bin/python -m benchmarks.profile_merge merge --recipe bam \\
        --seed bench-out/0.5b/dense/seed.safetensors --experts bench-out/0.5b/dense/code.safetensors,... \\
        --out /tmp/mix.safetensors --force --quiet

Runs `bam-surgery` in this process (arguments as on the command line) and prints the wall time,
the process CPU (getrusage), the main thread's CPU, the hashing threads' CPU (time.thread_time
around surgery.hashing.InputHasher._hash), the rest (the read-ahead thread), then the 15 functions
with the most main-thread time. Point BAM_SURGERY_CACHE at an empty folder to make the merge hash its
inputs (a second run with the same folder takes the digests from its cache).
"""
from __future__ import annotations

import cProfile
import io
import pstats
import resource
import sys
import time

from bam_surgery.surgery import hashing
from bam_surgery.cli.commands import cli


def main(argv: list[str]) -> None:
    hash_cpu = [0.0]
    real = hashing.InputHasher._hash

    def timed_hash(self, path):
        start = time.thread_time()
        try:
            return real(self, path)
        finally:
            hash_cpu[0] += time.thread_time() - start

    hashing.InputHasher._hash = timed_hash
    r0, w0, m0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter(), time.thread_time()
    prof = cProfile.Profile()
    prof.enable()
    try:
        cli.main(args=argv, prog_name="bam-surgery", standalone_mode=False)
    finally:
        prof.disable()
    wall, main_cpu = time.perf_counter() - w0, time.thread_time() - m0
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    print(f"wall {wall:.1f}s  process CPU {cpu:.1f}s  main thread {main_cpu:.1f}s  hashing threads "
          f"{hash_cpu[0]:.1f}s  other threads (read-ahead) {cpu - main_cpu - hash_cpu[0]:.1f}s")
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(15)
    print(out.getvalue())


if __name__ == "__main__":
    main(sys.argv[1:])
