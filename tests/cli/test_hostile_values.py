"""Issue 33, numbers and values: each is one line `bam-surgery: error: ...` naming the option, file or tensor,
exit status 2, never a traceback: a prompt holding a lone surrogate (bytes of the command line that are not
UTF-8), weights stored as int32 (generate, export-onnx), a Unigram tokenizer.json without unk_id meeting an
unknown character (generate), merge --z-coef inf and a merge input with non-finite values."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import cli_error_line, random_state, seed_and_experts, tiny_config

from bam_surgery.runtime.checkpoint import save_checkpoint

CFG = tiny_config(vocab_size=256)


@pytest.fixture
def model(tmp_path) -> Path:
    return save_checkpoint(random_state(CFG), CFG, tmp_path / "model.safetensors")


def test_a_prompt_with_a_lone_surrogate(model):
    line = cli_error_line("generate", model, "--prompt", "a\udcffb", "--max-new-tokens", 2)
    assert "--prompt" in line and "surrogate" in line, line


@pytest.mark.parametrize("command", ["generate", "export-onnx"])
def test_weights_stored_as_int32(tmp_path, command):
    state = {k: (v * 100).to(torch.int32) for k, v in random_state(CFG).items()}
    ckpt = save_checkpoint(state, CFG, tmp_path / "i32.safetensors")
    args = ["--prompt", "ab", "--max-new-tokens", 2] if command == "generate" else ["--out", tmp_path / "onnx"]
    line = cli_error_line(command, ckpt, *args)
    assert "i32.safetensors" in line and "embed.weight" in line and "int32" in line, line
    assert not (tmp_path / "onnx").exists()


def test_a_unigram_tokenizer_without_unk_id(model, tmp_path):
    vocab = [[chr(0x4E00 + i), -float(i + 1)] for i in range(CFG.vocab_size)]
    tok = tmp_path / "tokenizer.json"
    tok.write_text(json.dumps({"version": "1.0", "model": {"type": "Unigram", "vocab": vocab}}))
    line = cli_error_line("generate", model, "--prompt", "ab", "--tokenizer", tok, "--max-new-tokens", 2)
    assert str(tok) in line and "unk_id" in line, line


def test_merge_z_coef_inf_and_a_non_finite_input(tmp_path):
    cfg = tiny_config(block="parallel", norm="layernorm")
    seed, code, math_ = seed_and_experts(tmp_path / "in", cfg)
    experts = f"{code},{math_}"
    line = cli_error_line("merge", "--seed", seed, "--experts", experts, "--z-coef", "inf", "--out", tmp_path / "o")
    assert "--z-coef" in line, line
    state = random_state(cfg, 3)
    state["layers.0.ffn.up.weight"][0, 0] = float("nan")
    bad = save_checkpoint(state, cfg, tmp_path / "nan.safetensors")
    line = cli_error_line("merge", "--seed", seed, "--experts", f"{bad},{math_}", "--out", tmp_path / "o")
    assert "nan.safetensors" in line and "non-finite" in line, line
    assert not (tmp_path / "o").exists()
