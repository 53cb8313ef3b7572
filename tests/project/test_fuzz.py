"""Property-based fuzzing of everything that parses bytes we did not write (hypothesis).

Each parser gets arbitrary and near-valid inputs and may only succeed or raise one of the
project's user-error types with a one-line message: the safetensors header parser, config JSON
(canonical metadata and HF config.json, Mixtral included), recipes, and shard indexes. Examples
are bounded (150 each, no deadline: the machine may be busy) so `make test` stays fast.
"""
from __future__ import annotations

import io
import json
import struct
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bam_surgery.converters.hf.architectures import ARCHITECTURES
from bam_surgery.runtime.config import ModelConfig
from bam_surgery.runtime.safetensors_file import read_header
from bam_surgery.runtime.shards import read_index, shard_path
from bam_surgery.runtime.errors import UserError, one_line
from bam_surgery.surgery.recipe import parse_recipe

FUZZ = settings(max_examples=150, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

# JSON values: scalars of every kind (huge and negative integers, odd floats, control characters)
scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70),
                    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12))
json_values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                            st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                           max_leaves=12)


def clean(call) -> None:
    """call() succeeds or raises a user error whose message prints as one line."""
    try:
        call()
    except UserError as e:
        line = one_line(e)
        assert line and "\n" not in line and "\r" not in line


# ---- safetensors headers ---------------------------------------------------------------------------
DTYPES = st.sampled_from(["F32", "BF16", "F16", "I64", "U8", "BOOL", "F8_E4M3", "F6_E2M3", "F4", "X9", ""])
entries = st.fixed_dictionaries({
    "dtype": st.one_of(DTYPES, scalars),
    "shape": st.one_of(st.lists(st.integers(min_value=-2, max_value=2**40), max_size=4), scalars),
    "data_offsets": st.one_of(st.lists(st.integers(min_value=-2, max_value=2**66), min_size=0, max_size=3), scalars),
})
headers = st.dictionaries(st.text(max_size=10), st.one_of(entries, json_values), max_size=4)


def _parse(data: bytes) -> None:
    read_header(Path("fuzz.safetensors"), io.BytesIO(data), len(data))


@FUZZ
@given(st.binary(max_size=200))
def test_safetensors_header_parser_on_random_bytes(data):
    clean(lambda: _parse(data))


@FUZZ
@given(headers, st.binary(max_size=64), st.integers(min_value=-3, max_value=3))
def test_safetensors_header_parser_on_near_valid_headers(header, data, skew):
    raw = json.dumps(header).encode()
    prefix = struct.pack("<Q", max(0, len(raw) + skew))
    clean(lambda: _parse(prefix + raw + data))


# ---- configs: canonical metadata and HF config.json ------------------------------------------------
VALID = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, ffn_hidden=48).to_dict()


@FUZZ
@given(st.one_of(st.text(max_size=60), json_values.map(json.dumps),
                 st.dictionaries(st.sampled_from(sorted(VALID)), json_values, max_size=5)
                 .map(lambda d: json.dumps({**VALID, **d}))))
def test_canonical_config_json(text):
    clean(lambda: ModelConfig.from_json(text))


HF_KEYS = sorted({k for a in ARCHITECTURES.values() for f in getattr(a.config, "fields", ()) for k in f.hf_keys}
                 | {"num_local_experts", "num_experts_per_tok", "rope_parameters", "sliding_window", "hidden_act"})
LLAMA = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}


@FUZZ
@given(st.sampled_from(sorted(ARCHITECTURES)), st.dictionaries(st.sampled_from(HF_KEYS), json_values, max_size=4))
def test_hf_config_json(model_type, changes):
    body = {**LLAMA, "n_embd": 32, "n_layer": 2, "n_head": 4, **changes}
    clean(lambda: ARCHITECTURES[model_type].config.read(body, name=model_type))


# ---- recipes ---------------------------------------------------------------------------------------
BTX = yaml.safe_load((Path(__file__).parents[2] / "recipes" / "btx.yaml").read_text())


@FUZZ
@given(st.one_of(
    st.text(max_size=80),
    json_values.map(yaml.safe_dump),
    st.tuples(st.sampled_from(["defaults", "routers", "experts", "tensors", "name", "schema"]),
              st.dictionaries(st.text(max_size=12), json_values, max_size=3) | json_values)
      .map(lambda kv: yaml.safe_dump({**BTX, kv[0]: kv[1]})),
))
def test_recipes(text):
    clean(lambda: parse_recipe(text, "fuzz.yaml"))


# ---- indexes ---------------------------------------------------------------------------------------
@FUZZ
@given(st.one_of(json_values, st.fixed_dictionaries({
    "metadata": json_values,
    "weight_map": st.dictionaries(st.text(max_size=10), st.one_of(
        st.text(max_size=30), st.sampled_from(["../x.safetensors", "/etc/passwd", "a/../../b", "", ".", "\x00"]),
        scalars), max_size=4)})))
def test_indexes(tmp_path_factory, body):
    folder = tmp_path_factory.mktemp("index")
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps(body))

    def load():
        weight_map, _ = read_index(index)
        for name in set(weight_map.values()):
            path = shard_path(folder, name, index)
            assert path.resolve().parent == folder.resolve() or folder.resolve() in path.resolve().parents
    clean(load)


# ---- metrics.jsonl, as `plot` reads it -------------------------------------------------------------
numbers = st.one_of(st.floats(), st.integers(min_value=-2**1100, max_value=2**1100))
train_lines = st.fixed_dictionaries({"kind": st.just("train"), "step": st.one_of(st.integers(0, 10**6), scalars)},
                                    optional={"loss": st.one_of(numbers, scalars), "nll": numbers, "lr": numbers})
eval_lines = st.fixed_dictionaries({"kind": st.just("eval"), "step": st.integers(0, 10**6), "domains": st.one_of(
    st.dictionaries(st.text(max_size=6), st.one_of(st.fixed_dictionaries({"loss": numbers}), json_values),
                    max_size=3), json_values)})
metrics_lines = st.lists(st.one_of(train_lines, eval_lines, json_values).map(
    lambda r: json.dumps(r).encode()), min_size=1, max_size=6).map(lambda ls: b"\n".join(ls) + b"\n")


def _read_curves(data: bytes, folder: Path):
    from bam_surgery.train.metrics import read_curves

    (folder / "metrics.jsonl").write_bytes(data)
    return read_curves(folder / "metrics.jsonl")


@FUZZ
@given(st.one_of(st.binary(max_size=200), metrics_lines,
                 metrics_lines.map(lambda b: b[:len(b) // 2]),  # a torn last line
                 st.integers(1, 5000).map(lambda n: b"[" * n + b"]" * n + b"\n" + b'{"a":' * n)))
def test_metrics_reader(tmp_path_factory, data):
    clean(lambda: _read_curves(data, tmp_path_factory.mktemp("run")))


valid_train = st.fixed_dictionaries({"kind": st.just("train"), "step": st.integers(0, 2**40), "loss": numbers,
                                     "lr": numbers}, optional={"nll": numbers})
plotted_lines = st.lists(st.one_of(valid_train, eval_lines).map(lambda r: json.dumps(r).encode()), min_size=1,
                         max_size=6).map(lambda ls: b"\n".join(ls) + b"\n")


@pytest.mark.slow
@settings(FUZZ, max_examples=40)  # each example draws PNGs
@given(st.one_of(plotted_lines, metrics_lines))
def test_plot_on_metrics(tmp_path_factory, data):
    """What read_curves accepts, plot draws: plots or the one-line error, never a traceback."""
    from bam_surgery.train.plot import plot_run

    run = tmp_path_factory.mktemp("run")
    clean(lambda: _read_curves(data, run) and plot_run(run))


# ---- GGUF files ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> bytes:
    """A valid GGUF of a tiny Llama (our export), metadata and tensors, for the mutations below."""
    pytest.importorskip("gguf")
    from bam_surgery.converters.export import exporter
    from bam_surgery.converters.base import ExportOptions
    from bam_surgery.converters.gguf_export import GGUFOptions
    from bam_surgery.runtime.reader import StateReader
    from conftest import random_state

    cfg = ModelConfig(vocab_size=256, d_model=32, n_layers=1, n_heads=2, ffn_hidden=64, name="fuzz")
    out = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    exporter("gguf").write(StateReader(random_state(cfg), cfg), out, ExportOptions(own=GGUFOptions("f32")))
    return out.read_bytes()


def _open_gguf(data: bytes, folder: Path) -> None:
    from bam_surgery.converters.gguf_reader import GGUFCheckpointReader

    path = folder / "fuzz.gguf"
    path.write_bytes(data)
    with GGUFCheckpointReader(path) as r:
        for name in r.names()[:3]:
            r.get(name)


@FUZZ
@given(st.one_of(st.binary(max_size=200), st.binary(max_size=200).map(lambda b: b"GGUF\x03\x00\x00\x00" + b)))
def test_gguf_on_random_bytes(tmp_path_factory, data):
    clean(lambda: _open_gguf(data, tmp_path_factory.mktemp("g")))


@FUZZ
@given(st.data())
def test_gguf_on_mutated_files(tmp_path_factory, tiny_gguf, data):
    """Bytes of a valid file overwritten (counts, lengths, types, offsets: the metadata is the first few KiB) or the
    file cut short: the reader opens it or answers one line."""
    body = bytearray(tiny_gguf)
    metadata_end = min(len(body), 8192)
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(4, metadata_end - 8))
        body[at:at + 8] = data.draw(st.sampled_from([b"\xff" * 8, b"\x00" * 8, (2**31).to_bytes(8, "little"),
                                                     bytes(data.draw(st.binary(min_size=8, max_size=8)))]))
    cut = data.draw(st.one_of(st.none(), st.integers(0, len(body))))
    clean(lambda: _open_gguf(bytes(body[:cut]), tmp_path_factory.mktemp("g")))


# tokenizer metadata of a SentencePiece (or byte-level BPE) GGUF: lists of the wrong length, type or range
spm_tokens = st.lists(st.one_of(st.sampled_from(["<bos>", "<eos>", "\u2581", "a", "b", "ab", "\u2581a", "  ", "<0x41>"]),
                                st.text(max_size=4)), min_size=1, max_size=12)
spm_fields = st.fixed_dictionaries({
    "general.architecture": st.sampled_from(["gemma3", "llama", "phi3", 7]),
    "tokenizer.ggml.model": st.sampled_from(["llama", "gpt2", "t5", None]),
    "tokenizer.ggml.tokens": st.one_of(spm_tokens, scalars, st.lists(scalars, max_size=4)),
}, optional={
    "tokenizer.ggml.scores": st.one_of(st.lists(st.one_of(st.floats(), st.integers(-5, 5), st.text(max_size=2)),
                                                max_size=12), scalars),
    "tokenizer.ggml.token_type": st.one_of(st.lists(st.one_of(st.integers(-2, 8), st.booleans(), st.text(max_size=1)),
                                                    max_size=12), scalars),
    "tokenizer.ggml.pre": st.sampled_from(["default", "llama-bpe", "gpt-2", "x"]),
    "tokenizer.ggml.merges": st.lists(st.text(max_size=5), max_size=4),
    "tokenizer.ggml.bos_token_id": scalars, "tokenizer.ggml.eos_token_id": st.integers(-1, 14),
    "tokenizer.ggml.add_bos_token": scalars, "tokenizer.ggml.add_eos_token": st.booleans(),
    "tokenizer.chat_template": scalars,
}).map(lambda d: {k: v for k, v in d.items() if v is not None})


@FUZZ
@given(spm_fields)
def test_gguf_tokenizer_metadata(fields):
    """What the GGUF reader rebuilds a tokenizer from: files' texts, a note saying why not, or one line."""
    from bam_surgery.converters.gguf_tokenizer import tokenizer_texts

    def rebuild() -> None:
        texts = tokenizer_texts(fields, "fuzz.gguf", None)
        assert isinstance(texts, str) or json.loads(texts["tokenizer.json"])["model"]["type"] == "BPE"
    clean(rebuild)


def test_the_fuzzers_can_fail():
    """The property is not vacuous: a parser that raised anything else would fail it."""
    with pytest.raises(ZeroDivisionError):
        clean(lambda: 1 / 0)


# ---- the files issue 33 named: run state, metrics lines for resume, tokenizer_config.json, JSON text ---------
json_texts = st.one_of(st.binary(max_size=120), json_values.map(lambda v: json.dumps(v).encode()),
                       st.integers(1, 3000).map(lambda n: b"[" * n + b"]" * n),
                       st.text(max_size=20).map(lambda t: json.dumps({"s": t}).encode()),
                       st.sampled_from([b'"\\ud800"', b"1e400", b"9" * 60, b"NaN", b'{"a": 1, "a": 2}']))


@FUZZ
@given(json_texts)
def test_parse_json(data):
    from bam_surgery.runtime.jsonfile import parse_json

    clean(lambda: parse_json(data, "fuzz.json"))


RUN_INFO = {"tool": {"name": "bam-surgery"}, "init": {"provenance": None}, "experts": {"ffn": [], "attn": []},
            "tokenizer": {"name": "bytes", "fingerprint": "f"}, "data": []}


@FUZZ
@given(st.one_of(json_texts, st.dictionaries(st.sampled_from(sorted(RUN_INFO) + ["x"]), json_values, max_size=4)
                 .map(lambda d: json.dumps({**RUN_INFO, **d}).encode())))
def test_run_json(tmp_path_factory, data):
    from bam_surgery.train.checkpoints import read_run_info

    path = tmp_path_factory.mktemp("run") / "run.json"
    path.write_bytes(data)
    clean(lambda: read_run_info(path))


@FUZZ
@given(st.one_of(metrics_lines, st.lists(json_texts, min_size=1, max_size=4).map(lambda ls: b"\n".join(ls) + b"\n")))
def test_metrics_for_resume(tmp_path_factory, data):
    from bam_surgery.train.metrics import truncate_metrics

    path = tmp_path_factory.mktemp("run") / "metrics.jsonl"
    path.write_bytes(data)
    clean(lambda: truncate_metrics(path, 3))


@FUZZ
@given(st.one_of(json_texts, st.dictionaries(st.sampled_from(["eos_token", "bos_token", "pad_token", "chat_template"]),
                                             json_values, max_size=4).map(lambda d: json.dumps(d).encode())))
def test_tokenizer_config_json(tmp_path_factory, data):
    pytest.importorskip("gguf")
    from bam_surgery.converters.gguf_export import _tokenizer_config

    path = tmp_path_factory.mktemp("tok") / "tokenizer_config.json"
    path.write_bytes(data)
    clean(lambda: _tokenizer_config(path))
