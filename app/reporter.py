"""How a use case speaks while it runs: one Reporter object instead of callbacks. The use cases print nothing
themselves; they tell their reporter.

    warning(message)  something the user should know about the result (an expert far from the seed, a tokenizer
                      that differs, non-finite values kept)
    note(message)     a remark on the request (an option that has no effect where it was given)
    log(line)         progress and summary lines (training's steps, the warm start, an export's summary)
    settled(message)  a killed run's leftover work folder for OUT was settled (what a run did to the disk)
    written(path)     OUT is in place and complete (called before the inputs are closed)
    progress          whether progress bars may be drawn on stderr (merge's, eval's)

`Reporter()` prints warnings, notes and log lines on stderr, as the CLI does, and draws no bars; the CLI's
reporter (cli/options.py) holds a merge's warnings until it is done; the pipeline's indents them under its unit;
`Quiet()` says nothing.
"""
from __future__ import annotations

import sys
from pathlib import Path

from bam_surgery.runtime.errors import one_line, print_warning


class Reporter:
    """What a use case tells while it runs (the module docstring); this one prints warnings, notes and log lines on
    stderr and draws no progress bars."""

    progress: bool = False

    def warning(self, message: str) -> None:
        print_warning(message)

    def note(self, message: str) -> None:
        print(f"bam-surgery: note: {one_line(message)}", file=sys.stderr, flush=True)

    def log(self, line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    def settled(self, message: str) -> None:
        self.warning(message)

    def written(self, path: Path) -> None:
        pass


class Quiet(Reporter):
    """Says nothing (a warning is dropped too)."""

    def warning(self, message: str) -> None:
        pass

    def note(self, message: str) -> None:
        pass

    def log(self, line: str) -> None:
        pass


__all__ = ["Quiet", "Reporter"]
