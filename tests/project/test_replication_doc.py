"""docs/replication.md's tables are what benchmarks/replication.py prints for the stored summaries
(benchmarks/results/replication-*.json, made from the pipeline reports by `replication summarize`): no number in
them is copied by hand, and the shipped CPU pipelines are there with three seeds each (tiny and paper-shape: the
paper's mixtures; tiny-upcycling: the upcycling methods)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks import replication  # noqa: E402

DOC = ROOT / "docs" / "replication.md"
SUMMARIES = sorted((ROOT / "benchmarks" / "results").glob("replication-*.json"))
MODELS = {"tiny-upcycling": {"dense-dm", "dm-upcycle", "dm-drop-upcycle", "dm-fine-grained"},  # the rest: the paper's
          "paper-shape-time": {"seed", "dm-btx", "dm-bam", "cm-bam", "tm-bam"},  # BTX and BAM, three ways matched
          None: {"dense-dm", "dm-btx", "dm-bam", "dm-bam-shared-kv"}}


def test_the_doc_holds_what_the_script_prints_for_the_stored_summaries():
    blocks = replication.doc_blocks(DOC.read_text(encoding="utf-8"))
    names = []
    for path in SUMMARIES:
        summary = json.loads(path.read_text(encoding="utf-8"))
        names.append(summary["pipeline"])
        assert blocks.get(summary["pipeline"]) == replication.render(summary), (
            f"{DOC.name}'s {summary['pipeline']} block is not what `python -m benchmarks.replication render "
            f"{path.relative_to(ROOT)}` prints; run `python -m benchmarks.replication write-doc docs/replication.md "
            "benchmarks/results/replication-*.json`")
    assert sorted(names) == sorted(blocks) and {"paper-shape", "paper-shape-time", "tiny", "tiny-upcycling"} <= set(names)


def test_three_seeds_each_with_the_dense_baseline_and_provenance():
    for path in SUMMARIES:
        summary = json.loads(path.read_text(encoding="utf-8"))
        runs = summary["runs"]
        assert [r["seed"] for r in runs] == [0, 1, 2], path.name
        for r in runs:
            ids = {m["id"] for m in r["models"]}
            assert MODELS.get(summary["pipeline"], MODELS[None]) <= ids, path.name
            assert r["provenance"]["commit"] and r["provenance"]["machine"]
            assert all(s["commits"] and s["cpu_s"] >= 0 for s in r["stages"].values())
