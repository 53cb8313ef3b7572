"""Every dtype safetensors stores: read and written byte for byte, inspected and converted; merges
refuse what they cannot compute with, in one line; dtypes torch cannot hold are refused on open."""
from __future__ import annotations

import json
import struct

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import save_file

from conftest import random_state, tiny_config
from bam_surgery.runtime.checkpoint import CheckpointError, CheckpointReader, save_checkpoint
from bam_surgery.runtime.dtypes import SAFETENSORS_DTYPES
from bam_surgery.runtime.safetensors_file import SafetensorsFile, SafetensorsStreamWriter
from bam_surgery.cli.commands import cli


def labelled(dtype: torch.dtype, n: int = 12) -> torch.Tensor:
    """n distinct bytes per element viewed as `dtype` (every bit pattern is a valid value to copy)."""
    raw = torch.arange(n * dtype.itemsize, dtype=torch.int64).remainder(251).to(torch.uint8)
    return raw.view(dtype).reshape(3, -1)


@pytest.mark.parametrize("name", list(SAFETENSORS_DTYPES))
def test_every_dtype_reads_and_writes_byte_for_byte(tmp_path, name):
    dtype = SAFETENSORS_DTYPES[name]
    x = labelled(dtype)
    save_file({"x": x}, str(tmp_path / "theirs.safetensors"))  # safetensors' writer, our reader
    got = SafetensorsFile(tmp_path / "theirs.safetensors").get("x")
    assert got.dtype == dtype and torch.equal(got.view(torch.uint8), x.view(torch.uint8))
    with SafetensorsStreamWriter(tmp_path / "ours.safetensors", [("x", tuple(x.shape), dtype)]) as w:
        w.write("x", x)  # our writer, safetensors' reader
    raw = (tmp_path / "ours.safetensors").read_bytes()
    assert json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])["x"]["dtype"] == name
    with safe_open(str(tmp_path / "ours.safetensors"), "pt") as f:
        assert torch.equal(f.get_tensor("x").view(torch.uint8), x.view(torch.uint8))


def fp8_checkpoint(tmp_path):
    cfg = tiny_config()
    state = {k: v.to(torch.float8_e4m3fn) if v.dim() == 2 else v for k, v in random_state(cfg).items()}
    return save_checkpoint(state, cfg, tmp_path / "fp8.safetensors"), state


def test_fp8_checkpoint_inspects_and_converts(tmp_path):
    path, state = fp8_checkpoint(tmp_path)
    result = CliRunner().invoke(cli, ["inspect", str(path), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert "float8_e4m3fn" in report["groups"]["attention"]["dtypes"] and report["mismatches"] == []
    result = CliRunner().invoke(cli, ["convert", str(path), "--out", str(tmp_path / "copy"), "--max-shard-size", "4KB"])
    assert result.exit_code == 0, result.output
    with CheckpointReader(tmp_path / "copy") as back:
        for name, tensor in state.items():
            assert back.dtype(name) == tensor.dtype
            assert torch.equal(back.get(name).view(torch.uint8), tensor.view(torch.uint8)), name


def test_merge_refuses_fp8_weights_in_one_line(tmp_path):
    path, _ = fp8_checkpoint(tmp_path)
    out = tmp_path / "mix.safetensors"
    result = CliRunner().invoke(cli, ["merge", "--seed", str(path), "--recipe", "upcycle", "--out", str(out)])
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"bam-surgery: error: {path}: tensor ") and "has dtype float8_e4m3fn" in line
    assert "weights must be floating point (float32, bfloat16, float16, float64)" in line
    assert not out.exists()


def test_a_dtype_torch_cannot_hold_is_refused_naming_file_and_tensor(tmp_path):
    header = json.dumps({"__metadata__": {"bam_config": tiny_config().to_json()},
                         "t": {"dtype": "F6_E2M3", "shape": [16], "data_offsets": [0, 12]}}).encode()
    header += b" " * (-len(header) % 8)
    path = tmp_path / "f6.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(12))
    with pytest.raises(CheckpointError, match=r"f6\.safetensors: tensor t has dtype F6_E2M3, which has no torch dtype"):
        CheckpointReader(path)
    result = CliRunner().invoke(cli, ["inspect", str(path)])  # one line, no traceback (inspect's own "Error:")
    assert result.exit_code != 0 and "Traceback" not in result.output and not isinstance(result.exception, KeyError)
    (line,) = result.stderr.strip().splitlines()
    assert "f6.safetensors: tensor t has dtype F6_E2M3" in line
