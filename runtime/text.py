"""Text for terminals: aligned tables of names and numbers, with whatever was read from files escaped.

    print(render_table(("domain", "tokens", "loss"), [("code", 16384, "2.4837")]))

Used by the commands (inspect, count-params, eval, routing-stats) and the pipeline's report alike.
"""
from __future__ import annotations

from typing import Any, Sequence

from .errors import printable


def render_table(header: Sequence[str], rows: Sequence[Sequence[Any]], indent: str = "",
                 left: int = 1) -> str:
    """Aligned text table: the first `left` columns left-aligned, the others right-aligned; ints get
    thousands separators."""
    cells = [[f"{c:,}" if isinstance(c, int) and not isinstance(c, bool) else printable(c) for c in r]
             for r in [list(header), *rows]]  # cells hold names and strings read from files: escaped
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = []
    for r in cells:
        line = [c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))]
        lines.append(indent + "  ".join(line).rstrip())
    return "\n".join(lines)
