"""ONNX Runtime GenAI runs the ONNX export with its own generator (og.Model, og.GeneratorParams, og.Generator) from
the genai_config.json the export writes (converters/onnx_genai.py): greedy tokens equal runtime.generate's for a
dense model, a BTX mixture, BAM with expert KV (the experts' caches side by side on the heads axis) and BAM with
shared KV, its logits along the way equal the runtime's within 1e-4; the checkpoint's eos id stops it where it stops
runtime.generate; equal-length batches; fp16 graphs give onnxruntime's own greedy tokens; the byte-level tokenizer
written for GenAI encodes and decodes as train/tokenize.py's; the model card's GenAI snippet runs; a graph without
KV cache gets no genai_config.json and a note; bad input is one line, exit 2, nothing written. CPU, tiny models,
offline; skipped where onnxruntime-genai is not installed."""
from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from conftest import llama_state, random_state, tiny_config, write_llama_dir
from test_onnx import export_model, model_for
from bam_surgery.cli.commands import cli
from bam_surgery.converters import open_checkpoint
from bam_surgery.converters.onnx_genai import DEFAULT_EOS, GENAI_CONFIG, byte_tokenizer_files, genai_config
from bam_surgery.converters.onnx_runtime import OrtDecoder
from bam_surgery.runtime import generate, model_from_reader, save_checkpoint
from bam_surgery.runtime.blocks import ModelKVCache
from bam_surgery.train.tokenize import ByteTokenizer

og = pytest.importorskip("onnxruntime_genai")

GENAI_KINDS = ["dense_llama", "btx_top2", "bam_expert_kv", "bam_shared_kv", "bam_topk_attention", "btx_shared_expert",
               "bam_gemma_window"]  # not longrope: GenAI keeps its cache across longrope's switch (docs/onnx.md)


def genai_greedy(folder: Path, prompts: list[list[int]], n_new: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """(GenAI's greedy tokens [B, <= n_new], the logits [B, V] it chose each one from). get_logits runs the pending
    step: read before generate_next_token it gives the logits that step picks from (after it, the next step's, and
    past the last token it would run the model once more)."""
    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=len(prompts[0]) + n_new, batch_size=len(prompts))
    generator = og.Generator(model, params)
    generator.append_tokens(np.array(prompts, dtype=np.int32))
    tokens, logits = [], []
    while not generator.is_done():
        logits.append(generator.get_logits().reshape(len(prompts), -1).copy())
        generator.generate_next_token()
        tokens.append(generator.get_next_tokens().copy())
    return np.stack(tokens, axis=1), logits


def prompts(cfg, batch: int = 1, length: int = 5, seed: int = 0) -> list[list[int]]:
    return torch.randint(1, cfg.vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("kind", GENAI_KINDS)
def test_genai_greedy_equals_runtime(kind, tmp_path):
    model = model_for(kind)
    cfg = model.config
    out = export_model(model, tmp_path / "onnx")
    config = json.loads((out / GENAI_CONFIG).read_text())
    assert config["model"]["decoder"]["num_key_value_heads"] == ModelKVCache.kv_heads(cfg)
    assert config["search"]["past_present_share_buffer"] is False
    assert config["model"]["eos_token_id"] == DEFAULT_EOS  # no eos id in the checkpoint, and GenAI needs one
    for seed in range(3):
        prompt = prompts(cfg, seed=seed)
        n_new = cfg.max_positions - len(prompt[0])  # to the end of the context, or to the eos id
        got, logits = genai_greedy(out, prompt, n_new)
        want = generate(model, torch.tensor(prompt), n_new, eos_token_id=DEFAULT_EOS)
        assert got.tolist() == want.tolist(), (kind, seed)
        with torch.no_grad():  # the logits GenAI chose each token from, against the runtime's on the same sequence
            ref = model(torch.cat([torch.tensor(prompt), want], dim=1)).logits[0, len(prompt[0]) - 1:-1]
        assert np.abs(np.concatenate(logits) - ref.numpy()).max() < 1e-4, kind


def test_equal_length_batches_and_fp16(tmp_path):
    model = model_for("bam_expert_kv", seed=1)
    out = export_model(model, tmp_path / "fp32")
    batch = prompts(model.config, batch=3, length=6, seed=1)
    got, _ = genai_greedy(out, batch, 10)
    assert got.tolist() == generate(model, torch.tensor(batch), 10).tolist()
    half = export_model(model, tmp_path / "fp16", dtype=torch.float16)
    got, _ = genai_greedy(half, batch, 10)  # the same graph, the same onnxruntime kernels: onnxruntime's own tokens
    ids = np.array(batch)
    assert got.tolist() == OrtDecoder(half / "model.onnx").greedy(ids, np.ones_like(ids), 10).tolist()


def test_the_checkpoints_token_ids(tmp_path):
    """An HF folder's eos id (generation_config.json: 2) stops GenAI where it stops runtime.generate (as bam-surgery generate
    calls it); its pad and bos ids are written too."""
    ckpt = tmp_path / "llama"
    write_llama_dir(ckpt, llama_state(0), "t")
    result = CliRunner().invoke(cli, ["export-onnx", str(ckpt), "--out", str(tmp_path / "onnx")])
    assert result.exit_code == 0, result.output
    model_section = json.loads((tmp_path / "onnx" / GENAI_CONFIG).read_text())["model"]
    assert {k: model_section[k] for k in ("eos_token_id", "pad_token_id", "bos_token_id")} == {
        "eos_token_id": 2, "pad_token_id": 2, "bos_token_id": 1}  # no pad id: runtime.generate fills with eos
    assert (tmp_path / "onnx" / "tokenizer.json").is_file() and (tmp_path / "onnx" / "tokenizer_config.json").is_file()
    with open_checkpoint(str(ckpt)) as reader:
        model = model_from_reader(reader, "cpu", torch.float32).eval()
    stopped = 0
    for seed in range(12):
        prompt = prompts(model.config, seed=seed)
        want = generate(model, torch.tensor(prompt), 40, eos_token_id=2)[0].tolist()  # up to its eos, if any
        got, _ = genai_greedy(tmp_path / "onnx", prompt, 40)
        assert got[0].tolist() == want, seed
        stopped += 2 in want
    assert stopped, "no prompt reached the eos id: the stop went unchecked"


def test_token_ids_outside_the_vocabulary_are_left_out():
    cfg = tiny_config()
    section = genai_config(cfg, {"eos_token_id": [2, 999, -1], "pad_token_id": 500, "bos_token_id": True})["model"]
    assert section["eos_token_id"] == 2 and section["pad_token_id"] == 2 and "bos_token_id" not in section
    section = genai_config(cfg, {"eos_token_id": [3, 4]})["model"]
    assert section["eos_token_id"] == [3, 4] and section["pad_token_id"] == 3
    section = genai_config(cfg, {})["model"]
    assert section["eos_token_id"] == DEFAULT_EOS and section["pad_token_id"] == DEFAULT_EOS


# ---- the byte-level tokenizer, through the command line ----------------------------------------------------------
TEXTS = ["hello world", "  two  spaces\nand\ttab", "héllo ünïcode ✓ 日本", "<|endoftext|> is text here", "\u0100x"]


@pytest.fixture(scope="module")
def byte_export(tmp_path_factory):
    """A byte-vocabulary checkpoint (256 tokens, no tokenizer: train's rules give the byte-level one) exported."""
    root = tmp_path_factory.mktemp("genai_bytes")
    cfg = tiny_config(vocab_size=256, attn_experts=2, ffn_experts=2, max_positions=48)
    save_checkpoint(random_state(cfg, 4), cfg, root / "bytes.safetensors")
    result = CliRunner().invoke(cli, ["export-onnx", str(root / "bytes.safetensors"), "--out", str(root / "onnx")])
    assert result.exit_code == 0, result.output
    return root / "bytes.safetensors", root / "onnx"


def test_byte_tokenizer_matches_train_tokenize(byte_export):
    _, out = byte_export
    assert {p.name for p in out.iterdir()} >= {"tokenizer.json", "tokenizer_config.json", GENAI_CONFIG, "model.onnx"}
    assert (out / "tokenizer.json").read_text() == byte_tokenizer_files()["tokenizer.json"]
    tokenizer = og.Tokenizer(og.Model(str(out)))
    reference = ByteTokenizer()
    for text in TEXTS:
        ids = reference.encode_batch([text])[0]
        assert tokenizer.encode(text).tolist() == ids.tolist(), text
        assert tokenizer.decode(ids.astype(np.int32)) == reference.decode(ids.tolist()), text
    assert tokenizer.decode(np.array([104, 0, 105], dtype=np.int32)) == "hi"  # end of text decodes to nothing
    # GenAI 0.18's decode ends at the first byte that is not UTF-8 (one U+FFFD); ByteTokenizer replaces each and goes on
    assert tokenizer.decode(np.array([104, 130, 105], dtype=np.int32)) == "h\ufffd"
    assert reference.decode([104, 130, 105]) == "h\ufffdi"
    import tokenizers  # the same file in `tokenizers` (what HF's fast tokenizers load)

    hf = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
    for text in [*TEXTS, "nul\x00byte"]:  # a NUL byte is dropped (GenAI's encode stops at one: C strings)
        assert hf.encode(text, add_special_tokens=False).ids == reference.encode_batch([text])[0].tolist(), text


def test_genai_text_equals_bam_surgery_generate(byte_export):
    ckpt, out = byte_export
    result = CliRunner().invoke(cli, ["generate", str(ckpt), "--prompt", "The cat", "--max-new-tokens", "24"])
    assert result.exit_code == 0, result.output
    with open_checkpoint(str(ckpt)) as reader:
        model = model_from_reader(reader, "cpu", torch.float32).eval()
    ids = ByteTokenizer().encode_batch(["The cat"])[0].tolist()
    # GenAI stops at end of text (DEFAULT_EOS), bam-surgery generate runs on: this prompt's 24 tokens hold none
    assert DEFAULT_EOS not in generate(model, torch.tensor([ids]), 24)[0].tolist()
    tokenizer = og.Tokenizer(og.Model(str(out)))
    assert tokenizer.encode("The cat").tolist() == ids
    got, _ = genai_greedy(out, [ids], 24)
    # a random model's bytes are rarely UTF-8, where GenAI's decode stops (see the tokenizer test): ByteTokenizer's
    assert result.stdout == ByteTokenizer().decode(got[0].tolist()) + "\n"


# ---- the model card, --no-kv-cache, bad input ---------------------------------------------------------------------
def test_model_card_genai_snippet_runs(tmp_path, monkeypatch):
    model = model_for("bam_shared_kv")
    out = export_model(model, tmp_path / "card")
    blocks = re.findall(r"```python\n(.*?)```", (out / "README.md").read_text(), re.S)
    code = next(b for b in blocks if "onnxruntime_genai" in b)
    monkeypatch.chdir(out)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "README.md", "exec"), {})
    want = generate(model, torch.tensor([[1, 2, 3]]), 8, eos_token_id=DEFAULT_EOS)
    assert printed.getvalue().strip() == str(want[0].tolist())


def test_no_kv_cache_writes_no_genai_config(tmp_path):
    cfg = tiny_config(max_positions=32)
    save_checkpoint(random_state(cfg, 1), cfg, tmp_path / "m.safetensors")
    result = CliRunner().invoke(cli, ["export-onnx", str(tmp_path / "m.safetensors"), "--out", str(tmp_path / "o"),
                                      "--no-kv-cache"])
    assert result.exit_code == 0, result.output
    assert not (tmp_path / "o" / GENAI_CONFIG).exists()
    notes = [line for line in result.output.splitlines() if line.startswith("bam-surgery: note:")]
    assert len(notes) == 1 and GENAI_CONFIG in notes[0] and "KV cache" in notes[0], result.output
    assert "ONNX Runtime GenAI" not in (tmp_path / "o" / "README.md").read_text()


def test_a_bad_generation_config_is_one_line_and_writes_nothing(tmp_path):
    ckpt = tmp_path / "llama"
    write_llama_dir(ckpt, llama_state(0), "t")
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": "two"}))
    result = CliRunner().invoke(cli, ["export-onnx", str(ckpt), "--out", str(tmp_path / "o")])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bam-surgery: error:") and "eos_token_id" in lines[0], lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["llama"]


def test_a_run_checkpoints_tokenizer_is_carried(tmp_path):
    """A canonical folder's tokenizer.json (a run checkpoint carries the one it trained with) and its
    tokenizer_config.json go into the export, so GenAI's tokenizer reads them."""
    cfg = tiny_config(vocab_size=256, max_positions=32)
    folder = save_checkpoint(random_state(cfg, 2), cfg, tmp_path / "run")
    for name, text in byte_tokenizer_files().items():
        (folder / name).write_text(text.replace('"clean_up_tokenization_spaces"', '"model_max_length": 32, '
                                                '"clean_up_tokenization_spaces"'))
    result = CliRunner().invoke(cli, ["export-onnx", str(folder), "--out", str(tmp_path / "o")])
    assert result.exit_code == 0, result.output
    assert "model_max_length" in (tmp_path / "o" / "tokenizer_config.json").read_text()
    assert og.Tokenizer(og.Model(str(tmp_path / "o"))).encode("abc").tolist() == [97, 98, 99]
