"""docs/routers.md's table of routers from prompts on the real seed is what benchmarks/router_prompts.py prints for
the stored result (benchmarks/results/router-prompts-smollm2.json): no number in it is copied by hand."""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks import router_prompts  # noqa: E402

DOC = ROOT / "docs" / "routers.md"
RESULT = ROOT / "benchmarks" / "results" / "router-prompts-smollm2.json"


def test_the_doc_holds_what_the_script_prints_for_the_stored_result():
    summary = json.loads(RESULT.read_text(encoding="utf-8"))
    assert router_prompts.doc_block(DOC.read_text(encoding="utf-8")) == router_prompts.render(summary), (
        "run `python -m benchmarks.router_prompts --render benchmarks/results/router-prompts-smollm2.json "
        "--write-doc docs/routers.md`")
    modes = summary["modes"]
    assert {"random", "hidden", "hidden_avg", "cheap_embed"} <= set(modes)
    for row in modes.values():
        assert set(row) == set(summary["experts"])
        for d in row.values():
            assert 0 <= d["top1_min"] <= d["top1"] <= d["top1_max"] <= 1 and d["top1"] <= d["top2"] <= 1
