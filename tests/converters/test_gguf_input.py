"""GGUF as an input (converters/gguf_reader.py, gguf_file.py, gguf_tokenizer.py), on tiny files our GGUF export writes.

* round trips through the one table (gguf_table): every architecture the export writes (llama with its Q/K
  permutation, qwen2, Mixtral-shaped llama mixtures, qwen2moe with a shared expert, and the families: llama with
  llama3 / linear / yarn RoPE, qwen3, qwen3moe, olmo2, phi3 with its fused tensors and longrope, smollm3, gemma2,
  gemma3: their (1 + w) norms come back as scales equal to the bit) reads back
  to the same config and, in f32, bit-identical tensors and logits; f16 and q8_0 within their rounding; a file
  without our config record (llama.cpp's converter writes none) reads back to a config computing the same;
* every quantization type gguf.quants dequantizes, read one tensor at a time and equal to gguf's own dequantization of
  what gguf.GGUFReader finds; the parser agrees with gguf.GGUFReader on every key and tensor;
* the tokenizer rebuilt as tokenizer.json (+ tokenizer_config.json, generation_config.json) encodes like the one the
  export embedded, and travels into convert's outputs; split files and folders holding a GGUF;
* hostile files: one line naming the file, exit 2, fast (the parser is fuzzed in tests/project/test_fuzz.py).
"""
from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from bam_surgery.converters import open_checkpoint
from bam_surgery.converters.gguf_file import parse_gguf
from bam_surgery.runtime import model_from_reader
from bam_surgery.runtime.config import ModelConfig
from conftest import cli_error_line, random_state, run_cli

gguf = pytest.importorskip("gguf")
from test_gguf import (FAMILIES, LLAMA3, TRICKY, family_config, llama_config, save_bpe, shared_config,  # noqa: E402
                       write, write_bpe)

F16_LOGIT_TOL = 5e-2  # f16 weights, max |logit difference| of a random tiny model (measured 4.2e-3)
Q8_LOGIT_TOL = 0.25  # q8_0 (measured 7.3e-2)


def logits(cfg_or_reader, state=None) -> torch.Tensor:
    model = model_from_reader(cfg_or_reader) if state is None else _model(cfg_or_reader, state)
    ids = torch.arange(24).remainder(model.config.vocab_size)[None]
    with torch.no_grad():
        return model(ids).logits[0]


def _model(cfg: ModelConfig, state):
    from bam_surgery.runtime.reader import StateReader

    return model_from_reader(StateReader(state, cfg))


SHAPES = {
    "llama": (llama_config(), "llama"),
    "llama-pairs": (llama_config(rope_interleaved=True), "llama"),
    "llama-biases": (llama_config(qkv_bias=True, o_bias=True, ffn_bias=True), "llama"),
    "qwen2": (llama_config(qkv_bias=True, tie_embeddings=True), "qwen2"),
    "mixtral": (llama_config(ffn_experts=3, ffn_top_k=2, gate_norm="topk_softmax"), "llama"),
    "qwen2moe": (shared_config(tie_embeddings=True), "qwen2moe"),
    **{family: (family_config(family), arch) for family, (_, arch) in FAMILIES.items()},
}


@pytest.mark.parametrize("kind", sorted(SHAPES))
def test_round_trip_every_architecture(tmp_path, kind):
    cfg, arch = SHAPES[kind]
    state = random_state(cfg, seed=3)
    path = write(cfg, state, tmp_path / f"{kind}.gguf", gguf_dtype="f32")
    with open_checkpoint(path) as r:
        assert r.metadata["gguf_architecture"] == arch
        back = r.config
        same = {k: v for k, v in cfg.to_dict().items() if k not in ("name", "rope_interleaved", "qkv_bias")}
        assert {k: back.to_dict()[k] for k in same} == same
        assert not back.rope_interleaved and back.qkv_bias == (cfg.qkv_bias or arch == "qwen2moe")
        if kind not in ("llama-pairs", "qwen2moe"):  # the permutation's inverse is exact
            # a (1 + w) norm (Gemma) is stored as 1 + w and read as v - 1: the scale 1 + w comes back to the bit
            offset = [n for n in state if cfg.norm_unit_offset and n.endswith("norm.weight") and ".linear." not in n]
            # Qwen3.5's a_log is written as -exp(a_log) and read as its log: to float32 rounding
            rounded = [n for n in state if n.endswith("a_log.weight")]
            assert all(torch.equal(r.get(n), state[n]) for n in state if n not in offset + rounded), kind
            assert all(torch.equal(1.0 + r.get(n), 1.0 + state[n]) for n in offset), kind
            assert all(torch.allclose(r.get(n), state[n], rtol=1e-6, atol=1e-6) for n in rounded), kind
        assert torch.equal(logits(r), logits(cfg, state)) if kind not in ("llama-pairs", "qwen35", "qwen35moe") else \
            torch.allclose(logits(r), logits(cfg, state), atol=1e-5)


@pytest.mark.parametrize("rope, expected", [
    (dict(LLAMA3, original_max_position_embeddings=8192), "llama3"),  # Llama 3.x's parameters: recovered
    (LLAMA3, "longrope"),  # others: the factors as they are
    (dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32, attention_factor=1.25), "yarn"),
    (dict(rope_type="linear", factor=4.0), "linear"),
])
def test_scaled_rope_without_our_config_record(tmp_path, monkeypatch, rope, expected):
    """llama.cpp's converter writes no bam_surgery.config: the RoPE keys and factor tensors alone give a config that
    computes the same as the model written (its logits past the original length)."""
    from bam_surgery.converters import gguf_export as ge

    card = ge.card_entries
    monkeypatch.setattr(ge, "card_entries", lambda *a: {**card(*a), "config": "{}"})
    cfg = llama_config(scaled_rope=rope, max_positions=256)
    state = random_state(cfg, seed=5)
    path = write(cfg, state, tmp_path / "foreign.gguf")
    with open_checkpoint(path) as r:
        back = r.config.scaled_rope
        assert back["rope_type"] == expected
        if expected == "llama3":
            assert back == rope
        if expected == "longrope":  # equal factors, no extra scale: what llama.cpp computes with rope_freqs
            assert back["long_factor"] == back["short_factor"] and back["attention_factor"] == 1.0
            assert "frequency factors" in r.metadata["notes"]
        model = model_from_reader(r)
        ids = torch.arange(100).remainder(cfg.vocab_size)[None]
        with torch.no_grad():
            got = model(ids).logits[0]
    want = _model(cfg, state)(ids).logits[0].detach()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_rope_scaling_the_reader_cannot_map_is_one_line(tmp_path, monkeypatch):
    from bam_surgery.converters import gguf_export as ge
    from bam_surgery.converters.gguf_table import scaled_rope_of

    cfg = llama_config()
    monkeypatch.setattr(ge, "rope_scaling", lambda c: ({"{arch}.rope.scaling.type": ("str", "dynamic"),
                                                        "{arch}.rope.scaling.factor": ("f32", 2.0)}, {}))
    path = write(cfg, random_state(cfg), tmp_path / "dynamic.gguf")
    line = cli_error_line("count-params", path)
    assert "'dynamic'" in line and "dynamic.gguf" in line
    base = llama_config()
    with pytest.raises(ValueError, match="'dynamic'"):
        scaled_rope_of("llama", {"llama.rope.scaling.type": "dynamic", "llama.rope.scaling.factor": 2.0}, {}, base,
                       None)
    freqs = {"rope_freqs.weight": np.full(8, 2.0, np.float32)}
    with pytest.raises(ValueError, match="combination"):
        scaled_rope_of("llama", {"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 2.0}, freqs, base,
                       None)
    assert scaled_rope_of("llama", {"llama.rope.scaling.type": "none", "llama.rope.scaling.factor": 2.0}, {}, base,
                          None) == (None, None)  # llama.cpp: type none never scales
    assert scaled_rope_of("llama", {"llama.rope.scale_linear": 2.0}, {}, base, None)[0] == {  # the old key: linear
        "rope_type": "linear", "factor": 2.0}


@pytest.mark.parametrize("dtype, tol", [("f16", F16_LOGIT_TOL), ("q8_0", Q8_LOGIT_TOL)])
def test_f16_and_q8_0_within_rounding(tmp_path, dtype, tol):
    cfg = llama_config()
    state = random_state(cfg, seed=4)
    path = write(cfg, state, tmp_path / f"m-{dtype}.gguf", gguf_dtype=dtype)
    with open_checkpoint(path) as r:
        assert r.dtype("layers.0.attn.q.weight") == (torch.float16 if dtype == "f16" else torch.float32)
        assert r.dtype("layers.0.attn_norm.weight") == torch.float32
        diff = (logits(r) - logits(cfg, state)).abs().max().item()
    assert 0 < diff < tol


def _quantized_file(path: Path, kinds) -> dict:
    """A GGUF of one [4, 256] tensor per type: quantized by gguf where it can, else random bytes (the K and IQ types:
    gguf dequantizes them, quantizes none)."""
    w = gguf.GGUFWriter(str(path), "llama")
    rng = np.random.default_rng(0)
    values = rng.standard_normal((4, 256)).astype(np.float32)
    for kind in kinds:
        try:
            data = gguf.quants.quantize(values, kind)
        except (NotImplementedError, gguf.quants.QuantError):
            block, size = gguf.GGML_QUANT_SIZES[kind]
            data = rng.integers(0, 256, (4, 256 // block * size), dtype=np.uint8)
            if kind.name.startswith(("Q", "IQ", "TQ")):  # keep the f16 scales finite: low bytes only
                data = (data % 64).astype(np.uint8)
        w.add_tensor(f"t.{kind.name}", data, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {t.name: t for t in gguf.GGUFReader(str(path)).tensors}


def test_every_dequantizable_type_matches_gguf(tmp_path):
    from bam_surgery.converters.gguf_reader import dequantizable

    kinds = [k for k in gguf.GGMLQuantizationType if k not in (0,) and dequantizable(int(k))
             and 256 % gguf.GGML_QUANT_SIZES[k][0] == 0]
    assert {"Q4_1", "Q8_0", "Q4_K", "Q6_K", "IQ4_NL", "BF16", "F16"} <= {k.name for k in kinds}
    path = tmp_path / "types.gguf"
    reference = _quantized_file(path, kinds)
    parsed = {t.name: t for t in parse_gguf(path).tensors}
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    from bam_surgery.converters.gguf_reader import read_tensor

    for kind in kinds:
        t = parsed[f"t.{kind.name}"]
        ours = read_tensor(mm, t).float().numpy()
        theirs = gguf.quants.dequantize(reference[t.name].data, kind).astype(np.float32).reshape(4, 256)
        assert ours.shape == (4, 256) and np.array_equal(ours, theirs, equal_nan=True), kind.name


def test_parser_agrees_with_gguf_reader(tmp_path):
    cfg = shared_config(vocab_size=310)
    out = write_bpe(cfg, random_state(cfg), tmp_path / "m.gguf", gguf_dtype="q8_0")
    ours = parse_gguf(out)
    theirs = gguf.GGUFReader(str(out))
    expected = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert ours.fields.keys() == expected.keys()
    for k, v in expected.items():
        mine = ours.fields[k]
        if isinstance(mine, np.ndarray):  # numeric arrays stay numpy arrays (gguf_file's module docstring)
            assert mine.dtype == theirs.fields[k].parts[-1].dtype, k
            mine = mine.tolist()
        assert mine == (pytest.approx(v) if isinstance(v, float) else v), k
    assert [(t.name, t.shape, t.qtype, t.start, t.nbytes) for t in ours.tensors] == [
        (t.name, tuple(int(d) for d in reversed(t.shape)), int(t.tensor_type), int(t.data_offset), int(t.n_bytes))
        for t in theirs.tensors]


def test_rebuilt_tokenizer_encodes_like_the_embedded_one(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    path = save_bpe(tmp_path / "tok")
    original = tokenizers.Tokenizer.from_file(str(path))
    cfg = llama_config(vocab_size=310)
    out = write_bpe(cfg, random_state(cfg), tmp_path / "bpe.gguf", generation={"eos_token_id": 0})
    with open_checkpoint(out) as r:
        files = {f.name: f for f in r.tokenizer_files()}
        assert set(files) == {"tokenizer.json", "tokenizer_config.json", "generation_config.json"}
        rebuilt = tokenizers.Tokenizer.from_file(str(files["tokenizer.json"]))
        for text in TRICKY + ["The quick brown fox <|endoftext|> jumps"]:
            assert rebuilt.encode(text).ids == original.encode(text).ids, text
        config = json.loads(files["tokenizer_config.json"].read_text())
        assert config["chat_template"] == "{{ messages }}" and config["eos_token"] == "<|endoftext|>"
        assert json.loads(files["generation_config.json"].read_text())["eos_token_id"] == 0
        assert rebuilt.token_to_id("<|endoftext|>") == 0


def test_tokenizer_travels_into_convert_outputs(tmp_path):
    cfg = llama_config(vocab_size=310)
    state = random_state(cfg, seed=5)
    out = write_bpe(cfg, state, tmp_path / "bpe.gguf", gguf_dtype="f32", generation={"eos_token_id": 0})
    run_cli("convert", out, "--format", "hf", "--out", tmp_path / "hf")
    assert (tmp_path / "hf" / "tokenizer.json").is_file() and (tmp_path / "hf" / "tokenizer_config.json").is_file()
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["eos_token_id"] == 0
    assert json.loads((tmp_path / "hf" / "generation_config.json").read_text())["eos_token_id"] == 0
    with open_checkpoint(tmp_path / "hf") as r:  # HF llama, rotate-halves: the original weights
        assert all(torch.equal(r.get(n), state[n]) for n in state)
    run_cli("convert", out, "--format", "gguf", "--out", tmp_path / "again.gguf")  # the tokenizer embedded again
    first, again = parse_gguf(out).fields, parse_gguf(tmp_path / "again.gguf").fields
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.pre",
                "tokenizer.ggml.eos_token_id", "tokenizer.chat_template"):
        assert np.array_equal(first[key], again[key]) if key.endswith("type") else first[key] == again[key], key
    # a BTX merge of GGUF inputs carries the rebuilt tokenizer into its Mixtral folder
    expert = write_bpe(cfg, random_state(cfg, seed=7), tmp_path / "code.gguf", gguf_dtype="f32",
                       generation={"eos_token_id": 0})
    run_cli("merge", "--seed", out, "--experts", f"code={expert}", "--recipe", "btx", "--gate-norm", "topk_softmax",
            "--format", "mixtral", "--out", tmp_path / "btx")
    assert (tmp_path / "btx" / "tokenizer.json").read_text() == (
        tmp_path / "hf" / "tokenizer.json").read_text()


def test_split_files_and_folders(tmp_path):
    cfg = llama_config()
    state = random_state(cfg, seed=6)
    single = write(cfg, state, tmp_path / "one" / "m.gguf", gguf_dtype="f32")
    split_dir = tmp_path / "split"
    split_dir.mkdir()
    reader = gguf.GGUFReader(str(single))
    w = gguf.GGUFWriter(str(split_dir / "m.gguf"), "llama", split_max_tensors=8)
    for key, field in reader.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture" and field.contents() != []:
            value = field.contents()
            kind = field.types[0]
            sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(key, value, kind, sub_type=sub)
    for t in reader.tensors:
        w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    parts = sorted(split_dir.glob("*.gguf"))
    assert len(parts) > 1 and parts[0].name.endswith(f"-00001-of-{len(parts):05d}.gguf")
    for spec in (parts[-1], split_dir, single.parent):
        with open_checkpoint(spec) as r:
            assert torch.equal(r.get("layers.1.attn.q.weight"), state["layers.1.attn.q.weight"])
            assert set(r.files()) == (set(parts) if spec != single.parent else {single})
    parts[1].unlink()
    assert cli_error_line("inspect", parts[0]).endswith("is missing") or "missing" in cli_error_line("inspect", parts[0])
    write(cfg, state, split_dir / "other.gguf", gguf_dtype="f32")
    assert "GGUF models" in cli_error_line("inspect", split_dir)


# ---- hostile files --------------------------------------------------------------------------------------
def _tiny(tmp_path: Path) -> bytes:
    cfg = llama_config(n_layers=1)
    return write(cfg, random_state(cfg), tmp_path / "tiny.gguf", gguf_dtype="f32").read_bytes()


def _first_key_value(data: bytes) -> int:
    """Offset of the first value's type (after the first key)."""
    n = struct.unpack_from("<Q", data, 24)[0]
    return 24 + 8 + n


HOSTILE = {
    "bad magic": (lambda d: b"GGUX" + d[4:], "not a GGUF file"),
    "version 1": (lambda d: d[:4] + struct.pack("<I", 1) + d[8:], "GGUF version 1"),
    "lying tensor count": (lambda d: d[:8] + struct.pack("<Q", 2**62) + d[16:], "tensors"),
    "lying key-value count": (lambda d: d[:16] + struct.pack("<Q", 2**40) + d[24:], "key-value pairs"),
    "huge key": (lambda d: d[:24] + struct.pack("<Q", 2**63) + d[32:], "bytes long"),
    "unknown value type": (lambda d: d[:_first_key_value(d)] + struct.pack("<I", 77) + d[_first_key_value(d) + 4:],
                           "unknown value type 77"),
    "truncated metadata": (lambda d: d[:parse_gguf_bytes(d)["tokenizer.ggml.merges"] - 3], "truncated"),
    "truncated data": (lambda d: d[:-100], "past the end of the file"),
    "empty": (lambda d: b"", "too short"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_files_get_one_line(tmp_path, case):
    mutate, needle = HOSTILE[case]
    path = tmp_path / "hostile.gguf"
    path.write_bytes(mutate(_tiny(tmp_path)))
    start = time.perf_counter()
    line = cli_error_line("inspect", path)
    assert time.perf_counter() - start < 5
    assert str(path) in line and needle in line, line


def _replace_field(data: bytes, key: str, value: bytes) -> bytes:
    """The file with `key`'s value bytes (after its type) replaced: type + payload."""
    raw = key.encode()
    at = data.index(struct.pack("<Q", len(raw)) + raw) + 8 + len(raw)
    parsed = parse_gguf_bytes(data)
    end = parsed[key]
    return data[:at] + value + data[end:]


def parse_gguf_bytes(data: bytes) -> dict[str, int]:
    """key -> offset just past its value (by re-parsing with the project's parser's cursor)."""
    from bam_surgery.converters import gguf_file as gf

    cur = gf._Cursor(data, Path("x"), len(data))
    cur.pos = 24
    ends = {}
    for i in range(struct.unpack_from("<Q", data, 16)[0]):
        key = cur.string("key")
        vtype = cur.unpack("<I", "type")
        gf._value(cur, vtype, key)
        ends[key] = cur.pos
    return ends


def test_hostile_values_get_one_line(tmp_path):
    data = _tiny(tmp_path)
    u32 = struct.pack("<I", 4)
    cases = {
        "huge array": (_replace_field(data, "tokenizer.ggml.merges",
                                      struct.pack("<IIQ", 9, 8, 2**50)), "declares"),
        "array of arrays": (_replace_field(data, "tokenizer.ggml.merges", struct.pack("<IIQ", 9, 9, 1)),
                            "array of arrays"),
        "lying block count": (_replace_field(data, "llama.block_count", u32 + struct.pack("<I", 3_000_000)),
                              "block_count"),
        "unknown architecture": (_replace_field(data, "general.architecture",
                                                struct.pack("<IQ", 8, 5) + b"gemma"), "architecture 'gemma'"),
        "token id outside": (_replace_field(data, "tokenizer.ggml.eos_token_id", u32 + struct.pack("<I", 10**6)),
                             "eos_token_id"),
    }
    for name, (body, needle) in cases.items():
        path = tmp_path / f"{name.replace(' ', '-')}.gguf"
        path.write_bytes(body)
        line = cli_error_line("count-params", path)
        assert str(path) in line and needle in line, (name, line)


def test_hostile_tensor_directory(tmp_path):
    """Unknown tensor types and names, overlapping and unaligned data, written with gguf's own writer."""
    def one(name: str, data: np.ndarray, raw_dtype=None, patch=None) -> str:
        path = tmp_path / f"{name}.gguf"
        w = gguf.GGUFWriter(str(path), "llama")
        w.add_tensor(name, data, raw_dtype=raw_dtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        if patch:
            path.write_bytes(patch(path.read_bytes(), name))
        return cli_error_line("inspect", path)

    def tensor_type(data: bytes, name: str, value: int) -> bytes:
        at = data.index(name.encode()) + len(name) + 4 + 8 * 2  # past n_dims and two dims
        return data[:at] + struct.pack("<I", value) + data[at + 4:]

    def offset(data: bytes, name: str, value: int) -> bytes:
        at = data.index(name.encode()) + len(name) + 4 + 8 * 2 + 4
        return data[:at] + struct.pack("<Q", value) + data[at + 8:]

    x = np.zeros((4, 32), dtype=np.float32)
    assert "unknown type 99" in one("tensor_a", x, patch=lambda d, n: tensor_type(d, n, 99))
    assert "unaligned" in one("tensor_b", x, patch=lambda d, n: offset(d, n, 3))
    assert "past the end" in one("tensor_c", x, patch=lambda d, n: offset(d, n, 2**40))
    assert "type I32" in one("blk.0.attn_q.weight", x.astype(np.int32))  # not a floating-point weight type


def test_unknown_tensor_named(tmp_path):
    cfg = llama_config(n_layers=1)
    data = write(cfg, random_state(cfg), tmp_path / "m.gguf", gguf_dtype="f32").read_bytes()
    path = tmp_path / "renamed.gguf"
    path.write_bytes(data.replace(b"blk.0.ffn_up.weight", b"blk.0.ffn_xx.weight"))
    line = cli_error_line("inspect", path)
    assert "blk.0.ffn_xx.weight" in line and "unknown tensor" in line


def test_hostile_gemma_values_get_one_line(tmp_path):
    """Gemma's window and soft-cap keys (gguf_table's WINDOWS section) checked: one line naming the file and the key
    (values of the same length replaced, so the tensor data stays in place); an integer period or no pattern reads as
    llama.cpp's set_swa_pattern."""
    from bam_surgery.converters.gguf_table import windows_of

    cfg = family_config("gemma3")
    data = write(cfg, random_state(cfg), tmp_path / "g3.gguf", gguf_dtype="f32").read_bytes()
    cases = {
        "int8 pattern": ("gemma3.attention.sliding_window_pattern", struct.pack("<IIQ", 9, 1, 3) + b"\x01\x00\x01",
                         "sliding_window_pattern"),
        "float window": ("gemma3.attention.sliding_window", struct.pack("<If", 6, 5.0), "sliding_window"),
        "negative base": ("gemma3.rope.freq_base_swa", struct.pack("<Ii", 5, -5), "window_rope_theta"),
    }
    for name, (key, value, needle) in cases.items():
        path = tmp_path / f"{name.replace(' ', '-')}.gguf"
        path.write_bytes(_replace_field(data, key, value))
        line = cli_error_line("count-params", path)
        assert str(path) in line and needle in line, (name, line)
    base = cfg.replace(attn_window=None, attn_window_layers=None, window_rope_theta=None)
    window = {"gemma3.attention.sliding_window": 5}
    assert windows_of("gemma3", {**window, "gemma3.attention.sliding_window_pattern": 2}, base)["attn_window_layers"] \
        == [0, 2]  # a period of 2: layers 0 and 2 slide
    assert windows_of("gemma3", window, base)["attn_window_layers"] is None  # llama.cpp's 6: all three slide
    assert windows_of("gemma3", {}, base) == {}  # no sliding_window: gemma3 without windows
    assert windows_of("gemma2", {}, base)["attn_window"] == 4096  # gemma2's default window
    cfg2 = family_config("gemma2")
    g2 = write(cfg2, random_state(cfg2), tmp_path / "g2.gguf", gguf_dtype="f32").read_bytes()
    zero = tmp_path / "zero-cap.gguf"  # llama.cpp's gemma2 would divide by it
    zero.write_bytes(_replace_field(g2, "gemma2.attn_logit_softcapping", struct.pack("<If", 6, 0.0)))
    assert "attn_softcap" in cli_error_line("count-params", zero)
