"""Measure one command in a child process: wall time, peak RSS (split into anonymous and
file-backed pages), its CPU time and the CPU time the rest of the machine used meanwhile, with the
page cache dropped (cold) or filled with its inputs (warm) beforehand. Standard library only.

    step = measure(Step(size, "merge", "btx", cmd, "cold"), inputs, log_path, cold=True)
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Step:
    size: str
    step: str  # merge | floor | mergekit-moe | ...
    recipe: str
    cmd: list[str]
    cache: str  # cold | warm
    rc: int = 0
    wall_s: float = 0.0
    peak_rss_mb: float = 0.0  # ru_maxrss (high-water mark)
    peak_anon_mb: float = 0.0  # sampled max RssAnon
    peak_file_mb: float = 0.0  # sampled max RssFile
    cpu_s: float = 0.0  # child user + system
    other_cpu_s: float = 0.0  # busy CPU time of everything else on the machine during the step
    load_before: float = 0.0  # 1-minute load average before the step
    bytes_in: int = 0
    bytes_out: int = 0
    note: str = ""
    log: str = ""


def can_drop_caches() -> bool:
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def warm_up(files: list[Path]) -> None:
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while fh.read(64 << 20):
                pass


def _busy_cpu_s() -> float:
    # /proc/stat "cpu user nice system idle iowait irq softirq steal ...", in clock ticks
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    return (v[0] + v[1] + v[2] + v[5] + v[6] + v[7]) / os.sysconf("SC_CLK_TCK")


class MemorySampler(threading.Thread):
    """Max RssAnon / RssFile of one process, sampled from /proc/PID/status."""

    def __init__(self, pid: int, period: float = 0.05):
        super().__init__(daemon=True)
        self.pid, self.period = pid, period
        self.peak = {"RssAnon": 0, "RssFile": 0}
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                with open(f"/proc/{self.pid}/status") as f:
                    for line in f:
                        key, _, rest = line.partition(":")
                        if key in self.peak:
                            self.peak[key] = max(self.peak[key], int(rest.split()[0]))  # kB
            except (OSError, ValueError, IndexError):
                pass
            self.stop.wait(self.period)


def files_under(path: Path) -> list[Path]:
    if path.is_dir():
        return sorted(p for p in path.rglob("*") if p.is_file())
    return [path] if path.exists() else []


def total_bytes(paths: list[Path]) -> int:
    return sum(f.stat().st_size for p in paths for f in files_under(p))


# A stdlib-only launcher between us and the measured command. The kernel keeps ru_maxrss across
# fork and exec as a maximum with the forking process's own high-water mark, so forking the command
# straight from this (torch-importing) script would report at least our own peak; forked from the
# launcher (~10 MB), the child's ru_maxrss is its own peak. The launcher also times fork-to-exit.
LAUNCHER = r"""
import json, os, sys, time
result, cmd = sys.argv[1], sys.argv[2:]
t0 = time.perf_counter()
pid = os.fork()
if pid == 0:
    try:
        os.execvp(cmd[0], cmd)
    finally:
        os._exit(127)
with open(result + ".pid", "w") as f:
    f.write(str(pid))
_, status, ru = os.wait4(pid, 0)
wall = time.perf_counter() - t0
with open(result, "w") as f:
    json.dump({"wall_s": wall, "rc": os.waitstatus_to_exitcode(status), "maxrss_kb": ru.ru_maxrss,
               "cpu_s": ru.ru_utime + ru.ru_stime}, f)
"""


def measure(step: Step, inputs: list[Path], log: Path, cold: bool) -> Step:
    """Run step.cmd as a child with the page cache in the requested state; fill in time and memory."""
    if cold:
        drop_caches()
    else:
        warm_up([f for p in inputs for f in files_under(p)])
    step.load_before = os.getloadavg()[0]
    step.log = str(log)
    result = log.with_suffix(".rusage.json")
    pid_file = Path(str(result) + ".pid")
    result.unlink(missing_ok=True)
    pid_file.unlink(missing_ok=True)
    busy0 = _busy_cpu_s()
    with open(log, "wb") as out:
        launcher = subprocess.Popen([sys.executable, "-I", "-S", "-c", LAUNCHER, str(result), *step.cmd],
                                    stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
        sampler = None
        while launcher.poll() is None and sampler is None:
            try:
                sampler = MemorySampler(int(pid_file.read_text()))
                sampler.start()
            except (OSError, ValueError):
                time.sleep(0.005)
        launcher.wait()
        if sampler:
            sampler.stop.set()
            sampler.join()
    busy1 = _busy_cpu_s()
    if launcher.returncode or not result.exists():
        step.rc = launcher.returncode or 1
        step.note = f"launcher failed (rc {launcher.returncode})"
        return step
    r = json.loads(result.read_text())
    step.rc = r["rc"]
    step.wall_s = r["wall_s"]
    step.cpu_s = r["cpu_s"]
    step.other_cpu_s = max(0.0, busy1 - busy0 - step.cpu_s)
    step.peak_rss_mb = r["maxrss_kb"] / 1024  # Linux: kB
    if sampler:
        step.peak_anon_mb = sampler.peak["RssAnon"] / 1024
        step.peak_file_mb = sampler.peak["RssFile"] / 1024
    step.bytes_in = total_bytes(inputs)
    if step.rc:
        tail = log.read_text(errors="replace").strip().splitlines()[-5:]
        step.note = (step.note + "; " if step.note else "") + f"FAILED rc={step.rc}: " + " | ".join(tail)
    return step
