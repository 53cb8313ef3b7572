"""train/host_memory.py: with freed pages kept, a training step's large tensors come back without page faults."""
from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

SCRIPT = """
import json, resource, sys, torch
if sys.argv[1] == "keep":
    from bam_surgery.train.host_memory import keep_freed_pages
    assert keep_freed_pages() and keep_freed_pages()  # once per process; again is a no-op
faults = []
for _ in range(6):  # a step's [V, D] gradient: allocated, written, freed
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t = torch.empty(64 << 20, dtype=torch.uint8)
    t.fill_(1)
    del t
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps(faults))
"""


def _faults(mode: str) -> list[int]:
    proc = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_a_freed_large_tensor_comes_back_without_page_faults():
    """64 MiB allocated, written and freed six times, as steps do: glibc maps it afresh each time (16,384 faults of
    4 KiB pages, fewer with huge pages); with keep_freed_pages the heap holds it and at least every other
    allocation reuses a freed block without a fault (memalign's padding may not fit the hole the last one left;
    measured: [16414, 0, 16384, 0, ...] and [16414, 16384, 0, 0, ...])."""
    plain, kept = _faults("plain"), _faults("keep")
    assert min(plain) > 1000, plain
    assert kept[0] > 1000 and sum(f < 100 for f in kept[1:]) >= 2 and sum(kept[1:]) <= sum(plain[1:]) / 2, kept
