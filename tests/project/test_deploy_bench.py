"""benchmarks/deploy.py (decode speed of every deployment route) runs end to end at --size smoke: one row per model
and route, every route whose packages the interpreter has measured, with the runtime's greedy tokens (llama.cpp's
q8_0 may part: its weights are rounded), the routes an export does not carry said so; and --merge-json makes one
table of two runs, each route's speed against the runtime of its own run. The smoke run goes through this
interpreter and, where it exists, the llama.cpp venv (.venv-compat/gguf, `make test-compat`), as the README's
commands do."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks import deploy  # noqa: E402

GGUF_PYTHON = ROOT / ".venv-compat" / "gguf" / "bin" / "python"
# (model, route) an export refuses: llama.cpp has no attention experts, and its qwen2moe computes softmax gates only
NOT_CARRIED = {(m, r) for m in ("bam",) for r in ("llama.cpp f32", "llama.cpp q8_0")}  # attention experts
MAY_DIFFER = ("llama.cpp q8_0",)


def installed(python: str, packages: set[str]) -> set[str]:
    """The packages among `packages` that `python` can import."""
    code = f"import importlib.util as u; print(' '.join(p for p in {sorted(packages)!r} if u.find_spec(p)))"
    return set(subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout.split())


def smoke(python: str, out: Path, *extra: str) -> dict:
    cmd = [python, "-m", "benchmarks.deploy", "--size", "smoke", "--new-tokens", "4", "--repeat", "1",
           "--out", str(out), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=900,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Decode tokens/s" in proc.stdout and (out / "results.md").read_text() == proc.stdout[:-1]
    return json.loads((out / "results.json").read_text())


def check_rows(record: dict, python: str, routes: tuple[str, ...]) -> None:
    have = installed(python, {p for r in routes for p in deploy.PACKAGES[r]})
    rows = {(r["model"], r["route"]): r for r in record["rows"]}
    assert list(rows) == [(m, r) for m in deploy.MERGES for r in routes]  # one row each, models then routes in order
    measured = 0
    for (model, route), r in rows.items():
        assert not r["error"], (model, route, r["error"])
        if not set(deploy.PACKAGES[route]) <= have:
            assert r["skipped"].endswith("not installed"), (model, route, r["skipped"])
        elif (model, route) in NOT_CARRIED:
            assert r["skipped"].startswith("not carried: gguf export (llama.cpp) needs"), (model, route, r["skipped"])
        else:
            assert not r["skipped"] and r["tokens_per_s"] > 0 and len(r["seconds"]) == 1, (model, route, r)
            if route != "runtime":
                assert r["tokens_equal"] is not None, (model, route)
                assert r["tokens_equal"] or route in MAY_DIFFER, (model, route, r["first_difference"])
            measured += 1
    assert measured >= 2 * len(deploy.MERGES)  # the runtime and the CLI at least, for every model


@pytest.mark.slow
def test_smoke_run_measures_every_available_route(tmp_path):
    record = smoke(sys.executable, tmp_path)
    check_rows(record, sys.executable, deploy.ROUTES)
    assert record["run"] == deploy.venv_label()
    assert record["threads"] == 1 and record["new_tokens"] == 4 and record["commit"]
    assert record["command"].endswith("-m benchmarks.deploy --size smoke --new-tokens 4 --repeat 1 --out "
                                      + str(tmp_path))


@pytest.mark.slow
def test_smoke_run_in_the_llama_cpp_venv(tmp_path):
    if not GGUF_PYTHON.exists():
        pytest.skip(f"{GGUF_PYTHON.relative_to(ROOT)} is not built (make test-compat builds it)")
    routes = ("runtime", "llama.cpp f32", "llama.cpp q8_0")
    record = smoke(str(GGUF_PYTHON), tmp_path, "--routes", *routes)
    check_rows(record, str(GGUF_PYTHON), routes)
    assert record["run"] == ".venv-compat/gguf"


def run(label: str, rows: list[tuple[str, str, float, str]]) -> dict:
    """A results.json of one run: rows (model, route, tokens/s, skipped)."""
    return dict(run=label, command=f"{label}/bin/python -m benchmarks.deploy", commit="abc1234", machine="2 CPU cores",
                versions={"torch": "2.13.0", "llama_cpp_python": ""}, size="small", shape="d_model 256",
                prompt_tokens=16, new_tokens=128, repeat=5, threads=1, load_before=0.5, seed=0,
                rows=[dict(model=m, route=r, detail="", tokens_per_s=t, seconds=[128 / t] if t else [],
                           tokens_equal=None if r == "runtime" or skipped else r != "llama.cpp q8_0",
                           first_difference=3 if r == "llama.cpp q8_0" else None, skipped=skipped, error="")
                      for m, r, t, skipped in rows])


def test_merge_json_makes_one_table_of_both_runs(tmp_path, capsys):
    a = run(".venv", [("dense", "runtime", 100.0, ""), ("dense", "onnxruntime", 300.0, ""),
                      ("dense", "llama.cpp f32", 0.0, "gguf, llama_cpp not installed"),
                      ("bam", "runtime", 50.0, ""), ("bam", "llama.cpp f32", 0.0, "llama_cpp not installed")])
    b = run(".venv-compat/gguf", [("dense", "runtime", 80.0, ""), ("dense", "onnxruntime", 0.0, "onnx not installed"),
                                  ("dense", "llama.cpp f32", 400.0, ""), ("dense", "llama.cpp q8_0", 480.0, ""),
                                  ("bam", "runtime", 40.0, ""),
                                  ("bam", "llama.cpp f32", 0.0, "not carried: gguf export needs dense attention")])
    for name, record in (("a.json", a), ("b.json", b)):
        (tmp_path / name).write_text(json.dumps(record))
    deploy.main(["--merge-json", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--out", str(tmp_path / "m")])
    text = capsys.readouterr().out
    assert "| runtime | .venv | 100 |" in text and "| runtime | .venv-compat/gguf | 80 |" in text  # both runtimes
    assert "| llama.cpp f32 | .venv-compat/gguf | 400 | not carried |" in text
    assert "| llama.cpp q8_0 | .venv-compat/gguf | 480 (tokens differ from 3) |" in text
    assert "| dense | llama.cpp f32 | .venv-compat/gguf | 400.0 | 5.00 | yes |" in text  # against its own run's runtime
    assert "| dense | onnxruntime | .venv | 300.0 | 3.00 | yes |" in text
    assert "| dense | llama.cpp q8_0 | .venv-compat/gguf | 480.0 | 6.00 | no (from token 3) |" in text
    assert "not installed" not in text  # every such row was measured by the other run
    assert text.count("not carried: gguf export needs dense attention") == 1
    assert "`.venv/bin/python -m benchmarks.deploy`" in text and "commit abc1234" in text
    merged = json.loads((tmp_path / "m" / "results.json").read_text())
    assert merged == {"runs": [a, b]}
    deploy.main(["--merge-json", str(tmp_path / "m" / "results.json")])  # a merged file reads as its runs
    assert capsys.readouterr().out == text


def test_each_mixture_against_its_btx_twin():
    """The report's bam / btx rows: each mixture's tokens/s over its BTX twin's, same run and route only."""
    a = run(".venv", [("btx", "runtime", 100.0, ""), ("bam", "runtime", 40.0, ""), ("btx", "onnxruntime", 300.0, ""),
                      ("bam", "onnxruntime", 0.0, "onnx not installed")])
    b = run(".venv-compat/vllm", [("btx", "vllm", 200.0, ""), ("bam", "vllm", 50.0, ""),
                                  ("btx-shared-expert", "vllm", 180.0, "")])
    text = deploy.report([a, b])
    assert "| runtime | .venv | bam / btx | 0.40 |" in text
    assert "| vllm | .venv-compat/vllm | bam / btx | 0.25 |" in text
    assert "| vllm | .venv-compat/vllm | btx-shared-expert / btx | 0.90 |" in text
    assert "onnxruntime | .venv | bam" not in text  # no bam row measured there
    assert deploy.twins([run(".venv", [("bam", "runtime", 40.0, "")])]) == ""
