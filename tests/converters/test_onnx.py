"""ONNX export (`bam-surgery export-onnx`, `convert --format onnx`): every model kind runs in onnxruntime with
the runtime's logits (fp32, within 1e-4) on left-padded prompts of other sizes than the graph was traced at,
and greedy decoding through the graph's own KV cache gives runtime.generate's tokens; cached decoding equals
the no-cache graph step by step; fp16 graphs run; weights go to external data past the threshold; the model
card's snippet runs as written; a failed verification writes nothing; and every bad input is one line,
exit 2, nothing written. CPU, tiny models, offline."""
from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from conftest import build_model, random_state, tiny_config
from bam_surgery.converters import onnx_export, onnx_runtime
from bam_surgery.converters.export import export
from bam_surgery.converters.onnx_graph import MIN_OPSET
from bam_surgery.converters.onnx_runtime import OrtDecoder, verify_export
from bam_surgery.runtime import StateReader, generate, save_checkpoint
from bam_surgery.runtime.blocks import ModelKVCache
from bam_surgery.runtime.outputs import MARKER
from bam_surgery.runtime.routers import ROUTER_KINDS
from bam_surgery.cli.commands import cli

KINDS = {
    "dense_llama": dict(n_kv_heads=2),  # swiglu, rmsnorm, rope, GQA, sequential
    "dense_neox": dict(block="parallel_two_norms", norm="layernorm", norm_bias=True, activation="gelu",
                       rotary_fraction=0.5, qkv_bias=True, o_bias=True, ffn_bias=True),
    "dense_gpt2": dict(position="learned", norm="layernorm", activation="gelu_tanh", tie_embeddings=True,
                       lm_head_bias=True),
    "btx_top2": dict(ffn_experts=4, ffn_top_k=2, gate_norm="topk_softmax"),
    "btx_shared_expert": dict(ffn_experts=3, ffn_top_k=1, ffn_shared_hidden=24),
    "bam_expert_kv": dict(attn_experts=3, ffn_experts=3, n_kv_heads=2, block="parallel", activation="silu"),
    "bam_shared_kv": dict(attn_experts=3, kv_mode="shared", ffn_experts=3, n_kv_heads=1, rope_interleaved=True,
                          qkv_bias=True, o_bias=True, logit_scale=0.5),
    "bam_topk_attention": dict(attn_experts=3, attn_top_k=1, gate_norm="topk_softmax", ffn_experts=4, ffn_top_k=2,
                               activation="relu", position="none"),
    # the families of 2024-25: QK-norm per head with Llama 3's RoPE; post-norms, full QK-norm and a layer without
    # RoPE with longrope crossing its original length (8) inside the traced and the decoded lengths; dynamic NTK
    "bam_qwen3_llama3": dict(attn_experts=3, ffn_experts=3, n_kv_heads=2, qk_norm="head",
                             scaled_rope=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                              high_freq_factor=4.0, original_max_position_embeddings=8)),
    "bam_olmo2_longrope": dict(attn_experts=2, kv_mode="shared", ffn_experts=2, n_kv_heads=2, qk_norm="full",
                               norm_position="post", nope_layers=[0],
                               scaled_rope=dict(rope_type="longrope", original_max_position_embeddings=8,
                                                short_factor=[1.0, 1.2, 1.4, 1.6], long_factor=[1.0, 3.0, 9.0, 27.0])),
    "dense_dynamic": dict(n_kv_heads=2, scaled_rope=dict(rope_type="dynamic", factor=4.0)),
    # sliding windows of 3 slots, shorter than the traced and decoded lengths; Gemma's features and soft-capping
    "bam_gemma_window": dict(attn_experts=2, ffn_experts=2, n_kv_heads=2, activation="geglu_tanh",
                             norm_position="sandwich", norm_unit_offset=True, scale_embeddings=True, qk_norm="head",
                             attn_scale_dim=20, attn_window=3, attn_window_layers=[0], window_rope_theta=100.0,
                             attn_softcap=5.0, final_softcap=3.0),
    # the families of 2026: Granite's multipliers with Ministral 3's queries scaled by position (every 4 positions,
    # inside the traced and decoded lengths) and YaRN; EXAONE 4's post-norms, per-head QK-norm and RoPE in its
    # sliding layer only
    "bam_granite_ministral3": dict(attn_experts=2, ffn_experts=2, n_kv_heads=2, embedding_multiplier=12.0,
                                   residual_multiplier=0.22, attn_scale=0.0625, logit_scale=0.125,
                                   attn_temperature=0.1, attn_temperature_length=4,
                                   scaled_rope=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=8)),
    "bam_exaone4": dict(attn_experts=2, kv_mode="shared", ffn_experts=2, n_kv_heads=2, qk_norm="head",
                        norm_position="post", attn_window=3, attn_window_layers=[0], nope_layers=[1]),
}


def model_for(kind: str, seed: int = 0):
    cfg = tiny_config(**KINDS[kind], max_positions=32)
    return build_model(cfg, random_state(cfg, seed))


def export_model(model, out: Path, **options) -> Path:
    state = {k: v.detach() for k, v in model.state_dict().items()}
    return export(StateReader(state, model.config), out, "onnx", **options)


@pytest.mark.parametrize("kind", [k for k in KINDS if not k.startswith("dense")])
def test_export_impl_equals_fused(kind):
    """The runtime's impl="export" (what the graph traces) gives the fused path's logits, with its sparse FFN
    dispatch and with every expert on every token (expert_kernel "dense", the benchmark's comparison)."""
    model = model_for(kind, seed=3)
    tokens = torch.randint(0, model.config.vocab_size, (3, 7), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(tokens)
    mask[1, :2] = 0
    with torch.no_grad():
        fused = model(tokens, attention_mask=mask).logits
        model.impl = "export"
        sparse = model(tokens, attention_mask=mask).logits
        model.expert_kernel = "dense"
        dense = model(tokens, attention_mask=mask).logits
    assert (sparse - fused).abs().max() < 1e-5 and (dense - fused).abs().max() < 1e-5


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_kind_verifies_in_onnxruntime(kind, tmp_path):
    model = model_for(kind)
    out = export_model(model, tmp_path / "onnx")
    onnx.checker.check_model(str(out / "model.onnx"))
    report = verify_export(model, out / "model.onnx")
    assert report.max_abs_diff <= 1e-4, report.summary()
    assert report.tokens_equal and report.ok, report.summary()
    session = OrtDecoder(out / "model.onnx").session
    cfg = model.config
    heads = ModelKVCache.kv_heads(cfg)
    inputs = {i.name: i.shape for i in session.get_inputs()}
    assert list(inputs)[:3] == ["input_ids", "attention_mask", "position_ids"]
    assert inputs["past_key_values.1.value"] == ["batch", heads, "past_sequence", cfg.head_dim]
    outputs = {o.name: o.shape for o in session.get_outputs()}
    assert outputs["logits"] == ["batch", "sequence", cfg.vocab_size]
    assert outputs["present.1.key"] == ["batch", heads, "total_sequence", cfg.head_dim]
    assert len(inputs) == 3 + 2 * cfg.n_layers and len(outputs) == 1 + 2 * cfg.n_layers
    assert json.loads((out / MARKER).read_text())["files"] == ["README.md", "genai_config.json", "model.onnx"]


@pytest.mark.parametrize("router", list(ROUTER_KINDS))
def test_every_router_kind_verifies_in_onnxruntime(router, tmp_path):
    """The graph traces the runtime's own router modules, so every kind exports (FFN and attention routers of
    different kinds, top-k FFN and soft attention routing)."""
    other = "linear" if router != "linear" else "mlp"
    cfg = tiny_config(attn_experts=3, ffn_experts=3, ffn_top_k=2, gate_norm="topk_softmax", router=router,
                      attn_router=other, max_positions=32)
    model = build_model(cfg, random_state(cfg, 5))
    report = verify_export(model, export_model(model, tmp_path / "onnx") / "model.onnx")
    assert report.max_abs_diff <= 1e-4 and report.tokens_equal and report.ok, report.summary()


def test_cached_decoding_equals_the_no_cache_graph(tmp_path):
    """Prefill then one token at a time through past/present equals recomputing the sequence without a cache."""
    model = model_for("bam_topk_attention", seed=1)
    cached = OrtDecoder(export_model(model, tmp_path / "kv") / "model.onnx")
    plain = OrtDecoder(export_model(model, tmp_path / "plain", kv_cache=False) / "model.onnx")
    assert not plain.kv_cache and [i.name for i in plain.session.get_inputs()] == [
        "input_ids", "attention_mask", "position_ids"]
    gen = torch.Generator().manual_seed(1)
    seq = torch.randint(0, model.config.vocab_size, (2, 9), generator=gen).numpy()
    mask = np.ones_like(seq)
    mask[1, :3] = 0  # left padding
    logits, past = cached.forward(seq[:, :5], mask[:, :5])
    for t in range(5, 9):
        step, past = cached.forward(seq[:, t:t + 1], mask[:, :t + 1], past)
        full, _ = plain.forward(seq[:, :t + 1], mask[:, :t + 1])
        assert np.abs(step[:, 0] - full[:, -1]).max() < 1e-5
    assert past["past_key_values.0.key"].shape[2] == 9


def test_fp16_export_runs(tmp_path):
    model = model_for("bam_expert_kv")
    out = export_model(model, tmp_path / "fp16", dtype=torch.float16)
    decoder = OrtDecoder(out / "model.onnx")
    assert decoder.past_dtype == np.float16
    report = verify_export(model, out / "model.onnx", fp16=True)
    assert report.ok and report.max_abs_diff < 2e-2, report.summary()
    assert decoder.greedy(np.array([[1, 2, 3]]), np.ones((1, 3), np.int64), 4).shape == (1, 4)


def test_external_data_past_the_threshold(tmp_path, monkeypatch):
    monkeypatch.setattr(onnx_export, "EXTERNAL_DATA_BYTES", 1024)
    model = model_for("btx_top2")
    out = export_model(model, tmp_path / "ext", verify=True)
    data = out / onnx_export.DATA_FILE
    assert data.stat().st_size > (out / "model.onnx").stat().st_size  # the weights left the graph file
    assert json.loads((out / MARKER).read_text())["files"] == ["README.md", "genai_config.json", "model.onnx",
                                                              "model.onnx.data"]
    onnx.checker.check_model(str(out / "model.onnx"))
    assert verify_export(model, out / "model.onnx").ok
    assert "model.onnx.data" in (out / "README.md").read_text()


@pytest.mark.parametrize("kv_cache", [True, False])
def test_model_card_snippet_runs(tmp_path, monkeypatch, kv_cache):
    """The README's Python block, run as written in the export folder, prints runtime.generate's tokens."""
    model = model_for("bam_shared_kv")
    out = export_model(model, tmp_path / "card", kv_cache=kv_cache)
    card = (out / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", card, re.S).group(1)
    assert len(code.strip().splitlines()) <= 18
    monkeypatch.chdir(out)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "README.md", "exec"), {})
    want = generate(model, torch.tensor([[1, 2, 3]]), 8)
    assert printed.getvalue().strip() == str(want.numpy())


def test_a_failed_verification_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(onnx_runtime, "FP32_TOLERANCE", -1.0)  # no export can be that close
    out = tmp_path / "never"
    with pytest.raises(onnx_export.VerificationError, match="does not match the runtime"):
        export_model(model_for("dense_llama"), out, verify=True)
    assert list(tmp_path.iterdir()) == []


# ---- the command line ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("onnx_cli")
    cfg = tiny_config(**KINDS["bam_expert_kv"], max_positions=32)
    save_checkpoint(random_state(cfg, 2), cfg, root / "mix.safetensors")
    return root / "mix.safetensors"


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def test_cli_export_verify_and_convert(checkpoint, tmp_path):
    result = run("export-onnx", checkpoint, "--out", tmp_path / "a", "--verify", "--opset", "20")
    assert result.exit_code == 0, result.output
    assert re.search(r"verify: logits max abs diff .* greedy tokens equal .*: OK", result.output)
    assert onnx.load(str(tmp_path / "a" / "model.onnx")).opset_import[0].version == 20
    result = run("export-onnx", checkpoint, "--out", tmp_path / "a", "--force", "--no-kv-cache")
    assert result.exit_code == 0, result.output
    assert not OrtDecoder(tmp_path / "a" / "model.onnx").kv_cache
    result = run("convert", checkpoint, "--out", tmp_path / "b", "--format", "onnx")
    assert result.exit_code == 0, result.output
    assert OrtDecoder(tmp_path / "b" / "model.onnx").kv_cache


def test_cli_bad_input_is_one_line_and_writes_nothing(checkpoint, tmp_path):
    not_a_model = tmp_path / "weights.safetensors"
    save_file({"w": torch.zeros(2)}, str(not_a_model))
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    existing = tmp_path / "existing"
    existing.mkdir()
    cases = [
        (["--out", tmp_path / "o", "--dtype", "bf16"], "unknown dtype 'bf16'"),
        (["--out", tmp_path / "o", "--opset", "13"], f"needs opset {MIN_OPSET} to"),
        (["--out", tmp_path / "o", "--opset", "x"], "--opset: 'x' is not an integer"),
        (["--out", existing], "already exists; pass --force"),
        (["--out", foreign, "--force"], "did not write"),
    ]
    for args, message in cases:
        result = run("export-onnx", checkpoint, *args)
        assert result.exit_code == 2, (args, result.output)
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("bam-surgery: error:") and message in lines[0], lines
    result = run("export-onnx", not_a_model, "--out", tmp_path / "o")
    assert result.exit_code == 2 and str(not_a_model.name) in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()
    assert [p.name for p in foreign.iterdir()] == ["notes.txt"] and not list(existing.iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["existing", "foreign", "weights.safetensors"]


# ---- memory ------------------------------------------------------------------------------------
EXPORT_MEMORY = r"""
import json, sys, threading, time
from pathlib import Path
from bam_surgery.converters import open_checkpoint
from bam_surgery.converters.export import export
import onnx, onnxruntime, torch  # imported before the baseline: their start-up is not the export's


def rss_kb():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


peak, done = [0], threading.Event()


def sample():
    while not done.is_set():
        peak[0] = max(peak[0], rss_kb())
        time.sleep(0.002)


reader = open_checkpoint(sys.argv[1])
before = rss_kb()
sampler = threading.Thread(target=sample)
sampler.start()
export(reader, Path(sys.argv[2]), "onnx", verify=True)
done.set()
sampler.join()
print(json.dumps({"before_kb": before, "peak_kb": peak[0]}))
"""


@pytest.mark.slow
def test_export_holds_the_weights_about_once(tmp_path):
    """export-onnx of a 160 MB mixture, --verify included, adds under 3x the weights to the process's peak memory
    (issue 31: torch.onnx.export's own folding, shape inference and serialization held about five copies: 4.8x
    here; now the model once with one folded weight at a time, then onnxruntime's session after the model is
    dropped: 2.0x here, 1.3x at 1.8 GB, where onnxruntime's fixed costs weigh less)."""
    import subprocess
    import sys

    cfg = tiny_config(vocab_size=4096, d_model=512, n_layers=3, n_heads=8, head_dim=64, n_kv_heads=2, ffn_hidden=1536,
                      attn_experts=4, ffn_experts=4, max_positions=64)
    save_checkpoint(random_state(cfg, 0), cfg, tmp_path / "mix.safetensors")
    weights = (tmp_path / "mix.safetensors").stat().st_size
    assert weights > 150e6
    done = subprocess.run([sys.executable, "-c", EXPORT_MEMORY, str(tmp_path / "mix.safetensors"), str(tmp_path / "o")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    rss = json.loads(done.stdout.strip().splitlines()[-1])
    added = (rss["peak_kb"] - rss["before_kb"]) * 1024
    assert added < 3.0 * weights, f"export added {added / 1e6:.0f} MB to the peak for {weights / 1e6:.0f} MB of weights"


@pytest.mark.parametrize("kind", ["dense_gpt2", "bam_expert_kv", "bam_gemma_window"])
def test_folding_equals_torch_onnx_folding(kind, tmp_path):
    """The graph onnx_fold folds (weights traced as inputs, folded one at a time) gives onnxruntime's logits and
    presents bit for bit as torch.onnx.export's own folding of the same model (export_params, do_constant_folding)."""
    from bam_surgery.converters import onnx_graph as og

    model = model_for(kind, seed=5)
    n = model.config.n_layers
    with torch.no_grad(), og._quiet():
        torch.onnx.export(og.DecoderGraph(model).eval(), og.example_inputs(model, True, torch.float32),
                          str(tmp_path / "torch.onnx"), dynamo=False, opset_version=og.DEFAULT_OPSET,
                          input_names=og.input_names(n, True), output_names=og.output_names(n, True),
                          dynamic_axes=og.dynamic_axes(n, True), do_constant_folding=True)
    og.export_graph(model, tmp_path / "ours.onnx")
    ids = np.array([[1, 2, 3, 4, 5], [3, 4, 5, 6, 7]])
    mask = np.ones_like(ids)
    mask[1, :2] = 0
    outputs = []
    for name in ("torch.onnx", "ours.onnx"):
        decoder = OrtDecoder(tmp_path / name)
        logits, present = decoder.forward(ids, mask)
        step, _ = decoder.forward(np.array([[7], [8]]), np.ones((2, 6), np.int64), present)
        outputs.append((logits, step, *present.values()))
    for theirs, ours in zip(*outputs):
        np.testing.assert_array_equal(ours, theirs)
