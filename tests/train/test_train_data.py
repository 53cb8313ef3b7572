"""Training data: the domain SPEC, every source kind, tokenizers and the token cache, packing and
domain sampling (bam_surgery.train.data / tokenize / packing)."""
from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import numpy as np
import pytest

from bam_surgery.runtime.reader import StateReader
from bam_surgery.train.data import DOC_SEPARATOR, Domain, has_split, open_source, parse_data_spec, split_documents
from bam_surgery.train.errors import TrainError
from bam_surgery.train.packing import MixtureSampler, eval_windows, micro_batches
from bam_surgery.train.tokenize import ByteTokenizer, HFTokenizer, resolve_tokenizer, tokenize_source

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "data" / "domains"


# ---- SPEC -----------------------------------------------------------------------------------------
def test_spec_names_weights_and_defaults():
    doms = parse_data_spec("code=data/code:0.25,law=data/law:0.75,data/math.txt.gz")
    assert [(d.name, d.source) for d in doms] == [("code", "data/code"), ("law", "data/law"),
                                                 ("math", "data/math.txt.gz")]
    assert [round(d.weight, 6) for d in doms] == [0.25 / 2, 0.75 / 2, 1 / 2]
    assert [d.weight for d in parse_data_spec("a=x,b=y")] == [0.5, 0.5]
    hub = parse_data_spec("wiki=hf:org/wiki#en:2,hf:plain:1")
    assert [(d.name, d.source) for d in hub] == [("wiki", "hf:org/wiki#en"), ("plain", "hf:plain")]


@pytest.mark.parametrize("spec, message", [
    ("code=data/code:-0.5", "weight -0.5 must be a finite number >= 0"),
    ("code=data/code:abc", "weight 'abc' is not a number"),
    ("code=data/code:nan", "must be a finite number"),
    ("", "empty"),
    ("a=x,,b=y", "empty entry"),
    ("a=x,a=y", "domain 'a' appears twice"),
    ("a=x:0,b=y:0", "every domain weight is 0"),
    ("a=", "names no source"),
])
def test_spec_errors(spec, message):
    with pytest.raises(TrainError, match=message):
        parse_data_spec(spec)


# ---- sources --------------------------------------------------------------------------------------
def _docs(domain: Domain, split: str = "train", field: str = "text") -> list[str]:
    return list(open_source(domain, split, field).documents())


def test_text_files_split_on_the_separator(tmp_path):
    body = DOC_SEPARATOR.join(["first doc\nline 2", "  ", "second"])
    (tmp_path / "a.txt").write_text(body)
    with gzip.open(tmp_path / "b.txt.gz", "wt") as f:
        f.write(body)
    for name in ("a.txt", "b.txt.gz"):
        assert _docs(Domain("d", str(tmp_path / name), 1.0)) == ["first doc\nline 2", "second"]
    # a separator cut across read chunks is still found
    assert list(split_documents(["x\n\n<|d", "oc|>\ny", DOC_SEPARATOR, "z"])) == ["x", "y", "z"]


def test_jsonl_and_parquet_with_text_field(tmp_path):
    rows = [{"body": "alpha"}, {"body": "beta"}, {"body": ""}]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert _docs(Domain("d", str(tmp_path / "d.jsonl"), 1.0), field="body") == ["alpha", "beta"]
    with pytest.raises(TrainError, match=r"d.jsonl:1: no field 'text' \(set --text-field\)"):
        _docs(Domain("d", str(tmp_path / "d.jsonl"), 1.0))
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["gamma", "delta"]}), tmp_path / "d.parquet")
    assert _docs(Domain("d", str(tmp_path / "d.parquet"), 1.0), field="body") == ["gamma", "delta"]
    with pytest.raises(TrainError, match=r"no column 'text' \(columns: body"):
        _docs(Domain("d", str(tmp_path / "d.parquet"), 1.0))


def test_saved_datasets_and_their_splits(tmp_path):
    import datasets

    datasets.Dataset.from_dict({"text": ["one", "two"]}).save_to_disk(str(tmp_path / "flat"))
    assert _docs(Domain("d", str(tmp_path / "flat"), 1.0)) == ["one", "two"]
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["tr"]}),
                          "validation": datasets.Dataset.from_dict({"text": ["va"]})}
                         ).save_to_disk(str(tmp_path / "dict"))
    dom = Domain("d", str(tmp_path / "dict"), 1.0)
    assert (_docs(dom, "train"), _docs(dom, "val")) == (["tr"], ["va"])
    assert has_split(dom, "val")
    src = open_source(dom, "train")
    assert src.fingerprint() == open_source(dom, "train").fingerprint() != open_source(dom, "val").fingerprint()


@pytest.mark.slow
def test_hub_dataset_offline_without_cache_is_one_clear_error(tmp_path):
    """In a fresh process (datasets reads HF_HUB_OFFLINE at import): no network, one error line."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    env.pop("HF_DATASETS_OFFLINE", None)
    code = ("from bam_surgery.train.data import Domain, open_source\n"
            "open_source(Domain('wiki', 'hf:nobody/nothing', 1.0), 'train')")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert "TrainError: wiki=hf:nobody/nothing: cannot load the hub dataset" in proc.stderr


def test_repository_corpus_folders_have_train_and_val_splits():
    dom = Domain("law", str(CORPUS / "law"), 1.0)
    assert [p.name for p in open_source(dom, "train").files] == ["train.txt.gz"]
    assert [p.name for p in open_source(dom, "val").files] == ["val.txt.gz"]
    assert has_split(dom, "val")


def test_source_errors(tmp_path):
    with pytest.raises(TrainError, match=r"^d=.*nope: no such file or folder"):
        open_source(Domain("d", str(tmp_path / "nope"), 1.0), "train")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TrainError, match="folder holds no data files"):
        open_source(Domain("d", str(tmp_path / "empty"), 1.0), "train")
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(TrainError, match="unsupported file type"):
        open_source(Domain("d", str(tmp_path / "x.csv"), 1.0), "train")
    (tmp_path / "split").mkdir()
    (tmp_path / "split" / "train.txt").write_text("t")
    with pytest.raises(TrainError, match=r"train\* files but no held-out val\* file"):
        open_source(Domain("d", str(tmp_path / "split"), 1.0), "val")


# ---- tokenizers and the cache ---------------------------------------------------------------------
def _word_tokenizer(path: Path, words: list[str]) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["<unk>", "</s>", *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return path / "tokenizer.json"


def test_byte_tokenizer_and_cache(tmp_path):
    (tmp_path / "d.txt").write_text(DOC_SEPARATOR.join(["ab", "é\x00c"]))
    src = open_source(Domain("d", str(tmp_path / "d.txt"), 1.0), "train")
    tf = tokenize_source(src, ByteTokenizer(), tmp_path / "cache")
    assert tf.tokens.tolist() == [97, 98, 0, 0xC3, 0xA9, 99, 0]  # NUL dropped, EOS 0 after each document
    assert isinstance(tf.tokens, np.memmap) and tf.documents == 2
    entry = tmp_path / "cache" / tf.key / "tokens.bin"
    assert tf.path == entry
    stamp = entry.stat().st_mtime_ns
    assert tokenize_source(src, ByteTokenizer(), tmp_path / "cache").tokens.tolist() == tf.tokens.tolist()
    assert entry.stat().st_mtime_ns == stamp  # read from the cache, not written again
    (tmp_path / "d.txt").write_text("changed")
    assert tokenize_source(open_source(Domain("d", str(tmp_path / "d.txt"), 1.0), "train"), ByteTokenizer(),
                           tmp_path / "cache").key != tf.key


def test_hf_tokenizer_eos_and_vocabulary_checks(tmp_path):
    path = _word_tokenizer(tmp_path / "tok", ["hello", "world"])
    tok = resolve_tokenizer(str(path.parent), None, vocab_size=8)
    assert isinstance(tok, HFTokenizer) and (tok.vocab_size, tok.eos_id) == (4, 1)
    (tmp_path / "d.txt").write_text(DOC_SEPARATOR.join(["hello world", "world"]))
    tf = tokenize_source(open_source(Domain("d", str(tmp_path / "d.txt"), 1.0), "train"), tok, tmp_path / "c")
    assert tf.tokens.tolist() == [2, 3, 1, 3, 1]
    with pytest.raises(TrainError, match=r"has 4 tokens but the model's vocabulary has 3 \(vocab_size\)"):
        resolve_tokenizer(str(path), None, vocab_size=3)
    with pytest.raises(TrainError, match=r"tokenizer bytes has 256 tokens but the model's vocabulary has 64"):
        resolve_tokenizer("bytes", None, vocab_size=64)


@pytest.mark.parametrize("specials, declared, fallback, expected, reason", [
    # an instruct model declares its chat end-of-turn; documents get the end-of-text token its pretraining used
    (["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "<|im_end|>", None, "<|endoftext|>",
     "<|endoftext|> (id 1): the vocabulary's end-of-text token, not tokenizer_config.json's eos_token <|im_end|> "
     "(id 3), a chat end-of-turn"),
    (["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"], "<|eot_id|>", None, "<|end_of_text|>", "(id 2)"),
    (["<bos>", "<eos>", "<end_of_turn>"], "<end_of_turn>", None, "<eos>", "not tokenizer_config.json's eos_token"),
    # a base model: its declared eos is the end-of-text token
    (["<|endoftext|>", "</s>"], "</s>", None, "</s>", "</s> (id 2): tokenizer_config.json's eos_token, an end-of-text"),
    # no end-of-text token in the vocabulary: the declared eos, whatever it is
    (["<|im_start|>", "<|im_end|>"], "<|im_end|>", None, "<|im_end|>", "(the vocabulary has no end-of-text token)"),
    # no tokenizer_config.json eos_token: the model config's eos_token_id, by the same rule
    (["<|endoftext|>", "<|im_end|>"], None, 2, "<|endoftext|>", "not the model config's eos_token_id <|im_end|>"),
])
def test_document_separator_rule(tmp_path, specials, declared, fallback, expected, reason):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["<unk>", *specials, "hello"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(specials)
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": declared} if declared else {}))
    chosen = HFTokenizer(tmp_path / "tokenizer.json", fallback_eos=fallback)
    assert chosen.eos_id == vocab[expected] and reason in chosen.eos_reason, chosen.eos_reason
    forced = HFTokenizer(tmp_path / "tokenizer.json", eos_id=vocab["hello"])
    assert (forced.eos_id, forced.eos_reason) == (vocab["hello"], f"--eos-id {vocab['hello']}")
    assert forced.fingerprint != chosen.fingerprint  # the token cache keys on the separator


def test_tokenizer_defaults(tmp_path):
    assert isinstance(resolve_tokenizer(None, None, vocab_size=256), ByteTokenizer)
    with pytest.raises(TrainError, match="no tokenizer found for a model with vocab_size 32000"):
        resolve_tokenizer(None, None, vocab_size=32000)

    class Reader(StateReader):  # an HF folder carrying its tokenizer
        path = tmp_path / "hf"
        def tokenizer_files(self):
            return [_word_tokenizer(tmp_path / "hf", ["a"])]

    assert isinstance(resolve_tokenizer(None, Reader({}, None), vocab_size=32000), HFTokenizer)


def test_a_tokenizer_file_linking_outside_its_folder_is_refused(tmp_path):
    """Issue 20, item 4: what a run checkpoint would carry comes from inside the model folder only."""
    from bam_surgery.runtime.errors import CheckpointError
    from bam_surgery.train.tokenize import checkpoint_tokenizer

    elsewhere = _word_tokenizer(tmp_path / "elsewhere", ["a"])

    class Canonical(StateReader):  # a canonical folder: its tokenizer.json is found by name
        path = tmp_path / "canonical"

        def __init__(self):
            super().__init__({}, None)

    Canonical.path.mkdir()
    (Canonical.path / "tokenizer.json").symlink_to(elsewhere)
    with pytest.raises(CheckpointError, match=r"tokenizer.json is a symbolic link to .*elsewhere/tokenizer.json, "
                                              r"outside the model folder"):
        checkpoint_tokenizer(Canonical())
    (Canonical.path / "tokenizer.json").unlink()
    (Canonical.path / "inside").mkdir()
    (Canonical.path / "tokenizer.json").symlink_to(Path("inside") / "tokenizer.json")
    _word_tokenizer(Canonical.path / "inside", ["a"])
    assert checkpoint_tokenizer(Canonical()) == str(Canonical.path / "tokenizer.json")
    assert resolve_tokenizer(None, Canonical(), vocab_size=32000).files == (Canonical.path / "tokenizer.json",)
    (Canonical.path / "tokenizer_config.json").symlink_to(elsewhere.parent / "tokenizer_config.json")
    with pytest.raises(CheckpointError, match=r"tokenizer_config.json is a symbolic link to .*outside"):
        resolve_tokenizer(None, Canonical(), vocab_size=32000)


def test_empty_data_is_an_error(tmp_path):
    (tmp_path / "d.txt").write_text(DOC_SEPARATOR.join(["  ", "\n"]))
    with pytest.raises(TrainError, match=r"^d=.*d.txt \(train split\): no text"):
        tokenize_source(open_source(Domain("d", str(tmp_path / "d.txt"), 1.0), "train"), ByteTokenizer(), tmp_path)


# ---- packing and sampling ---------------------------------------------------------------------------
def _streams():
    return [np.arange(1000, dtype=np.uint16), np.arange(5000, 5700, dtype=np.uint16)]


def test_sampler_is_reproducible_and_resumable():
    a = MixtureSampler(_streams(), [0.7, 0.3], seq_len=10, seed=3)
    b = MixtureSampler(_streams(), [0.7, 0.3], seq_len=10, seed=3)
    first = a.draw(50)
    assert first == b.draw(50)
    state = a.state()
    rest = a.draw(300)  # runs past one epoch of the second domain (69 chunks)
    c = MixtureSampler(_streams(), [0.7, 0.3], seq_len=10, seed=3)
    c.load_state(state)
    assert c.draw(300) == rest
    assert MixtureSampler(_streams(), [0.7, 0.3], seq_len=10, seed=4).draw(50) != first
    share = sum(d == 0 for d, _ in first + rest) / 350
    assert 0.6 < share < 0.8
    batch = a.batch([(0, 3), (1, 0)])
    assert batch.inputs[0].tolist() == list(range(30, 40)) and batch.targets[0].tolist() == list(range(31, 41))
    assert batch.inputs[1, 0] == 5000


def test_every_chunk_once_per_epoch():
    s = MixtureSampler(_streams(), [1.0, 0.0], seq_len=10, seed=0)
    chunks = [c for _, c in s.draw(99)]
    assert sorted(chunks) == list(range(99))


def test_micro_batches_match_between_accumulation_and_processes():
    samples = [(0, i) for i in range(8)]
    one = micro_batches(samples, micro_batch=2, world=1, rank=0)
    two = [micro_batches(samples, 2, world=2, rank=r) for r in range(2)]
    assert one == [samples[0:2], samples[2:4], samples[4:6], samples[6:8]]
    assert two[0] == [samples[0:2], samples[4:6]] and two[1] == [samples[2:4], samples[6:8]]


def test_eval_windows_predict_every_token_once():
    for n, T in ((10, 4), (9, 4), (5, 4), (2, 4)):
        wins = eval_windows(np.arange(n), T)
        predicted = [p for s, e in wins for p in range(s + 1, e)]
        assert predicted == list(range(1, n)) and all(e - s <= T + 1 for s, e in wins)
    assert eval_windows(np.arange(100), 4, max_tokens=8) == [(0, 5), (4, 9)]


# ---- decompression bombs (issue 20, item 6) ---------------------------------------------------------
def _gzip_of(path: Path, piece: bytes, times: int) -> Path:
    with gzip.open(path, "wb", compresslevel=1) as f:
        for _ in range(times):
            f.write(piece)
    return path


@pytest.mark.parametrize("name", ["bomb.txt.gz", "bomb.jsonl.gz"])
def test_a_document_past_the_bound_is_refused_once_that_much_is_read(tmp_path, name):
    """20 MiB with no separator (a line of JSONL without its end), from a 20 KB .gz: refused after reading
    MAX_DOCUMENT_CHARS of it, the bound in the line; before, the whole text was held and tokenized."""
    from bam_surgery.train.data import MAX_DOCUMENT_CHARS

    path = _gzip_of(tmp_path / name, b'{"text": "' if name.endswith("jsonl.gz") else b"", 1)
    with gzip.open(path, "ab", compresslevel=1) as f:
        for _ in range(20):
            f.write(b"a" * (1 << 20))
    assert path.stat().st_size < 200_000
    with pytest.raises(TrainError, match=rf"{name}.*more than {MAX_DOCUMENT_CHARS:,} characters"):
        for _ in open_source(Domain("d", str(path), 1.0), "train").documents():
            pass


@pytest.mark.parametrize("line,needle", [
    ('{"text": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply"),
    ('{"text": "a", "n": ' + "9" * 5000 + "}", "too many digits"),
    ('{"text": "\\ud800 lone"}', "lone UTF-16 surrogate"),
])
def test_hostile_jsonl_lines_are_one_line_naming_the_line(tmp_path, line, needle):
    """Issue 33: JSONL lines nested 100k deep, 5000-digit integers, surrogates (tracebacks, or a
    UnicodeEncodeError when tokenized)."""
    (tmp_path / "d.jsonl").write_text('{"text": "fine"}\n' + line + "\n")
    with pytest.raises(TrainError, match=f"d.jsonl:2: .*{needle}"):
        _docs(Domain("d", str(tmp_path / "d.jsonl"), 1.0))


def test_a_parquet_document_past_the_limit_is_refused_before_it_is_a_string(tmp_path, monkeypatch):
    """Issue 33: a 21 KB Parquet file (one long value, repeated) reached 5.2 GB as Python lists."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    import bam_surgery.train.data as data

    monkeypatch.setattr(data, "MAX_DOCUMENT_CHARS", 1000)
    pq.write_table(pa.table({"text": ["x" * 5000] * 2000}), tmp_path / "bomb.parquet", compression="zstd")
    assert (tmp_path / "bomb.parquet").stat().st_size < 50_000
    with pytest.raises(TrainError, match="bomb.parquet: a document of more than 1,000 characters"):
        _docs(Domain("d", str(tmp_path / "bomb.parquet"), 1.0))


# ---- a beginning-of-sequence token first in every window -------------------------------------------------
def _bos_tokenizer(path: Path, template: str | None) -> Path:
    """_word_tokenizer's words with <bos> (id 4) and a post-processor `template` ('<bos> $A', '$A </s>', None)."""
    from tokenizers import Tokenizer, processors

    _word_tokenizer(path, ["hello", "world", "<bos>"])
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_special_tokens(["<bos>"])
    if template is not None:
        tok.post_processor = processors.TemplateProcessing(single=template,
                                                           special_tokens=[("<bos>", 4), ("</s>", 1)])
    tok.save(str(path / "tokenizer.json"))
    return path / "tokenizer.json"


@pytest.mark.parametrize("template, bos", [("<bos> $A", 4), ("$A </s>", None), ("<bos> $A </s>", 4), (None, None)])
def test_the_tokenizers_own_bos_is_found(tmp_path, template, bos):
    tok = resolve_tokenizer(str(_bos_tokenizer(tmp_path / "tok", template)), None, vocab_size=8)
    assert tok.bos_id == bos
    assert ByteTokenizer().bos_id is None


def test_training_and_eval_windows_start_with_the_bos():
    """The first input of every window is the BOS (the targets, and every other input, unchanged)."""
    import torch

    from bam_surgery.train.evaluation import evaluate_streams
    from bam_surgery.train.packing import window_inputs

    plain = MixtureSampler(_streams(), [0.5, 0.5], seq_len=10, seed=0).batch([(0, 3), (1, 0)])
    with_bos = MixtureSampler(_streams(), [0.5, 0.5], seq_len=10, seed=0, bos_id=7).batch([(0, 3), (1, 0)])
    assert with_bos.inputs[:, 0].tolist() == [7, 7]
    assert torch.equal(with_bos.inputs[:, 1:], plain.inputs[:, 1:]) and torch.equal(with_bos.targets, plain.targets)
    seq = torch.arange(12).view(1, 12)
    assert window_inputs(seq, None).tolist() == [list(range(11))] and window_inputs(seq, 5)[0, 0] == 5
    assert seq[0, 0] == 0  # not changed in place

    class Recorder(torch.nn.Module):  # a "model" that records its inputs and predicts uniformly
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(()))
            self.seen = []

        def forward(self, x, targets, routing=None, return_logits=True):
            from types import SimpleNamespace
            self.seen.append(x.clone())
            return SimpleNamespace(nll=self.w + math.log(16), routing={})  # uniform over 16 tokens

    model = Recorder()
    stream = np.arange(1, 15, dtype=np.uint16) % 16
    res = evaluate_streams(model, {"d": stream}, 4, batch_size=8, bos_id=9)
    assert [row[0] for batch in model.seen for row in batch.tolist()] == [9] * 4  # windows of 4 over 13 targets
    assert res["d"].tokens == 13 and abs(res["d"].loss - math.log(16)) < 1e-6
