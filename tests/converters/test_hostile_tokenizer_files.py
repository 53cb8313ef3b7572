"""Issue 33: tokenizer.json, tokenizer_config.json, generation_config.json and the provenance record with wrong
types, lone surrogates, deep nesting or huge sizes, as the exports and `generate` read them: one line
`bam-surgery: error: ...` naming the file and the field, exit status 2, no traceback, nothing written."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from conftest import cli_error_line, random_state, run_cli

from bam_surgery.runtime.checkpoint import PROVENANCE_KEY, save_checkpoint

from test_gguf import CORPUS, llama_config  # noqa: E402  (tests/converters: the BPE corpus of the GGUF tests)

pytest.importorskip("tokenizers")
pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> dict:
    """A byte-level BPE tokenizer.json learnt by train/bpe.py, as a dict to damage."""
    from bam_surgery.train.bpe import build_bpe

    folder = tmp_path_factory.mktemp("bpe")
    build_bpe(CORPUS, 300).save(str(folder / "tokenizer.json"))
    return json.loads((folder / "tokenizer.json").read_text())


def folder_with(tmp_path: Path, tokenizer: dict | bytes, provenance: str | None = None,
                **side: dict | bytes | str) -> Path:
    cfg = llama_config(vocab_size=300)
    meta = {PROVENANCE_KEY: provenance} if provenance is not None else None
    folder = save_checkpoint(random_state(cfg), cfg, tmp_path / "ckpt", metadata=meta)
    for name, body in {"tokenizer.json": tokenizer, **side}.items():
        data = body if isinstance(body, bytes) else json.dumps(body).encode() if not isinstance(body, str) else body.encode()
        (folder / name.replace("_json", ".json")).write_bytes(data)
    return folder


def damaged(bpe: dict, path: str, value) -> dict:
    body = json.loads(json.dumps(bpe))
    *parents, last = path.split(".")
    node = body
    for p in parents:
        node = node[p]
    node[last] = value
    return body


TOKENIZER_CASES = {
    "merges-int": ("model.merges", 5, "merges"),
    "merges-ints": ("model.merges", [1, 2], "merges"),
    "merges-nested": ("model.merges", [[1, 2]], "merges"),
    "vocab-list": ("model.vocab", ["a"], "vocab"),
    "pre-sequence-int": ("pre_tokenizer", {"type": "Sequence", "pretokenizers": 5}, "pre[-_]tokenizer"),
    "pre-sequence-ints": ("pre_tokenizer", {"type": "Sequence", "pretokenizers": [1]}, "pre[-_]tokenizer"),
    "post-sequence-int": ("post_processor", {"type": "Sequence", "processors": 7}, "post[-_]processor"),
    "post-single-str": ("post_processor", {"type": "TemplateProcessing", "single": "x"}, "post[-_]processor"),
    "post-single-ints": ("post_processor", {"type": "TemplateProcessing", "single": [1, 2]}, "post[-_]processor"),
    "added-ints": ("added_tokens", [1, 2], "added_tokens"),
    "added-str": ("added_tokens", "x", "added_tokens"),
    "added-content-int": ("added_tokens", [{"id": 3, "content": 5}], "added_tokens"),
    "surrogate-token": ("model.vocab", {"\ud800": 0}, "surrogate"),
}


@pytest.mark.parametrize("case", sorted(TOKENIZER_CASES))
def test_tokenizer_json_with_wrong_types_in_export_gguf(tmp_path, bpe, case):
    path, value, needle = TOKENIZER_CASES[case]
    folder = folder_with(tmp_path, damaged(bpe, path, value))
    line = cli_error_line("export-gguf", folder, "--out", tmp_path / "o.gguf")
    assert "tokenizer.json" in line and re.search(needle, line), line
    assert not (tmp_path / "o.gguf").exists()


@pytest.mark.parametrize("body,needle", [
    ([1, 2], "expected a JSON object"), (b"[" * 5000 + b"]" * 5000, "nested"),
    ({"eos_token": 5}, "eos_token"), ({"eos_token": ["<|endoftext|>"]}, "eos_token"),
    ({"chat_template": "\ud800"}, "surrogate"), ({"chat_template": 5}, "chat_template"),
    ({"bos_token": {"content": 3}}, "bos_token"),
])
def test_tokenizer_config_json_in_export_gguf(tmp_path, bpe, body, needle):
    folder = folder_with(tmp_path, bpe, tokenizer_config_json=body)
    line = cli_error_line("export-gguf", folder, "--out", tmp_path / "o.gguf")
    assert "tokenizer_config.json" in line and needle in line, line


PROVENANCE_CASES = {
    "deep": "[" * 50_000 + "]" * 50_000,
    "deep-inside": json.dumps({"inputs": [{"name": 1}]})[:-1] + ', "x": ' + "[" * 800 + "]" * 800 + "}",
    "inputs-str": json.dumps({"inputs": "abc"}),
    "inputs-ints": json.dumps({"inputs": [1, 2]}),
    "recipe-list": json.dumps({"recipe": [1], "inputs": [{"path": 5, "expert": "x", "digest": []}]}),
    "experts-str": json.dumps({"experts": {"ffn": "ab"}, "training": 5}),
}


@pytest.mark.parametrize("case", sorted(PROVENANCE_CASES))
@pytest.mark.parametrize("command", ["inspect", "export-gguf"])
def test_provenance_with_wrong_types_or_deep_nesting(tmp_path, bpe, case, command):
    folder = folder_with(tmp_path, bpe, provenance=PROVENANCE_CASES[case])
    args = [command, folder] + (["--out", tmp_path / "o.gguf"] if command == "export-gguf" else [])
    result = run_cli(*args, code=None)
    assert result.exit_code in (0, 2), result.output
    assert "Traceback" not in result.output
    if result.exit_code == 2:
        assert PROVENANCE_KEY in result.output and result.output.count("\n") == 1, result.output
