"""The whole route on each family of 2024-25, through the CLI as a user runs it: a transformers folder of Llama 3.2,
Qwen3, Phi-3, OLMo 2 and SmolLM3 (tiny configs from the real ones, a 256-token vocabulary: the byte tokenizer
reads the shipped corpus) merges with BAM, trains, generates the runtime's own greedy tokens, and exports to
HF BAM (transformers' remote-code load gives the trained checkpoint's logits) and ONNX (verified in onnxruntime
by export-onnx --verify)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from conftest import FAMILY_CASES, max_diff, random_hf_model, run_cli  # noqa: E402
from bam_surgery.runtime import load_model  # noqa: E402
from bam_surgery.runtime.generation import generate  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DATA = f"code={ROOT / 'data/domains/code'}"


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama3.2", "qwen3", "phi3", "olmo2", "smollm3", "gemma2", "gemma3"])
def test_merge_train_generate_export(tmp_path, hf_modules, family):
    cls_name, kwargs = FAMILY_CASES[family]
    if family == "gemma2":  # Gemma 2's own soft-caps: the tiny case's 3.0 squeezes logits into near-ties
        kwargs = dict(kwargs, attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
    random_hf_model(cls_name, dict(kwargs, vocab_size=256), seed=2).save_pretrained(tmp_path / "seed")
    mix = tmp_path / "mix.safetensors"
    run_cli("merge", "--quiet", "--seed", tmp_path / "seed", "--experts", f"{tmp_path / 'seed'},{tmp_path / 'seed'}",
            "--out", mix)
    run = tmp_path / "run"
    run_cli("train", "--init", mix, "--data", DATA, "--out", run, "--steps", "2", "--seq-len", "32", "--micro-batch",
            "2", "--lr", "1e-3", "--eval-tokens", "64", "--no-plot")
    checkpoint = run / "checkpoints" / "step-00000002"
    model = load_model(checkpoint).eval()
    assert model.config.scaled_rope == load_model(mix).config.scaled_rope

    prompt = "def f(x):"
    out = run_cli("generate", run, "--prompt", prompt, "--max-new-tokens", "6").output
    want = generate(model, torch.tensor([list(prompt.encode())]), 6)[0].tolist()
    assert bytes(want).decode("utf-8", "replace") in out

    run_cli("convert", run, "--format", "hf", "--out", tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=True,
                                                           dtype=torch.float32).eval()
    tokens = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert max_diff(hf(tokens).logits, model(tokens).logits) <= 1e-4

    result = run_cli("export-onnx", run, "--out", tmp_path / "onnx", "--verify")
    assert "OK" in result.output
