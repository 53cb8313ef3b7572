"""Issue 33: side files (tokenizer.json, README.md, ...) read through one descriptor checked after opening.

A tokenizer.json swapped for a link to an outside file between the folder's check and the copy never brings
that file into `convert --format hf` or `export-onnx` outputs; a README.md linking out of the folder is refused
by export-gguf (it reads its license) like every other side file; a huge tokenizer.json is refused in one line
by every export that reads or copies it, by one bound (runtime.shards.MAX_SIDE_FILE_BYTES)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import cli_error_line, random_state, run_cli

from bam_surgery.runtime.checkpoint import save_checkpoint
from bam_surgery.runtime.safetensors_file import SafetensorsStreamWriter
from bam_surgery.runtime.jsonfile import MAX_JSON_BYTES as MAX_SIDE_FILE_BYTES  # export-gguf's bound, everywhere

from test_gguf import llama_config  # noqa: E402  (tests/converters)

SECRET = "TOP-SECRET-NOT-IN-THE-FOLDER"


@pytest.fixture
def hf(tmp_path) -> Path:
    """An HF Llama folder with a tokenizer.json, and a secret file beside it (outside the folder)."""
    cfg = llama_config()
    ckpt = save_checkpoint(random_state(cfg), cfg, tmp_path / "llama.safetensors")
    run_cli("convert", ckpt, "--format", "hf", "--architecture", "llama", "--out", tmp_path / "hf")
    (tmp_path / "hf" / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"type": "BPE"}}))
    (tmp_path / "secret.json").write_text(json.dumps({"secret": SECRET}))
    return tmp_path / "hf"


def swap_for_a_link(folder: Path) -> None:
    tok = folder / "tokenizer.json"
    if not tok.is_symlink():
        tok.unlink()
        tok.symlink_to(folder.parent / "secret.json")


def test_a_tokenizer_swapped_for_a_link_before_the_copy_in_convert_hf(hf, tmp_path, monkeypatch):
    real = SafetensorsStreamWriter.write

    def write(self, name, tensor):  # the weights are written after the side files were checked
        swap_for_a_link(hf)
        return real(self, name, tensor)

    monkeypatch.setattr(SafetensorsStreamWriter, "write", write)
    line = cli_error_line("convert", hf, "--format", "hf", "--out", tmp_path / "out")
    assert "tokenizer.json" in line and "outside" in line, line
    assert not (tmp_path / "out").exists()


def test_a_tokenizer_swapped_for_a_link_before_the_copy_in_export_onnx(hf, tmp_path, monkeypatch):
    import onnx

    real = onnx.checker.check_model

    def check(*args, **kwargs):  # the graph is checked just before the side files are copied
        swap_for_a_link(hf)
        return real(*args, **kwargs)

    monkeypatch.setattr(onnx.checker, "check_model", check)
    line = cli_error_line("export-onnx", hf, "--out", tmp_path / "out")
    assert "tokenizer.json" in line and "outside" in line, line
    assert not (tmp_path / "out").exists()


def test_a_readme_linking_out_of_the_folder_is_refused_by_export_gguf(hf, tmp_path):
    pytest.importorskip("gguf")
    (hf / "tokenizer.json").unlink()  # the byte tokenizer: this test is about the README
    (tmp_path / "outside.md").write_text(f"---\nlicense: {SECRET}\n---\n")
    (hf / "README.md").unlink(missing_ok=True)
    (hf / "README.md").symlink_to(tmp_path / "outside.md")
    line = cli_error_line("export-gguf", hf, "--out", tmp_path / "o.gguf")
    assert "README.md" in line and "outside" in line, line
    assert not (tmp_path / "o.gguf").exists()


@pytest.mark.parametrize("command", ["convert-hf", "export-onnx", "export-gguf"])
def test_a_huge_tokenizer_json_is_refused_in_one_line_by_every_export(hf, tmp_path, command):
    if command == "export-gguf":
        pytest.importorskip("gguf")
    with open(hf / "tokenizer.json", "r+b") as f:
        f.truncate(MAX_SIDE_FILE_BYTES + (1 << 20))  # sparse: costs no disk
    out = tmp_path / ("o.gguf" if command == "export-gguf" else "out")
    args = ["convert", hf, "--format", "hf"] if command == "convert-hf" else [command, hf]
    line = cli_error_line(*args, "--out", out)
    assert "tokenizer.json" in line and "too large" in line, line
    assert not out.exists() and not list(tmp_path.glob(".*.partial"))
    assert os.path.getsize(hf / "tokenizer.json") > MAX_SIDE_FILE_BYTES  # the input untouched
