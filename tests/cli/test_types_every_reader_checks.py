"""Issue 42, the five older cases: a type only some readers checked, now read by one rule wherever it is read (one
line `bam-surgery: error: ...` naming the file and the field, exit status 2, or a correct result):

* a canonical checkpoint whose bam_provenance holds {"inputs": 5} (or any other shape a file we did not write may
  hold): inspect and export-gguf read it (runtime.checkpoint.provenance_inputs for every reader; inspect's table
  shows each field whatever its type), fuzzed with hypothesis;
* an HF folder whose config gives the eos id as a string (or true, or []): eval, which used it unchecked where
  the tokenizer names no eos, refuses in one line naming config.json (converters.hf.files.check_token_ids, the
  rule generate and the exports already applied);
* a tokenizer.json whose post-processor's special-token entry is a string: export-gguf names the entry;
* `plot --out DIR` on a full disk (matplotlib's write failing without a file name): the line names the file in DIR
  (tests/cli/test_disk_full.py);
* `generate --tokenizer /dev/zero`: "not a regular file", not "no such file or folder".
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import LLAMA_HF, cli_error_line, llama_hf_shapes, random_state, run_cli, tiny_config

from bam_surgery.runtime.checkpoint import PROVENANCE_KEY, provenance_inputs, save_checkpoint

CFG = tiny_config(vocab_size=300)  # the byte tokenizer's range: export-gguf writes it


@pytest.fixture
def provenance(tmp_path):
    def make(record) -> Path:
        return save_checkpoint(random_state(CFG), CFG, tmp_path / "m.safetensors",
                               metadata={PROVENANCE_KEY: json.dumps(record)})
    return make


@pytest.mark.parametrize("record", [
    {"inputs": 5}, {"inputs": "seed.safetensors"}, {"inputs": {"seed": {"role": "x", "path": 3}}},
    {"inputs": [5, None, {"files": [5, {"how": [1]}], "digest": None}]},
    {"training": [{"init": "x", "data": [5]}, {"data": [{"domain": "a", "weight": "w"}]}, {"data": {"a": 1}}]},
    {"experts": {"ffn": 5}, "tensors": {"a": 5, "b": {"op": [1]}}, "tool": {"name": [1]}, "recipe": {"name": 5}},
])
def test_any_provenance_is_read(tmp_path, provenance, record):
    path = provenance(record)
    assert "provenance" in run_cli("inspect", path).output
    json.loads(run_cli("inspect", path, "--json").output)
    run_cli("export-gguf", path, "--out", tmp_path / "m.gguf")
    assert (tmp_path / "m.gguf").is_file()


json_values = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.floats(allow_nan=False),
                                     st.text(max_size=4)),
                           lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                   st.dictionaries(st.sampled_from(
                                                       ["role", "path", "name", "files", "digest", "how", "sha256",
                                                        "init", "spec", "data", "domain", "weight", "op", "expert"]),
                                                       inner, max_size=3)), max_leaves=10)


@settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.dictionaries(st.sampled_from(["inputs", "training", "experts", "tensors", "tool", "recipe", "version"]),
                       json_values, max_size=4))
def test_every_reader_of_a_provenance_takes_any_shape(record):
    """inspect's rendering, the GGUF card and the expert names over provenance records of any shape."""
    from bam_surgery.converters.base import ExportOptions
    from bam_surgery.converters.gguf_export import byte_vocabulary, card_entries
    from bam_surgery.runtime.reader import StateReader
    from bam_surgery.surgery.inspect import inspect_checkpoint, render_inspection
    from bam_surgery.train.provenance import expert_names

    assert all(isinstance(i, dict) for i in provenance_inputs(record))
    reader = StateReader(STATE, CFG)
    reader.metadata = {PROVENANCE_KEY: json.dumps(record)}
    render_inspection(inspect_checkpoint(reader))
    card_entries(reader, Path("m.gguf"), ExportOptions(), "llama", byte_vocabulary(CFG.vocab_size))
    expert_names(record, tiny_config(ffn_experts=2, ffn_top_k=1))


STATE = random_state(CFG)


def bpe_folder(folder: Path, eos_token_id=2, eos_token: str | None = None) -> Path:
    """An HF Llama folder of 300 tokens with a byte-level BPE tokenizer.json of 260 (train/bpe.py) and its
    tokenizer_config.json naming `eos_token` (None: none)."""
    import torch
    from safetensors.torch import save_file

    from bam_surgery.train.bpe import build_bpe

    config = dict(LLAMA_HF, vocab_size=300, eos_token_id=eos_token_id)
    gen = torch.Generator().manual_seed(0)
    folder.mkdir(parents=True)
    save_file({n: torch.randn(s, generator=gen) * 0.1 for n, s in llama_hf_shapes(config).items()},
              str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config))
    build_bpe(["the quick brown fox jumps over the lazy dog"] * 20, 260).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({} if eos_token is None else {"eos_token": eos_token}))
    return folder


# ---- eos ids as strings ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("eos", ["2", ["2"], [], True])
def test_an_eos_id_of_the_wrong_type_in_config_json(tmp_path, eos):
    folder = bpe_folder(tmp_path / "hf", eos_token_id=eos, eos_token="no-such-token")
    (tmp_path / "d.txt").write_text("hello world the quick brown fox " * 40)
    line = cli_error_line("eval", folder, "--data", f"d={tmp_path / 'd.txt'}")
    assert f"{folder / 'config.json'}: eos_token_id: expected a token id" in line, line


# ---- a special token that is a string ---------------------------------------------------------------------------
def test_a_special_token_entry_that_is_a_string(tmp_path):
    pytest.importorskip("gguf")
    folder = bpe_folder(tmp_path / "hf")
    body = json.loads((folder / "tokenizer.json").read_text())
    body["post_processor"] = {"type": "TemplateProcessing", "single": [{"SpecialToken": "<|endoftext|>"},
                                                                        {"Sequence": {"id": "A", "type_id": 0}}]}
    (folder / "tokenizer.json").write_text(json.dumps(body))
    line = cli_error_line("export-gguf", folder, "--out", tmp_path / "o.gguf")
    assert "tokenizer.json: post_processor.single[0]: field 'SpecialToken' must be an object, got a string" in line, \
        line
    assert not (tmp_path / "o.gguf").exists()


# ---- --tokenizer /dev/zero --------------------------------------------------------------------------------------
def test_a_tokenizer_that_is_a_device(tmp_path):
    model = save_checkpoint(random_state(CFG), CFG, tmp_path / "m.safetensors")
    line = cli_error_line("generate", model, "--prompt", "a", "--tokenizer", "/dev/zero")
    assert "--tokenizer /dev/zero: /dev/zero is neither a tokenizer.json file nor a folder" in line, line


