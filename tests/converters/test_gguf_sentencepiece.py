"""SentencePiece tokenizers of GGUF files (tokenizer.ggml.model "llama": converters/gguf_sentencepiece.py) rebuilt as a
tokenizer.json that encodes and decodes as transformers' own GGUF loader's tokenizer of the same file
(AutoTokenizer.from_pretrained(folder, gguf_file=...)), on tiny synthetic files: our GGUF export of a tiny model of
the architecture with its vocabulary replaced by a SentencePiece one (control tokens, a user-defined "\\n", Gemma's
run of spaces stored as spaces, the 256 byte-fallback tokens, pieces whose scores imply merges in an order unlike
their file order); Gemma ranks merges by file order, Llama and Phi-3 by score. Hostile metadata (scores or token
types not one per token, token types out of range, values of the wrong type) is one line naming the file and key.
The real Gemma-3-270M file: tests/compat/test_real_gemma.py.
"""
from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from bam_surgery.converters import open_checkpoint
from bam_surgery.converters import gguf_export
from bam_surgery.converters.gguf_file import parse_gguf
from bam_surgery.converters.gguf_tokenizer import tokenizer_texts
from bam_surgery.runtime.errors import CheckpointError
from conftest import cli_error_line, random_state, run_cli

gguf = pytest.importorskip("gguf")
from test_gguf import family_config, llama_config, write  # noqa: E402
from test_gguf_input import _replace_field  # noqa: E402

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE = 1, 2, 3, 4, 6
SPECIALS = [("<pad>", CONTROL), ("<eos>", CONTROL), ("<bos>", CONTROL), ("<unk>", UNKNOWN), ("<mask>", CONTROL),
            ("<start_of_turn>", CONTROL), ("<end_of_turn>", CONTROL), ("\n", USER_DEFINED), ("  ", NORMAL)]
PIECES = ["\u2581", "t", "h", "e", "a", "c", "s", "o", "n", "i", "g", "r", "u", "m", "l", "d", "x", "p", "y", "w",
          "th", "he", "\u2581t", "\u2581th", "\u2581the", "at", "ca", "cat", "\u2581c", "\u2581cat", "on", "\u2581on",
          "in", "ing", "ng", "\u2581in", "er", "use", "us", "se", "\u2581a", "\u2581s", "sat", "\u2581sat", "ma",
          "mat", "\u2581m", "\u2581mat", "\u2581\u2581\u2581", "hi", "\u2581hi", "lo", "el", "ll",
          "\u2581he", "\u2581hel", "\u2581hello", "\u2581x", "py", "\u2581py"]
TEXTS = ["the cat sat on the mat", " the  cat   sat\n\non the mat\n", "hello world, cat-using thing",
         "café 日本語 🦙 naïve\ttab", "<start_of_turn>user\nhi the cat<end_of_turn>\n<start_of_turn>model\n",
         "<bos>the<eos> <mask> <unk>", "  leading and trailing  ", "", "\n", "x" * 50 + " " * 7 + "y"]


def vocabulary() -> tuple[list[str], list[float], list[int]]:
    tokens = [t for t, _ in SPECIALS] + [f"<0x{b:02X}>" for b in range(256)] + PIECES
    types = [k for _, k in SPECIALS] + [BYTE] * 256 + [NORMAL] * len(PIECES)
    rng = random.Random(3)  # scores of the pieces shuffled: the score order is not the file order
    piece_scores = [-float(i) for i in range(len(PIECES))]
    rng.shuffle(piece_scores)
    scores = [-1000.0] * len(SPECIALS) + [0.0] * 256 + piece_scores
    return tokens, scores, types


def spm_file(tmp_path: Path, monkeypatch, family: str, **overrides) -> Path:
    """A tiny model of `family` (test_gguf.FAMILIES; "llama": test_gguf.llama_config) as a GGUF whose tokenizer is
    the SentencePiece vocabulary above (fields replaced by `overrides`, None drops one)."""
    tokens, scores, types = vocabulary()
    cfg = (llama_config() if family == "llama" else family_config(family)).replace(vocab_size=len(tokens))
    values = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.pre": "default", "tokenizer.ggml.tokens": tokens,
              "tokenizer.ggml.scores": scores, "tokenizer.ggml.token_type": types,
              "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1,
              "tokenizer.ggml.unknown_token_id": 3, "tokenizer.ggml.padding_token_id": 0,
              "tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_eos_token": False,
              "tokenizer.chat_template": "{% for m in messages %}<start_of_turn>{{ m['role'] }}\n"
                                         "{{ m['content'] }}<end_of_turn>\n{% endfor %}<start_of_turn>model\n"}
    values.update(overrides)

    def sentencepiece(w, vocab) -> None:
        g = gguf.GGUFValueType
        kinds = {str: g.STRING, bool: g.BOOL, int: g.UINT32}
        for key, value in values.items():
            if value is None:
                continue
            if isinstance(value, list):
                sub = {str: g.STRING, float: g.FLOAT32, int: g.INT32}[type(value[0])]
                w.add_key_value(key, value, g.ARRAY, sub_type=sub)
            else:
                w.add_key_value(key, value, kinds[type(value)])

    monkeypatch.setattr(gguf_export, "_write_vocabulary", sentencepiece)
    out = write(cfg, random_state(cfg), tmp_path / f"{family}.gguf", gguf_dtype="f32")
    monkeypatch.undo()
    return out


def theirs(path: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.mark.parametrize("family", ["gemma3", "llama", "phi3"])
def test_encodes_and_decodes_as_transformers_gguf_tokenizer(tmp_path, monkeypatch, family):
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    path = spm_file(tmp_path, monkeypatch, family)
    reference = theirs(path)
    with open_checkpoint(path) as reader:
        files = {f.name: f for f in reader.tokenizer_files()}
    assert set(files) == {"tokenizer.json", "tokenizer_config.json", "generation_config.json"}
    ours = transformers.AutoTokenizer.from_pretrained(str(files["tokenizer.json"].parent))
    raw = tokenizers.Tokenizer.from_file(str(files["tokenizer.json"]))  # what generate and train use
    body = json.loads(files["tokenizer.json"].read_text())
    assert json.loads(reference.backend_tokenizer.to_str())["model"]["merges"] == body["model"]["merges"]
    checked = 0
    for text in TEXTS:
        expected = reference(text).input_ids
        assert ours(text).input_ids == expected, (family, text)
        assert raw.encode(text).ids == expected, (family, text)
        assert ours(text, add_special_tokens=False).input_ids == reference(text, add_special_tokens=False).input_ids
        assert ours.decode(expected) == reference.decode(expected), (family, text)
        assert ours.decode(expected, skip_special_tokens=True) == reference.decode(expected, skip_special_tokens=True)
        checked += len(expected)
    assert checked > 150
    assert reference("café").input_ids[-1] in range(9, 9 + 256)  # "é" is no piece: byte fallback
    messages = [{"role": "user", "content": "hi the cat"}]
    assert ours.apply_chat_template(messages, tokenize=True) == reference.apply_chat_template(messages, tokenize=True)
    config = json.loads(files["tokenizer_config.json"].read_text())
    assert (config["bos_token"], config["eos_token"], config["add_bos_token"]) == ("<bos>", "<eos>", True)
    generation = json.loads(files["generation_config.json"].read_text())
    # llama.cpp stops at <end_of_turn> as well as eos (transformers' GGUF path keeps eos alone)
    assert generation == {"bos_token_id": 2, "eos_token_id": [1, 6], "pad_token_id": 0}


def test_generate_takes_the_rebuilt_tokenizer(tmp_path, monkeypatch):
    path = spm_file(tmp_path, monkeypatch, "gemma3")
    result = run_cli("generate", path, "--prompt", "the cat sat", "--max-new-tokens", "3")
    assert "prompt tokens" in result.output, result.output  # no longer refused for want of --tokenizer


def test_gemma_merges_follow_file_order_and_spaces_are_respelled():
    tokens, scores, types = vocabulary()
    fields = {"general.architecture": "gemma3", "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
              "tokenizer.ggml.scores": scores, "tokenizer.ggml.token_type": types, "tokenizer.ggml.eos_token_id": 1}
    body = json.loads(tokenizer_texts(fields, "g.gguf", None)["tokenizer.json"])
    assert body["model"]["vocab"]["\u2581\u2581"] == 8
    assert "  " not in body["model"]["vocab"]  # stored as two spaces, spelled as the normalizer writes them
    merges = body["model"]["merges"]
    assert merges.index(["t", "h"]) < merges.index(["\u2581t", "h"])  # "th" comes before "▁th" in the file
    llama = json.loads(tokenizer_texts({**fields, "general.architecture": "llama"}, "l.gguf", None)["tokenizer.json"])
    assert llama["model"]["merges"] != merges  # ranked by score there, and "  " is no "\u2581\u2581"


N = len(vocabulary()[0])
HOSTILE = {
    "scores shorter": ({"tokenizer.ggml.scores": [0.0] * 10}, "tokenizer.ggml.scores"),
    "scores of strings": ({"tokenizer.ggml.scores": ["x"] * N}, "tokenizer.ggml.scores[0]"),
    "scores missing": ({"tokenizer.ggml.scores": None}, "tokenizer.ggml.scores"),
    "nan score": ({"tokenizer.ggml.scores": [float("nan")] * N}, "tokenizer.ggml.scores[0]"),
    "token_type longer": ({"tokenizer.ggml.token_type": [1] * 400}, "tokenizer.ggml.token_type"),
    "token_type out of range": ({"tokenizer.ggml.token_type": [9] * N}, "tokenizer.ggml.token_type[0]"),
    "negative token_type": ({"tokenizer.ggml.token_type": [1] * (N - 1) + [-1]}, f"tokenizer.ggml.token_type[{N - 1}]"),
    "token_type of strings": ({"tokenizer.ggml.token_type": ["1"] * N}, "tokenizer.ggml.token_type"),
    "tokens not strings": ({"tokenizer.ggml.tokens": [1] * N}, "tokenizer.ggml.tokens"),
    "add_bos not a flag": ({"tokenizer.ggml.add_bos_token": "yes"}, "tokenizer.ggml.add_bos_token"),
    "eos outside": ({"tokenizer.ggml.eos_token_id": 10**6}, "tokenizer.ggml.eos_token_id"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_metadata_is_one_line_naming_file_and_key(case):
    tokens, scores, types = vocabulary()
    fields = {"general.architecture": "llama", "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
              "tokenizer.ggml.scores": scores, "tokenizer.ggml.token_type": types, "tokenizer.ggml.eos_token_id": 1}
    change, key = HOSTILE[case]
    fields.update(change)
    fields = {k: v for k, v in fields.items() if v is not None}
    for arch in ("llama", "gemma3"):
        if arch == "gemma3" and case == "scores missing":
            continue  # Gemma ranks merges by token order: its scores are not needed
        with pytest.raises(CheckpointError) as e:
            tokenizer_texts({**fields, "general.architecture": arch}, "/x/hostile.gguf", None)
        message = str(e.value)
        assert message.startswith("/x/hostile.gguf: ") and key in message and "\n" not in message, message


def test_hostile_file_is_one_line_at_the_command_line(tmp_path, monkeypatch):
    """A token type patched to 9 in the file itself: count-params exits 2 with one line naming file and key."""
    path = spm_file(tmp_path, monkeypatch, "llama")
    data = path.read_bytes()
    fields = parse_gguf(path).fields
    types = fields["tokenizer.ggml.token_type"]
    import struct
    body = struct.pack("<IIQ", 9, 5, len(types)) + struct.pack(f"<{len(types)}i", *([9] + types[1:].tolist()))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(_replace_field(data, "tokenizer.ggml.token_type", body))
    line = cli_error_line("count-params", bad)
    assert str(bad) in line and "tokenizer.ggml.token_type[0]" in line, line


def test_a_token_too_long_to_cut_is_not_rebuilt_and_says_so():
    from bam_surgery.converters.gguf_sentencepiece import MAX_MERGE_WORK

    tokens, scores, types = vocabulary()
    long = "x" * (math.isqrt(MAX_MERGE_WORK) + 2)  # cutting it alone slices more than the bound
    fields = {"general.architecture": "llama", "tokenizer.ggml.model": "llama",
              "tokenizer.ggml.tokens": tokens + [long], "tokenizer.ggml.scores": scores + [0.0],
              "tokenizer.ggml.token_type": types + [1]}
    note = tokenizer_texts(fields, "l.gguf", None)
    assert isinstance(note, str) and "tokenizer.ggml.tokens" in note and "more than" in note
