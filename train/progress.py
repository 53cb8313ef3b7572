"""Progress where no bar can be drawn: when stderr is not a terminal (a log file, a job scheduler, a pipe), a
long `train` or `eval` prints one line at most every PROGRESS_EVERY_S seconds instead of staying silent.

    ticker = ProgressLines("eval", total=40, log=print_to_stderr, enabled=not sys.stderr.isatty())
    ticker.tick(done, "code")      # "eval: 12/40 (code)", if PROGRESS_EVERY_S have passed since the last line
"""
from __future__ import annotations

import sys
import time
from typing import Callable

PROGRESS_EVERY_S = 30.0  # seconds between two lines (tests set it to 0: a line per tick)


def stderr_line(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class ProgressLines:
    """`what: done/total (detail)` lines through `log`, the first one PROGRESS_EVERY_S after the start."""

    def __init__(self, what: str, total: int, log: Callable[[str], None] = stderr_line, enabled: bool = True):
        self.what, self.total, self.log, self.enabled = what, total, log, enabled
        self.last, self.done = time.monotonic(), 0

    def tick(self, done: int | None = None, detail: str = "") -> None:
        """`done` of total are done (None: one more than at the last tick)."""
        self.done = self.done + 1 if done is None else done
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self.last >= PROGRESS_EVERY_S:
            self.last = now
            self.log(f"{self.what}: {self.done}/{self.total}" + (f" ({detail})" if detail else ""))
