"""Issue 33, a full disk: export-gguf names the file and says the disk is full (numpy's short write, which the
gguf package reports without an errno, was "8192 requested and 5912 written"); `plot --out DIR` leaves no DIR
it created behind, nor a partial PNG. One line `bam-surgery: error: ...`, exit status 2, nothing half-written."""
from __future__ import annotations

import errno
import json
import os

import pytest

from conftest import cli_error_line, random_state

from bam_surgery.runtime import ModelConfig
from bam_surgery.runtime.checkpoint import save_checkpoint


def llama_config() -> ModelConfig:  # tests/converters/test_gguf.py's tiny Llama
    return ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128,
                       max_positions=128, rope_theta=10000.0, norm_eps=1e-6, name="tiny-llama")


def test_export_gguf_on_a_full_disk_names_the_file(tmp_path, monkeypatch):
    g = pytest.importorskip("gguf")
    cfg = llama_config()
    ckpt = save_checkpoint(random_state(cfg), cfg, tmp_path / "llama.safetensors")
    calls = []

    def short_write(self, tensor):  # numpy's tofile on a full disk
        calls.append(1)
        if len(calls) == 3:
            raise OSError("8192 requested and 5912 written")

    monkeypatch.setattr(g.GGUFWriter, "write_tensor_data", short_write)
    out = tmp_path / "o.gguf"
    line = cli_error_line("export-gguf", ckpt, "--out", out)
    assert str(out) in line and "disk is full" in line and "No space left" in line, line
    assert sorted(os.listdir(tmp_path)) == ["llama.safetensors"]


def run_folder(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"kind": "train", "step": s, "loss": 3.0 - s, "lr": 1e-3})
                                               + "\n" for s in (1, 2)))
    return run


def test_plot_out_on_a_full_disk_leaves_no_folder(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    run = run_folder(tmp_path)
    real, calls = Figure.savefig, []

    def savefig(self, fname, *args, **kwargs):  # the first PNG is written, the second meets a full disk
        calls.append(fname)
        if len(calls) == 2:
            open(fname, "wb").write(b"\x89PNG partial")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(fname))
        return real(self, fname, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    line = cli_error_line("plot", run, "--out", tmp_path / "png" / "deep")
    assert "No space left" in line, line
    assert sorted(os.listdir(tmp_path)) == ["run"]
    assert sorted(os.listdir(run)) == ["metrics.jsonl"]


def test_plot_on_a_full_disk_names_the_file(tmp_path, monkeypatch):
    """Issue 42: matplotlib writes the PNG through a file object, so on a full disk its OSError has no file name
    ("No space left on device" alone): the line names the file in DIR."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    def full(self, fname, *args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(Figure, "savefig", full)
    out = tmp_path / "png"
    line = cli_error_line("plot", run_folder(tmp_path), "--out", out)
    assert f"{out / 'loss.png'}: could not be written (No space left on device)" in line, line
    assert not out.exists()
