"""Issue 42: hostile GGUF files. Each of the campaign's causes is one line `bam-surgery: error: ...` naming the file and
the key (exit status 2), or a correct result, in bounded time and memory:

  1. general.architecture stored as an array            one line (gguf_metadata's rule: "expected a string")
  2. tokenizer.ggml.pre stored as an array               one line
  3. YaRN's original_context_length inf, NaN, a string   one line each
     or an array
  4. a SentencePiece vocabulary "a", "aa", ... ("a" * L)  not rebuilt (the merge derivation's bound,
                                                         gguf_sentencepiece.MAX_MERGE_WORK, checked before any cut:
                                                         the reader's note and generate's one line name
                                                         tokenizer.ggml.tokens; never the byte tokenizer instead)
  5. tokenizer.ggml.scores of many floats                 one line naming the key; the floats stay one numpy array
                                                         and the cache key hashes their bytes
  6. a split GGUF's part linking outside its folder       one line (the folder rule of every weight file, checked on
     (the second part, or the first)                     the opened descriptor)
  7. a folder's model.gguf linking outside it             one line
  (8. the tokenizer cache: test_tokenizer_cache.py)

and the weak messages: general.alignment "32", bos_token_id "0", value_length unlike key_length, an unknown
pre-tokenizer of a small vocabulary (never read as bytes), merges naming no token (what `tokenizers` could not load:
duplicate or emptied tokens), the bounds on key-value pairs, tensors and array strings; duplicate, empty, NUL and
16 MB tokens read correctly. Hypothesis fuzzes the type and size of every metadata key the reader reads. The files are
written byte by byte (raw_gguf: benchmarks/hostile_gguf.py's writer), so any value type can sit under any key. Wall times and memory are measured
outside the tests (no timing here): the bounds asserted are the work the code does.
"""
from __future__ import annotations

import json
import math
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import cli_error_line, random_state, run_cli

from bam_surgery.converters import gguf_file, gguf_sentencepiece, gguf_tokenizer, open_checkpoint
from bam_surgery.converters.gguf_file import parse_gguf
from bam_surgery.runtime.errors import UserError, one_line

gguf = pytest.importorskip("gguf")
from test_gguf import llama_config, write, write_bpe  # noqa: E402
from test_gguf_sentencepiece import vocabulary  # noqa: E402

STRING, ARRAY = 8, 9
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: benchmarks/ writes GGUF files too
from benchmarks.hostile_gguf import gguf_string as _string  # noqa: E402
from benchmarks.hostile_gguf import write_gguf as raw_gguf  # noqa: E402


def contents(path: Path) -> tuple[dict, list]:
    """(fields, tensors) of a GGUF as raw_gguf takes them, read with gguf's own reader."""
    reader = gguf.GGUFReader(str(path))
    fields = {}
    for key, f in reader.fields.items():
        if not key.startswith("GGUF."):
            vtype = int(f.types[0])
            fields[key] = (vtype, f.contents(), int(f.types[-1]) if vtype == ARRAY else None)
    return fields, [(t.name, np.array(t.data), int(t.tensor_type)) for t in reader.tensors]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> tuple[dict, list]:
    """A tiny Llama with a byte-level BPE tokenizer (310 tokens), as (fields, tensors)."""
    cfg = llama_config(vocab_size=310, n_layers=1)
    path = write_bpe(cfg, random_state(cfg), tmp_path_factory.mktemp("bpe") / "bpe.gguf", gguf_dtype="f32")
    return contents(path)


def spm(tmp_path: Path, tokens: list[str], scores=None, arch: str = "llama") -> Path:
    """A tiny Llama whose tokenizer is the SentencePiece vocabulary `tokens` (scores: 0 each, or given)."""
    cfg = llama_config(vocab_size=256, n_layers=1)  # the byte tokenizer's, then the embeddings resized
    fields, tensors = contents(write(cfg, random_state(cfg), tmp_path / "src.gguf", gguf_dtype="f32"))
    fields = {k: v for k, v in fields.items() if not k.startswith("tokenizer.") and k != "llama.vocab_size"}
    fields["general.architecture"] = (STRING, arch, None)
    n = len(tokens)
    tensors = [(name, np.full((n, a.shape[1]), 0.01, np.float32) if name in ("token_embd.weight", "output.weight")
                else a, qtype) for name, a, qtype in tensors]
    fields.update({"tokenizer.ggml.model": (STRING, "llama", None), "tokenizer.ggml.tokens": (ARRAY, tokens, STRING),
                   "tokenizer.ggml.scores": (ARRAY, np.zeros(n) if scores is None else scores, 6),
                   "tokenizer.ggml.token_type": (ARRAY, [1] * n, 5), "tokenizer.ggml.eos_token_id": (4, 0, None)})
    return raw_gguf(tmp_path / "spm.gguf", fields, tensors)


def hostile(tmp_path: Path, base: tuple[dict, list], name: str, **changes) -> Path:
    """base with keys replaced (changes: key with "." spelled "__" -> (type, value, item type) or None to drop)."""
    fields, tensors = base
    fields = dict(fields)
    for key, value in changes.items():
        key = key.replace("__", ".")
        if value is None:
            fields.pop(key, None)
        else:
            fields[key] = value
    return raw_gguf(tmp_path / f"{name}.gguf", fields, tensors)


# ---- causes 1, 2, 3 and the weak messages of one key ----------------------------------------------------------
YARN = {"llama__rope__scaling__type": (STRING, "yarn", None), "llama__rope__scaling__factor": (6, 4.0, None)}
ONE_KEY = {  # case: (changes, the line's words)
    "architecture an array": ({"general__architecture": (ARRAY, ["llama", "x"], STRING)},
                              "general.architecture is an array of 2 strings, expected a string"),
    "pre an array": ({"tokenizer__ggml__pre": (ARRAY, ["gpt-2"], STRING)},
                     "tokenizer.ggml.pre is an array of 1 string, expected a string"),
    "yarn original inf": ({**YARN, "llama__rope__scaling__original_context_length": (6, math.inf, None)},
                          "llama.rope.scaling.original_context_length is inf, expected an integer"),
    "yarn original nan": ({**YARN, "llama__rope__scaling__original_context_length": (12, math.nan, None)},
                          "llama.rope.scaling.original_context_length is nan, expected an integer"),
    "yarn original a string": ({**YARN, "llama__rope__scaling__original_context_length": (STRING, "8192", None)},
                               "original_context_length is the string '8192', expected an integer"),
    "yarn original an array": ({**YARN, "llama__rope__scaling__original_context_length": (ARRAY, [1, 2], 5)},
                               "original_context_length is an array of 2 integers, expected an integer"),
    "yarn factor a string": ({**YARN, "llama__rope__scaling__factor": (STRING, "4", None)},
                             "llama.rope.scaling.factor is the string '4', expected a finite number"),
    "alignment a string": ({"general__alignment": (STRING, "32", None)},
                           "general.alignment is the string '32', expected an integer"),
    "bos id a string": ({"tokenizer__ggml__bos_token_id": (STRING, "0", None)},
                        "tokenizer.ggml.bos_token_id is the string '0', expected an integer"),
    "value_length unlike key_length": ({"llama__attention__value_length": (4, 8, None)},
                                       "llama.attention.value_length is 8 but llama.attention.key_length is 16"),
    "rope dimensions past the head": ({"llama__rope__dimension_count": (4, 64, None)},
                                      "llama.rope.dimension_count is 64, expected from 1 to the head size 16"),
    "merges naming no token": ({"tokenizer__ggml__merges": (ARRAY, ["h e", "zz yy"], STRING)},
                               "tokenizer.ggml.merges[1] ('zz yy') names 'zz', which is no token"),
    "token type an array of strings": ({"tokenizer__ggml__token_type": (ARRAY, ["1"] * 310, STRING)},
                                       "tokenizer.ggml.token_type[0] is the string '1', expected an array of "
                                       "integers"),
    "chat template a number": ({"tokenizer__chat_template": (4, 7, None)},
                               "tokenizer.chat_template is the integer 7, expected a string"),
}


@pytest.mark.parametrize("case", sorted(ONE_KEY))
def test_a_value_of_the_wrong_kind_is_one_line_naming_file_and_key(tmp_path, bpe, case):
    changes, words = ONE_KEY[case]
    if case == "value_length unlike key_length":  # the file states its key_length too
        changes = {**changes, "llama__attention__key_length": (4, 16, None)}
    path = hostile(tmp_path, bpe, case.replace(" ", "-"), **changes)
    for command in ("inspect", "convert"):
        args = ["--format", "hf", "--out", tmp_path / "hf"] if command == "convert" else []
        line = cli_error_line(command, path, *args)
        assert str(path) in line and words in line, line
    assert not (tmp_path / "hf").exists()


# ---- cause 4: a SentencePiece vocabulary whose merges grow as L^3 ---------------------------------------------
def test_a_vocabulary_of_a_aa_aaa_is_not_derived(tmp_path, monkeypatch):
    """"a" * 1 ... "a" * 1500 (the campaign's 1.6 MB file: 29 s, 5 GB, a 1.1 GB cache entry): the derivation's work
    (the characters its cuts would slice, ~L^3 / 3 here) is counted from the tokens' lengths and refused before one
    cut is made; the reader's note names the key, and generate refuses in one line rather than read bytes."""
    tokens = ["a" * n for n in range(1, 1501)]
    assert gguf_sentencepiece.merge_work(tokens) > gguf_sentencepiece.MAX_MERGE_WORK  # ~1.1e9: no real vocabulary
    path = spm(tmp_path, tokens)

    def never(*args):
        raise AssertionError("implied_merges ran")
    monkeypatch.setattr(gguf_sentencepiece, "implied_merges", never)
    with open_checkpoint(path) as reader:
        assert reader.tokenizer_files() == []
        note = reader.metadata["notes"]
    assert "tokenizer.ggml.tokens" in note and "1,500 characters" in note and "more than" in note, note
    line = cli_error_line("generate", path, "--prompt", "a", "--max-new-tokens", 1)
    assert str(path) in line and "tokenizer.ggml.tokens" in line and "--tokenizer" in line, line


def test_the_derivation_bounds_leave_room_for_real_vocabularies():
    """Gemma 3's 262,144 tokens take 10.8 M characters of cuts and imply 514,906 merges (measured on the real file,
    which tests/compat/test_real_gemma.py rebuilds): a vocabulary twice as large, of the same shape, stays within
    both bounds; the largest the bounds allow writes a tokenizer.json every command still reads (under 64 MiB)."""
    assert 2 * 10_835_666 < gguf_sentencepiece.MAX_MERGE_WORK and 2 * 514_906 < gguf_sentencepiece.MAX_IMPLIED_MERGES
    tokens = ["a" * n for n in range(1, 2000)]
    at_bound = next(k for k in range(1, 2000) if gguf_sentencepiece.merge_work(tokens[:k + 1]) > gguf_sentencepiece.
                    MAX_MERGE_WORK)
    merges = gguf_sentencepiece.implied_merges({t: 0 for t in tokens[:at_bound]}, {t: 0.0 for t in tokens[:at_bound]})
    assert sum(len(a) + len(b) + 7 for a, b in merges) < 64 << 20


def test_a_vocabulary_implying_too_many_merges(monkeypatch):
    """Every string over {a, b} up to 16 characters (131,070 tokens) passes the work bound (27.8 M) but implies
    1.8 M merges; the derivation stops at MAX_IMPLIED_MERGES (lowered here to 1,000: the same path, cheaper)."""
    monkeypatch.setattr(gguf_sentencepiece, "MAX_IMPLIED_MERGES", 1000)
    tokens = [format(i, "b")[1:].replace("0", "a").replace("1", "b") for i in range(2, 2 ** 9)]  # up to 8 characters
    fields = {"general.architecture": "llama", "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
              "tokenizer.ggml.scores": [0.0] * len(tokens)}
    note = gguf_tokenizer.tokenizer_texts(fields, "m.gguf", None)
    assert isinstance(note, str) and "imply more than 1,000 merges" in note, note


# ---- cause 5: many scores -----------------------------------------------------------------------------------
def test_scores_far_longer_than_the_vocabulary(tmp_path, monkeypatch):
    """The campaign's 60 M floats (240 MB) were a MemoryError at 6.1 GB (a list of Python floats, then repr() of it
    for the cache key); 4 M floats show the same path: one numpy array, hashed as bytes, refused by length."""
    tokens, _, _ = vocabulary()
    path = spm(tmp_path, tokens, scores=np.zeros(4_000_000, dtype=np.float32))
    scores = parse_gguf(path).fields["tokenizer.ggml.scores"]
    assert isinstance(scores, np.ndarray) and scores.nbytes == 16_000_000
    line = cli_error_line("inspect", path)
    assert str(path) in line and "tokenizer.ggml.scores has 4,000,000 items, expected 325 (one score per token)" \
        in line, line


def test_the_cache_key_hashes_bytes():
    """The key changes with any one value's bytes and never goes through repr(): 4 M floats, one changed."""
    scores = np.zeros(4_000_000, dtype=np.float32)
    fields = {"general.architecture": "llama", "tokenizer.ggml.scores": scores, "tokenizer.ggml.tokens": ["a", "b"]}
    key = gguf_tokenizer._input_key(fields, None)
    changed = scores.copy()
    changed[-1] = 1.0
    assert gguf_tokenizer._input_key({**fields, "tokenizer.ggml.scores": changed}, None) != key
    assert gguf_tokenizer._input_key({**fields, "tokenizer.ggml.tokens": ["ab", ""]}, None) != key  # lengths count
    assert gguf_tokenizer._input_key({**fields, "tokenizer.ggml.scores": scores.astype(np.float64)}, None) != key


# ---- causes 6 and 7: links out of the folder ----------------------------------------------------------------
def _split(tmp_path: Path, bpe) -> list[Path]:
    fields, tensors = bpe
    folder = tmp_path / "split"
    folder.mkdir()
    w = gguf.GGUFWriter(str(folder / "m.gguf"), "llama", split_max_tensors=5)
    for key, (vtype, value, itype) in fields.items():
        if key != "general.architecture":
            w.add_key_value(key, value, gguf.GGUFValueType(vtype), sub_type=itype and gguf.GGUFValueType(itype))
    for name, array, qtype in tensors:
        w.add_tensor(name, array, raw_dtype=gguf.GGMLQuantizationType(qtype))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return sorted(folder.glob("*.gguf"))


@pytest.mark.parametrize("which", [0, 1])
def test_a_split_part_linking_outside_the_folder(tmp_path, bpe, which):
    parts = _split(tmp_path, bpe)
    assert len(parts) == 3
    outside = tmp_path / "elsewhere" / parts[which].name
    outside.parent.mkdir()
    parts[which].rename(outside)
    parts[which].symlink_to(outside)
    for spec in (parts[0], parts[0].parent):
        line = cli_error_line("inspect", spec)
        assert f"{parts[which]}: a GGUF file of the model is a symbolic link to {outside}, outside the model folder" \
            in line, line
    inside = parts[0].parent / "kept.bin"  # a link within the folder is followed
    outside.rename(inside)
    parts[which].unlink()
    parts[which].symlink_to(inside.name)
    with open_checkpoint(parts[0]) as reader:
        assert reader.get("layers.0.attn.q.weight").shape == (64, 64)


def test_a_folders_gguf_linking_outside_it(tmp_path, bpe):
    real = raw_gguf(tmp_path / "real.gguf", *bpe)
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model.gguf").symlink_to(real)
    line = cli_error_line("convert", folder, "--format", "hf", "--out", tmp_path / "hf")
    assert f"{folder / 'model.gguf'}: a GGUF file of the model is a symbolic link to {real}" in line, line
    assert not (tmp_path / "hf").exists()
    run_cli("count-params", folder / "model.gguf")  # the link named itself: the user's file, links and all


def test_a_part_swapped_after_opening_is_refused(tmp_path, bpe):
    """The bytes read are those of the file parsed: a part replaced since opening fails before a tensor is read."""
    parts = _split(tmp_path, bpe)
    with open_checkpoint(parts[0]) as reader:
        name = next(n for n in reader.names() if reader.file_of(n) == parts[1])
        data = parts[1].read_bytes()
        parts[1].unlink()
        parts[1].write_bytes(data)
        with pytest.raises(UserError, match="(replaced|modified) while it was being read"):  # inode reused: modified
            reader.get(name)


# ---- the tokenizer: never bytes in place of the file's own, and what tokenizers cannot load --------------------
def test_an_unknown_pre_tokenizer_is_never_read_as_bytes(tmp_path, bpe):
    """A 310-token vocabulary is small enough for the byte tokenizer, which generate used and export-gguf wrote in
    its place ("byte tokenizer (300 tokens)"); now its commands ask for --tokenizer, naming the file and the key, and a
    canonical conversion keeps the fact."""
    path = hostile(tmp_path, bpe, "weird", tokenizer__ggml__pre=(STRING, "weird", None))
    for args in (["generate", path, "--prompt", "a", "--max-new-tokens", 1],
                 ["export-gguf", path, "--out", tmp_path / "o.gguf"]):
        line = cli_error_line(*args)
        assert str(path) in line and "'weird' (tokenizer.ggml.pre)" in line, line
    assert "--tokenizer" in cli_error_line("generate", path, "--prompt", "a")
    assert not (tmp_path / "o.gguf").exists()
    result = run_cli("convert", path, "--format", "hf", "--out", tmp_path / "hf")  # without one, saying so
    assert "warning: " in result.stderr and "could not be rebuilt, so the output carries none" in result.stderr
    assert not (tmp_path / "hf" / "tokenizer.json").exists()
    run_cli("convert", path, "--format", "canonical", "--out", tmp_path / "c.safetensors")
    line = cli_error_line("generate", tmp_path / "c.safetensors", "--prompt", "a")
    assert "tokenizer.ggml.pre" in line, line
    result = run_cli("generate", path, "--prompt", "a", "--max-new-tokens", 1, "--tokenizer", "bytes")
    assert "new tokens" in result.output


def test_a_rebuilt_tokenizer_that_does_not_load_names_the_gguf(tmp_path, bpe, monkeypatch):
    """Were a rebuilt tokenizer.json ever one `tokenizers` refuses (here the merges' check taken away), generate names
    the GGUF, not the cache entry it never wrote."""
    path = hostile(tmp_path, bpe, "unloadable", tokenizer__ggml__merges=(ARRAY, ["zz yy"], STRING))
    monkeypatch.setattr(gguf_tokenizer, "_merge_pairs", lambda fields, vocab, where: [["zz", "yy"]])
    line = cli_error_line("generate", path, "--prompt", "a", "--max-new-tokens", 1)
    assert line.startswith(f"bam-surgery: error: {path}: the tokenizer rebuilt from its tokenizer.ggml.* metadata "
                           "does not load"), line


@pytest.mark.parametrize("case", ["duplicate", "empty", "nul", "16 MB"])
def test_odd_tokens_read_correctly(tmp_path, bpe, case):
    """Tokens the rebuilt tokenizer.json holds as they are (duplicates keep their first id): tokenizers loads it
    and encodes; a token emptied or duplicated that a merge needs is the merges' one line (ONE_KEY above)."""
    tokenizers = pytest.importorskip("tokenizers")
    fields, _ = bpe
    tokens = list(fields["tokenizer.ggml.tokens"][1])
    i = 300  # a token no merge names
    tokens[i] = {"duplicate": tokens[i - 1], "empty": "", "nul": "a\0b", "16 MB": "x" * ((1 << 24) - 1)}[case]
    path = hostile(tmp_path, bpe, case.replace(" ", ""), tokenizer__ggml__tokens=(ARRAY, tokens, STRING))
    with open_checkpoint(path) as reader:
        files = {f.name: f for f in reader.tokenizer_files()}
    tok = tokenizers.Tokenizer.from_file(str(files["tokenizer.json"]))
    assert tok.encode("hello world").ids


# ---- the parser's bounds -------------------------------------------------------------------------------------
def test_more_pairs_or_tensors_than_the_bound(tmp_path):
    head = b"GGUF" + struct.pack("<IQQ", 3, 0, gguf_file.MAX_FIELDS + 1)
    path = tmp_path / "pairs.gguf"
    path.write_bytes(head + b"\0" * (14 * (gguf_file.MAX_FIELDS + 1)))
    line = cli_error_line("inspect", path)
    assert f"{gguf_file.MAX_FIELDS + 1:,} key-value pairs" in line and "at most 65,536" in line, line
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, gguf_file.MAX_TENSORS + 1, 0) + b"\0" * (2 << 20))
    assert f"{gguf_file.MAX_TENSORS + 1:,} tensors" in cli_error_line("inspect", path)


def test_more_array_strings_than_the_bound(tmp_path):
    """Strings are decoded one Python object each: 256 MB of two-byte strings took 2.4 GB and 53 s; the file's
    arrays together may hold MAX_ARRAY_STRINGS, refused at the array that declares more, before decoding it."""
    n = gguf_file.MAX_ARRAY_STRINGS + 1
    items = np.zeros(n, dtype=[("len", "<u8"), ("s", "S1")])
    items["len"], items["s"] = 1, b"a"
    path = tmp_path / "strings.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + _string("x.a") + struct.pack("<IIQ", ARRAY, STRING, n)
                     + items.tobytes())
    line = cli_error_line("inspect", path)
    assert "key x.a declares 2,097,153 strings" in line and "2,097,152 strings in all" in line, line


# ---- fuzzing: every key the reader reads, with a value of any type and size -----------------------------------
READ_KEYS = ["general.architecture", "general.alignment", "split.count", "split.no", "llama.context_length",
             "llama.embedding_length", "llama.block_count", "llama.feed_forward_length", "llama.attention.head_count",
             "llama.attention.head_count_kv", "llama.attention.key_length", "llama.rope.dimension_count",
             "llama.rope.freq_base", "llama.attention.layer_norm_rms_epsilon", "llama.rope.scaling.type",
             "llama.rope.scaling.factor", "llama.rope.scaling.attn_factor",
             "llama.rope.scaling.original_context_length", "llama.rope.scale_linear", "llama.expert_count",
             "bam_surgery.config", "bam_surgery.provenance", "tokenizer.ggml.model", "tokenizer.ggml.pre",
             "tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.scores",
             "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.padding_token_id",
             "tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token", "tokenizer.chat_template"]
_INTS = {0: (0, 255), 1: (-128, 127), 2: (0, 65535), 3: (-32768, 32767), 4: (0, 2**32 - 1), 5: (-2**31, 2**31 - 1),
         10: (0, 2**64 - 1), 11: (-2**63, 2**63 - 1)}


def _scalars(vtype: int):
    if vtype in _INTS:
        low, high = _INTS[vtype]
        edges = [v for v in (low, high, 0, 1, 32, 310) if low <= v <= high]
        return st.one_of(st.integers(low, high), st.sampled_from(edges))
    if vtype in (6, 12):
        return st.floats(width=32 if vtype == 6 else 64)  # nan, inf, subnormals
    if vtype == 7:
        return st.booleans()
    return st.one_of(st.text(max_size=8), st.sampled_from(["llama", "gpt2", "yarn", "gpt-2", "{}", "32", "h e"]))


SCALAR_TYPES = [0, 1, 2, 3, 4, 5, 6, 7, 10, 11, 12, STRING]
values = st.one_of(
    st.sampled_from(SCALAR_TYPES).flatmap(lambda t: _scalars(t).map(lambda v: (t, v, None))),
    st.sampled_from(SCALAR_TYPES).flatmap(lambda t: st.one_of(
        st.lists(_scalars(t), max_size=6), st.integers(305, 312).map(lambda n: [0 if t != STRING else "a"] * n))
        .map(lambda v: (ARRAY, v, t))),
)


@settings(max_examples=120, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.dictionaries(st.sampled_from(READ_KEYS), values, min_size=1, max_size=3))
def test_metadata_of_any_type_and_size(tmp_path_factory, bpe, changes):
    """Any read key with a value of any GGUF type (scalar or array, near the vocabulary's size too): the reader opens
    the file and rebuilds what it can, or refuses it in one line."""
    fields, tensors = bpe
    fields = {**fields, **changes}
    path = raw_gguf(tmp_path_factory.mktemp("fuzz") / "f.gguf", fields, tensors)
    try:
        with open_checkpoint(path) as reader:
            reader.get("embed.weight")
            for f in reader.tokenizer_files():
                if f.name == "tokenizer.json":
                    assert json.loads(f.read_text())["model"]["type"] == "BPE"
    except UserError as e:
        line = one_line(e)
        assert line.startswith(str(path)) and "\n" not in line, line
