"""What a GPU run needs, checked on the CPU (issues 24 and 40): the GPU benchmark (benchmarks/gpu.py, over the engines
of benchmarks/inference.py) runs end to end at `--device cpu --size smoke` through every code path `make bench-gpu`
takes (bf16 inference weights and cache, training under bf16 autocast eager and with compiled blocks, the compiled
decode step, MFU, the bandwidth limit, the issue's targets, the time budget), imports nothing
setup.py does not declare (transformers only in its peer rows), and the decode step follows the rules of
torch.compile(mode="reduce-overhead") (CUDA graphs): torch._dynamo.explain finds no graph break, so no host
synchronisation and no data-dependent shape, for every model kind. tests/runtime/test_cuda.py holds what needs a GPU."""
from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import absolute_imports, build_model, dist_name, random_state, setup_keyword, tiny_config, tokens_for
from bam_surgery.runtime.blocks import EXPERT_KERNELS
from bam_surgery.runtime.generation import decode_step

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks import gpu  # noqa: E402
from benchmarks import inference as bench  # noqa: E402

SMOKE_CASES = ["bam-expert-kv fused", "bam-shared-kv reference", "Mixtral (transformers)",
               "HF BAM export expert KV (transformers)"]


@pytest.mark.slow
def test_the_gpu_benchmark_runs_end_to_end_on_the_cpu(tmp_path):
    """The command make bench-gpu runs (benchmarks/gpu.py), at --device cpu --size smoke, in one process: bf16
    inference weights and cache, the fused decode step compiled (aot_eager on the CPU: no C++ build), training
    under bf16 autocast eager and with compiled blocks, a row written per case in the benchmark's order."""
    cmd = [sys.executable, "-m", "benchmarks.gpu", "--device", "cpu", "--size", "smoke", "--repeat", "1",
           "--peak-tflops", "1", "--hbm-tbs", "0.01", "--budget-s", "100000", "--out", str(tmp_path), "--cases",
           *SMOKE_CASES]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=900,
                          env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert [r["case"] for r in rows] == [n for n in gpu.ORDER if n in SMOKE_CASES]
    by = {r["case"]: r for r in rows}
    for name, r in by.items():
        assert not r["errors"] and not r["skipped"] and not r["skipped_phases"], (name, r)
        for metric in ("prefill_tps", "decode1_tps", "decode_batch_tps", "train_tps"):
            assert r[metric] > 0, (name, metric)
    fused = by["bam-expert-kv fused"]
    assert fused["train_compiled_tps"] > 0 and fused["compile_s"] > 0 and fused["decode_mode"] == "compiled (aot_eager)"
    assert by["bam-shared-kv reference"]["decode_mode"] == "eager" and not by["bam-shared-kv reference"]["compile_s"]
    assert by["Mixtral (transformers)"]["generate_tps"] > 0
    assert by["HF BAM export expert KV (transformers)"]["generate_tps"] > 0
    assert fused["kv_bytes_per_token"] == 4 * 2 * 2 * 2 * 4 * 16  # bf16 cache: E x K, V x layers x heads x Dh
    text = (tmp_path / "results.md").read_text()
    assert "cpu, bf16, size smoke" in text and "MFU against 1 TFLOP/s" in text and "| decode b2 tok/s |" in text
    assert "of the bandwidth limit 0.01 TB/s" in text and "Issue 40's targets" in text


@pytest.mark.slow
def test_the_gpu_benchmark_keeps_to_its_budget(tmp_path):
    """--budget-s: a compiled phase starts only with 60 s of the budget left, and past the budget no case starts;
    each row is written as it ends, skipped ones included."""
    base = [sys.executable, "-m", "benchmarks.gpu", "--device", "cpu", "--size", "smoke", "--repeat", "1"]
    cmd = base + ["--budget-s", "30", "--out", str(tmp_path), "--cases", "dense fused", "dense reference"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert [r["case"] for r in rows] == ["dense fused", "dense reference"]
    first = rows[0]
    assert first["prefill_tps"] > 0 and first["train_tps"] > 0
    assert first["skipped_phases"] == ["decode", "train compiled"]  # each compiles: 60 s needed, 30 s given
    assert "not run (budget): decode, train compiled" in (tmp_path / "results.md").read_text()
    out = tmp_path / "none"
    proc = subprocess.run(base + ["--budget-s", "0", "--out", str(out), "--cases", "dense fused"],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((out / "rows.jsonl").read_text())["skipped"] == "time budget (0 s) spent"


def test_the_decode_bandwidth_limit_and_the_targets():
    """decode b1's limit: bf16 bytes of every weight a token reads plus its KV cache reads; paper-small dense:
    6 layers x (4 x 1024^2 attention + 3 x 1024 x 4096 FFN) + 256,000 x 1024 head (+ one embedding row), and
    2 x 6 x 8 heads x 128 x 1,040 cached keys and values on average."""
    from bam_surgery.runtime import ModelConfig

    size = bench.SIZES["paper-small"]
    cfg = bench.runtime_config("dense", size)
    weights = 6 * (4 * 1024 * 1024 + 3 * 1024 * 4096) + 256_000 * 1024 + 1024
    assert gpu.decode_bytes(cfg, size) == 2 * (weights + 2 * 6 * 8 * 128 * (1024 + 16))
    bam = bench.runtime_config("bam-expert-kv", size)  # 4 attention experts, top-1 of 4 FFN experts, 2 routers
    assert gpu.decode_bytes(bam, size) > gpu.decode_bytes(cfg, size)
    assert isinstance(bam, ModelConfig) and gpu.hbm_tbs("NVIDIA H200") == 4.8 and gpu.hbm_tbs("NVIDIA H100 80GB HBM3") == 3.35
    dense = gpu.Row("dense fused", flops_per_token=1e9, train_compiled_tps=0.41 * 989e12 / 3e9, train_tps=1.0,
                    decode1_tps=1000.0, decode_bytes_per_token=1e9)
    bam_row = gpu.Row("bam-expert-kv fused", flops_per_token=1e9, train_tps=0.2 * 989e12 / 3e9, prefill_tps=300.0)
    ref = gpu.Row("bam-expert-kv reference", flops_per_token=1e9, prefill_tps=100.0)
    text = gpu.targets([dense, bam_row, ref], 989.0, 4.8)
    assert "dense fused training MFU 41.0% (best of eager and compiled; target >= 40%: met)" in text
    assert "bam-expert-kv fused training MFU 20.0% (best of eager and compiled; target >= 35%: NOT met)" in text
    assert "bam-expert-kv fused prefill 3.00x the reference (target >= 3x: met)" in text
    assert ("dense fused decode b1 1,000.0 tokens/s = 21% of the bandwidth limit 4.8 TB/s / 1.000 GB per token = "
            "4,800 tokens/s (target >= 50%: NOT met)") in text
    assert "transformers rows measured: none" in text


@pytest.mark.slow
def test_a_missing_cuda_or_transformers_is_one_line():
    if not torch.cuda.is_available():
        for script in ("benchmarks.inference", "benchmarks.gpu"):
            proc = subprocess.run([sys.executable, "-m", script, "--device", "cuda", "--size", "smoke"],
                                  capture_output=True, text=True, cwd=ROOT, timeout=120)
            assert proc.returncode == 2 and "sees no CUDA device" in proc.stderr.splitlines()[-1], script
    mixtral = next(c for c in bench.CASES if c.engine == "transformers")
    ort = next(c for c in bench.CASES if c.engine == "onnxruntime")
    assert bench.skip_reason(ort, "cuda") == "onnxruntime rows run on the CPU only"
    assert bench.skip_reason(ort, "cpu") == ""
    real = bench.importlib.util.find_spec
    try:
        bench.importlib.util.find_spec = lambda name: None if name == "transformers" else real(name)
        assert "transformers is not installed" in bench.skip_reason(mixtral, "cuda")
    finally:
        bench.importlib.util.find_spec = real
    skipped = bench.Result("Mixtral (transformers)", skipped="transformers is not installed")
    assert "| Mixtral (transformers) | skipped: transformers is not installed |" in bench.table([skipped])


@pytest.mark.parametrize("script", ["inference.py", "gpu.py"])
def test_the_benchmark_imports_only_declared_packages(script):
    """Imports of benchmarks/inference.py and benchmarks/gpu.py: the standard library, the package and what setup.py
    declares; transformers only inside the transformers engines."""
    declared = {dist_name(r).replace("-", "_") for r in setup_keyword("install_requires")}
    tree = ast.parse((ROOT / "benchmarks" / script).read_text())
    owners: dict[ast.AST, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            for child in ast.walk(node):
                owners.setdefault(child, node.name) if isinstance(node, ast.ClassDef) else None
    for node, name in absolute_imports(tree):
        top = name.split(".")[0]
        if top in sys.stdlib_module_names or top in ("bam_surgery", "benchmarks") or top in declared:
            continue
        assert top == "transformers" and owners.get(node) in ("TransformersEngine", "HFBamEngine"), \
            f"benchmarks/{script}:{node.lineno} imports {name}, which setup.py does not declare"


def test_peak_table_and_mfu():
    assert bench.peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert bench.peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert bench.peak_tflops("NVIDIA H200") == 989.0
    assert bench.peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert bench.peak_tflops("NVIDIA L40S") == 362.0 and bench.peak_tflops("NVIDIA L4") == 121.0
    assert bench.peak_tflops("Some Future GPU") is None
    r = bench.Result("x", prefill_tps=1e5, train_tps=1e5, flops_per_token=1e9)
    assert bench.mfu(r, "prefill_tps", 989.0) == pytest.approx(1e14 / 989e12)
    assert bench.mfu(r, "train_tps", 989.0) == pytest.approx(3e14 / 989e12)  # forward + backward: 3x
    assert bench.mfu(r, "train_tps", None) is None


def _row(name, **metrics):
    base = dict(prefill_tps=1.0, train_tps=1.0, decode1_tps=1.0, decode_batch_tps=1.0, decode_batch=32,
                flops_per_token=1e9, decode_mode="compiled (reduce-overhead)")
    return bench.Result(name, **{**base, **metrics})


def test_gpu_targets_read_met_and_not_met():
    """Issue 24's targets from a made-up H100 run: the lines say met / NOT met with the figures."""
    peak = 989.0
    mfu_tps = lambda m, flops=1e9: m * peak * 1e12 / (3 * flops)  # noqa: E731 - train tokens/s for an MFU
    results = [
        _row("dense fused", train_tps=mfu_tps(0.36), decode1_tps=400),
        _row("bam-expert-kv reference", prefill_tps=150_000),
        _row("bam-expert-kv fused", prefill_tps=520_000, train_tps=mfu_tps(0.31), decode1_tps=310,
             decode_batch_tps=3000),
        _row("bam-shared-kv reference", prefill_tps=200_000),
        _row("bam-shared-kv fused", prefill_tps=510_000, train_tps=mfu_tps(0.2), decode1_tps=350,
             decode_batch_tps=4000),
        _row("btx fused", prefill_tps=600_000, train_tps=90_000, decode1_tps=500, decode_batch_tps=9000),
        _row("Mixtral (transformers)", prefill_tps=488_000, train_tps=71_000, decode1_tps=40, decode_batch_tps=800,
             generate_tps=12.0, decode_mode="eager"),
    ]
    text = bench.gpu_targets(results, peak)
    assert "bam-expert-kv fused prefill 520,000 tokens/s, 3.47x the reference (target >= 500,000 and >= 3x: met)" \
        in text
    assert "2.55x the reference (target >= 500,000 and >= 3x: NOT met)" in text
    assert "dense fused training MFU 36.0% (target >= 35%: met)" in text
    assert "bam-expert-kv fused training MFU 31.0% (target >= 30%: met)" in text
    assert "bam-shared-kv fused training MFU 20.0% (target >= 30%: NOT met)" in text
    assert "btx fused decode b1 500.0 tokens/s (compiled (reduce-overhead); target >= 300 with CUDA graphs: met; " \
           "41.7x transformers' Mixtral generate 12.0 tokens/s, target >= 10x: met)" in text
    assert "btx fused / MixtralForCausalLM: prefill 1.23x, train 1.27x, decode1 12.50x, decode_batch 11.25x " \
           "(target: ahead in every metric: met)" in text
    assert "shared-KV decode b32 4,000.0 vs expert-KV 3,000.0 tokens/s (target: faster: met)" in text
    unknown = bench.gpu_targets(results, None)
    assert "unknown: no peak FLOP/s for this device, pass --peak-tflops" in unknown
    assert "not checked: no row for btx fused" in bench.gpu_targets(results[:2], peak)


def test_make_targets_use_the_preinstalled_python():
    out = subprocess.run(["make", "-n", "bench-gpu", "test-gpu", "GPU_PYTHON=/opt/gpu/bin/python"],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    # nothing is installed (a lent machine has no network): a link tree of every layer setup.py maps goes first on
    # PYTHONPATH
    assert "pip install" not in out.stdout
    layers = re.search(r"^LAYERS = \((.*)\)$", (ROOT / "setup.py").read_text(encoding="utf-8"), re.M).group(1)
    names = " ".join(layers.replace('"', "").replace(",", " ").split())
    assert f"for layer in {names}; do ln -s" in out.stdout
    assert re.search(r"PYTHONPATH=\S*build/gpu-path\S* /opt/gpu/bin/python -m benchmarks\.gpu --device cuda --dtype bf16 "
                     r"--size paper-small", out.stdout)
    assert re.search(r"PYTHONPATH=\S*build/gpu-path\S* /opt/gpu/bin/python -m pytest -q -p no:cacheprovider "
                     r"tests/runtime/test_cuda\.py", out.stdout)
    assert ".venv" not in out.stdout


def test_make_test_gpu_imports_this_checkout_through_the_link_tree():
    """`make test-gpu` with this interpreter (no CUDA here: every test skips) imports the package through
    build/gpu-path, which resolves to this checkout."""
    out = subprocess.run(["make", "-s", "test-gpu", f"GPU_PYTHON={sys.executable}"], capture_output=True, text=True,
                         cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    probe = subprocess.run([sys.executable, "-I", "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
                            "import os, bam_surgery.runtime as r, bam_surgery.recipes as q; "
                            "print(os.path.realpath(r.__file__), os.path.realpath(q.__file__))",
                            str(ROOT / "build" / "gpu-path")], capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.split() == [str(ROOT / "runtime" / "__init__.py"), str(ROOT / "recipes" / "__init__.py")]


# ---- the decode step under torch.compile's rules (reduce-overhead / CUDA graphs) -------------------
DECODE_KINDS = {
    "dense": dict(n_kv_heads=2),
    "btx": dict(ffn_experts=4, ffn_top_k=1, gate_norm="topk_softmax"),
    "bam_expert_kv": dict(ffn_experts=4, ffn_top_k=1, gate_norm="topk_softmax", attn_experts=4),
    "bam_shared_kv": dict(ffn_experts=4, ffn_top_k=1, gate_norm="topk_softmax", attn_experts=4, kv_mode="shared",
                          n_kv_heads=2),
    "topk_attention": dict(ffn_experts=3, ffn_top_k=2, attn_experts=3, attn_top_k=1, gate_norm="topk_softmax"),
}


def _graph_breaks(model, batch: int, temperature: float = 0.0):
    """torch._dynamo.explain of one decode step after a prefill: (graph break count, reasons)."""
    cache = model.new_cache(batch, 8)
    mask = torch.ones(batch, 8, dtype=torch.long)
    prompt = tokens_for(model.config, 3, batch=batch, length=4)
    with torch.no_grad():
        model(prompt, attention_mask=mask, input_pos=torch.arange(4), cache=cache)
        uniform = torch.rand(batch) if temperature else None
        torch._dynamo.reset()
        explained = torch._dynamo.explain(decode_step)(model, cache, prompt[:, -1:], torch.tensor([4]), mask,
                                                       temperature, 0.9, uniform)
    return explained.graph_break_count, [str(b.reason) for b in explained.break_reasons]


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(DECODE_KINDS))
def test_decode_step_has_no_graph_break(kind):
    """bf16 weights and cache (the GPU benchmark's decode) at batch 1 and 32, greedy and sampling; fp32 at batch 1.
    The CPU picks the grouped-matmul kernel in bf16, as an H100 does."""
    cfg = tiny_config(**DECODE_KINDS[kind], max_positions=16)
    model = build_model(cfg, random_state(cfg, 3))
    assert _graph_breaks(model, 1) == (0, [])
    model.to(torch.bfloat16)
    for batch, temperature in ((1, 0.0), (32, 0.0), (32, 0.8)):
        assert _graph_breaks(model, batch, temperature) == (0, []), (batch, temperature)


@pytest.mark.slow
def test_decode_step_without_grouped_mm_has_no_graph_break_at_batch_one():
    """A GPU without torch._grouped_mm for bf16 (before Hopper) decodes batch 1 with the gather kernel: also whole.
    (At larger batches it takes the padded kernel, one host synchronisation per layer: docs/gpu.md.)"""
    assert "gather" in EXPERT_KERNELS
    cfg = tiny_config(**DECODE_KINDS["bam_expert_kv"], max_positions=16)
    model = build_model(cfg, random_state(cfg, 4)).to(torch.bfloat16)
    model.expert_kernel = "gather"
    assert _graph_breaks(model, 1) == (0, [])
