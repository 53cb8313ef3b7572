"""vLLM serves every model kind, and a bam and a bam-shared-kv merge of every family the tool reads, with the
runtime's tokens, on vLLM's CPU backend.

Run by `make test-compat` in .venv-compat/vllm (requirements-vllm.txt; there BAM_COMPAT_STAGE=1 makes a missing
vllm a failure, not a skip). HF BAM exports go through this package's plugin (converters/vllm_bam/, found by
vLLM through the entry point alone: no remote code, no flag); the Mixtral, Qwen2-MoE (a shared-expert mixture, and a
BTX of Qwen2 models with its all-zero shared expert), Qwen3-MoE, FlexOlmo and dense (Llama) exports through vLLM's
own models. The models:
  - KINDS: every model kind on random canonical weights (between them every router kind, block style, norm,
    position scheme, bias, KV mode, routing mode and native format);
  - FAMILIES x RECIPES: for each family of docs/families.md the runtime reads (conftest.FAMILY_CASES: transformers'
    own classes build the seed; head size 64 for vLLM's CPU attention, RoPE thresholds shrunk so that the prompts
    run past them), two specialists branched from the seed (conftest.hf_specialists), merged by `bam-surgery merge`
    with the recipe's defaults; the merge's routers then drawn far from uniform (as training leaves them: a weak
    router would hide a gate on the wrong head), the embeddings scaled down and the head's scale set for logits of
    spread LOGIT_SPREAD (random tied embeddings give one-hot distributions, whose logprobs would say nothing);
    exported `--format hf`.
vLLM's start-up dominates on a CPU, so one process (vllm_engine.py) serves every model in turn, the engine core in
that process: each model's batch of prompts of different lengths (PROMPTS: 3, 11 and 40 tokens and NEW more, past
every sliding window and RoPE threshold of the tiny configs) in one generate call, and one text prompt through
the export's own tokenizer. For each model: the greedy tokens equal runtime.generate's, each chosen token's
logprob is within LOGPROB_TOL of the runtime's log-softmax, and the text's tokens are the runtime's as words.
One model (SERVER_MODEL) is also served by vLLM's OpenAI server (what `vllm serve` runs), through the HTTP API, and
two (TENSOR_PARALLEL) by two tensor-parallel ranks.
What vLLM refuses (converters/vllm_bam/support.py) is refused at load in one line: longrope past its original
length (REFUSALS).
"""
from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

if os.environ.get("BAM_COMPAT_STAGE") != "1":
    pytest.importorskip("vllm")
import vllm  # noqa: E402, F401  (the stage's venv must have it)

from bam_surgery.converters.base import ExportOptions  # noqa: E402
from bam_surgery.converters.export import exporter  # noqa: E402
from bam_surgery.converters.hf.writer import save_hf  # noqa: E402
from bam_surgery.runtime import generate, load_model, save_model  # noqa: E402
from bam_surgery.runtime.checkpoint import CheckpointReader  # noqa: E402
from bam_surgery.runtime.config import ModelConfig  # noqa: E402
from bam_surgery.runtime.model import Model  # noqa: E402
from conftest import FAMILY_CASES, LLAMA32_ROPE, hf_specialists, merge_family  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "converters"))  # test_hf_bam_export's folder
from test_hf_bam_export import V, save_word_tokenizer  # noqa: E402

EOS = 2
NEW = 8  # tokens generated per prompt
PROMPTS = [[5, 9, 12], [33, 4, 18, 22, 61, 3, 8, 8, 9, 17, 44], [3 + (7 * i) % (V - 3) for i in range(40)]]
TEXT_PROMPT = [20, 21, 22, 23, 24]
# |vLLM's logprob of the chosen token - the runtime's|, float32 both (measured: at most 1.2e-4; the families 1.9e-5)
LOGPROB_TOL = 1e-3
LOGIT_SPREAD = 3.0  # the families' logits' standard deviation
# the families' embeddings scaled down: random embeddings (std 1) tied to the head make the residual stream's own
# token win every step (one token repeated, logprob 0: nothing to compare); smaller, the blocks decide the next token
EMBED_SCALE = 0.01
MAX_LEN = 128  # the engine's max_model_len (the kinds' max_positions)
START_TIMEOUT = 420  # seconds for the OpenAI server to answer /health
ENGINE_TIMEOUT = 1800  # seconds for vllm_engine.py to serve every model
LLAMA = dict(block="sequential", norm="rmsnorm", activation="swiglu", n_kv_heads=2)
BTX = dict(LLAMA, ffn_experts=4, ffn_top_k=2, gate_norm="topk_softmax")
SHARED = dict(LLAMA, ffn_experts=3, ffn_top_k=2, gate_norm="topk_softmax", ffn_shared_hidden=128)
# kind -> (export format, config); the HF BAM kinds between them run every router kind, block style, norm,
# position scheme, bias, KV mode and routing mode of the plugin
KINDS = {
    "dense": ("hf", LLAMA),
    "btx-mixtral": ("mixtral", BTX),
    "btx-bam": ("hf", BTX),
    "shared-expert-qwen2-moe": ("qwen2_moe", SHARED),
    "shared-expert-bam": ("hf", dict(SHARED, router="mlp")),
    # a BTX of Qwen2 models (q/k/v biases, which Mixtral cannot carry) as Qwen2-MoE with an all-zero shared expert
    "btx-qwen2-qwen2-moe": ("qwen2_moe", dict(BTX, qkv_bias=True)),
    # the native formats of the newer families: Qwen3-MoE (per-head QK-norm, YaRN) and FlexOlmo (OLMo 2's post-norms
    # and full-width QK-norm), which vLLM runs with its own model classes
    "btx-qwen3-moe": ("qwen3_moe", dict(BTX, qk_norm="head",
                                        scaled_rope=dict(rope_type="yarn", factor=4.0,
                                                         original_max_position_embeddings=32))),
    "btx-flex-olmo": ("flex_olmo", dict(BTX, qk_norm="full", norm_position="post")),
    # Gemma 4 in vLLM's own model: dense (a Gemma 4 mixture has no native form; its HF BAM export is refused by the
    # plugin in one line), its global layers of twice the head size with one kv head and K = V, proportional RoPE, the
    # last two layers reading the first two's K/V with double-wide MLPs, per-layer inputs. (Qwen3.5 is not here: vLLM
    # 0.32's qwen3_5.py imports its Qwen3-VL vision code, which needs a torchvision this CPU stage has none of.)
    "dense-gemma4": ("hf", dict(n_layers=4, block="sequential", norm="rmsnorm", activation="geglu_tanh", n_kv_heads=2,
                                qk_norm="head", norm_position="sandwich", scale_embeddings=True, attn_scale_dim=1,
                                attn_window=8, attn_window_layers=[0, 2], window_rope_theta=10000.0,
                                rope_theta=1e6, scaled_rope=dict(rope_type="proportional", partial_rotary_factor=0.25),
                                global_head_dim=128, global_kv_heads=1, global_k_eq_v=True, v_norm=True,
                                kv_shared_layers=2, kv_shared_ffn_hidden=512, per_layer_dim=64, layer_scale=True,
                                final_softcap=30.0, tie_embeddings=True)),
    "bam-expert-kv": ("hf", dict(block="parallel", norm="layernorm", activation="swiglu", rotary_fraction=0.5,
                                 n_kv_heads=2, attn_experts=3, ffn_experts=3, ffn_top_k=2, gate_norm="softmax",
                                 tie_embeddings=True, lm_head_bias=True, logit_scale=0.5,
                                 router="expert_embedding", attn_router="linear")),
    "bam-shared-kv": ("hf", dict(block="sequential", norm="rmsnorm", activation="swiglu", rope_interleaved=True,
                                 n_kv_heads=1, qkv_bias=True, o_bias=True, ffn_bias=True, attn_experts=2,
                                 kv_mode="shared", ffn_experts=2, ffn_top_k=1, gate_norm="topk_softmax",
                                 router="key_store", attn_router="attention")),
    # ungated experts through the fused-MoE layer with a constant gate (converters/vllm_bam/model.py MOE_ACTIVATION)
    "bam-gelu-experts": ("hf", dict(block="parallel", norm="layernorm", activation="gelu", attn_experts=2,
                                    ffn_experts=3, ffn_top_k=2, gate_norm="topk_softmax", router="attention")),
    "top2-attention": ("hf", dict(block="parallel_two_norms", norm="layernorm", norm_bias=True, activation="gelu",
                                  position="learned", attn_experts=3, attn_top_k=2, router="mlp",
                                  final_norm=False)),
    # what no family has: a full-width QK-norm of LayerNorms with biases on shared K/V (the query heads of the
    # experts interleaved) with top-k attention, a logit scale beside the final soft-cap, Gemma's GeGLU experts with a
    # shared expert
    "bam-trunk-corners": ("hf", dict(block="sequential", norm="layernorm", norm_bias=True, activation="geglu_tanh",
                                     qk_norm="full", norm_position="post", n_kv_heads=2, kv_mode="shared",
                                     attn_experts=3, attn_top_k=2,
                                     ffn_experts=3, ffn_top_k=2, gate_norm="topk_softmax", ffn_shared_hidden=64,
                                     logit_scale=0.5, final_softcap=4.0, attn_softcap=20.0, attn_window=6,
                                     attn_window_layers=[1], window_rope_theta=100.0, nope_layers=[0],
                                     scaled_rope=dict(rope_type="linear", factor=2.0), attn_scale_dim=32)),
    # a merge, not random weights: a fine-grained upcycle of a dense Llama (16 experts of a quarter of the FFN width,
    # 8 per token) through the plugin's fused-MoE layer, which must compute the dense seed (MERGED)
    "fine-grained-upcycle": ("hf", LLAMA),
}
MERGED = {"fine-grained-upcycle": ("upcycle", dict(ffn_granularity=4, router_std=0.5))}  # recipe, merge options


def merged_model(kind: str, seed: int, folder: Path) -> Model:
    """The merge of MERGED[kind] from a random dense seed, checked to give the seed's greedy tokens (a fresh
    upcycle computes its dense seed, so vLLM must give the seed's tokens too)."""
    from bam_surgery.app.merge import merge
    from bam_surgery.surgery.options import MergeOptions

    dense = random_model(kind, seed)
    save_model(dense, folder / "dense.safetensors")
    recipe, options = MERGED[kind]
    merge([(None, str(folder / "dense.safetensors"))], folder / "mix.safetensors", recipe=recipe,
          options=MergeOptions(**options))
    model = load_model(folder / "mix.safetensors").eval()
    assert [runtime_reference(model, p)[0] for p in PROMPTS] == [runtime_reference(dense, p)[0] for p in PROMPTS]
    return model

# the families (conftest.FAMILY_CASES) at head size 64, the word tokenizer's vocabulary, and RoPE thresholds the
# prompts pass: Llama 3's scaling and YaRN from 32 tokens on; longrope's original length is 48, the longest a
# longrope model is served (support.LENGTHS); the windows are 5 tokens (FAMILY_CASES)
LONG_FACTORS = dict(short_factor=[1.0 + 0.05 * i for i in range(32)], long_factor=[1.0 + 2.5 * i for i in range(32)])
LONGROPE_ORIGINAL = 48
FAMILIES = {
    "llama3.2": dict(max_position_embeddings=128,
                     rope_parameters=dict(LLAMA32_ROPE, original_max_position_embeddings=32)),
    "llama-yarn": dict(max_position_embeddings=128, rope_parameters=dict(
        rope_type="yarn", rope_theta=1000000.0, factor=4.0, original_max_position_embeddings=32)),
    "llama-longrope": dict(max_position_embeddings=128, rope_parameters=dict(
        rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=LONGROPE_ORIGINAL, **LONG_FACTORS)),
    "llama-dynamic": {},  # max_positions 64 (FAMILY_CASES): served as far as that (support.LENGTHS)
    "phi3": dict(max_position_embeddings=128, original_max_position_embeddings=LONGROPE_ORIGINAL,
                 rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, **LONG_FACTORS)),
    "qwen3": {}, "gemma2": {}, "gemma3": {}, "mistral-window": {}, "qwen2-window": {}, "olmo2": {}, "olmo3": {},
    "smollm3": {},
    "granite": dict(max_position_embeddings=128,
                    rope_parameters=dict(LLAMA32_ROPE, original_max_position_embeddings=32)),
    # the queries' scale by position steps at every 32 tokens (the YaRN original length), so the prompts pass it
    "ministral3": dict(max_position_embeddings=128, rope_parameters=dict(
        rope_type="yarn", rope_theta=1000000.0, factor=16.0, original_max_position_embeddings=32, beta_fast=32.0,
        beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0, llama_4_scaling_beta=0.1)),
    "exaone4": dict(max_position_embeddings=128,
                    rope_parameters=dict(LLAMA32_ROPE, original_max_position_embeddings=32)),
}
RECIPES = ("bam", "bam-shared-kv")
KEEP = {"bam": lambda name: False,  # what the specialists share with the seed (tests/surgery/test_merge_families.py)
        "bam-shared-kv": lambda name: any(f".attn.{p}." in name for p in ("k", "v", "k_norm"))}
SERVER_MODEL = "gemma3/bam"
DENSE_ARCH = {"dense": "llama", "dense-gemma4": "gemma4_text"}  # the dense kinds, through vLLM's own models
# name -> (the engine's max_model_len, the one line it refuses the model with)
REFUSALS = {"llama-longrope/bam past its original length": (
    MAX_LEN, "scaled_rope longrope at max_model_len 128, past original_max_position_embeddings=48")}
# models served again by two tensor-parallel ranks (vLLM's CPU backend, one worker process and core each): the
# experts' interleaved query heads split across ranks, a full-width QK-norm's statistics summed across them
# (bam-trunk-corners), the one kv head replicated on both (Gemma 3's)
TENSOR_PARALLEL = {f"{name} at tensor parallel size 2": name for name in ("bam-trunk-corners", "gemma3/bam-shared-kv")}


def family_models() -> dict[str, tuple[str, str]]:
    """name -> (family case, recipe)."""
    return {f"{case}/{recipe}": (case, recipe) for case in FAMILIES for recipe in RECIPES}


def random_model(kind: str, seed: int) -> Model:
    """Random weights with spread-out logits; routers scaled up so routing is far from uniform."""
    cfg = ModelConfig(**{**dict(vocab_size=V, d_model=256, n_layers=2, n_heads=4, head_dim=64, ffn_hidden=256,
                            max_positions=MAX_LEN, name=kind), **KINDS[kind][1]})
    model = Model(cfg)
    model.reset_parameters(std=0.2, seed=seed)
    return decisive_routers(model, seed)


def decisive_routers(model: Model, seed: int) -> Model:
    """Every router's parameters drawn at std 0.5 (temperatures 0.05), so that routing is far from uniform."""
    gen = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("log_temperature"):
                p.fill_(math.log(0.05))
            elif "router" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return model.eval()


def family_mixture(case: str, recipe: str, folder: Path) -> Model:
    """The recipe's merge (defaults: the seed and two specialists) of FAMILY_CASES[case] at head size 64 and the word
    tokenizer's vocabulary, with decisive routers, embeddings times EMBED_SCALE and logits of spread LOGIT_SPREAD
    (the final norm's scale)."""
    hf = dict(vocab_size=V, hidden_size=256, num_attention_heads=4, **FAMILIES[case])
    if "head_dim" in FAMILY_CASES[case][1]:
        hf["head_dim"] = 64
    paths = hf_specialists(folder / "hf", case, keep=KEEP[recipe], **hf)
    merge_family(paths, folder / "merged.safetensors", "--recipe", recipe)
    model = decisive_routers(load_model(folder / "merged.safetensors"), list(FAMILIES).index(case))
    with torch.no_grad():
        model.embed.weight.mul_(EMBED_SCALE)
        k = LOGIT_SPREAD / model(torch.tensor([PROMPTS[-1]])).logits.std().item()
        w = model.final_norm.weight
        w.copy_((1 + w) * k - 1 if model.config.norm_unit_offset else w * k)
    return model


def runtime_reference(model: Model, prompt: list[int]) -> tuple[list[int], list[float]]:
    """runtime.generate's greedy tokens and the log-softmax of each under the runtime's forward pass."""
    new = generate(model, torch.tensor([prompt]), NEW)[0].tolist()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + new])).logits[0, len(prompt) - 1:-1].double()
    return new, logits.log_softmax(-1).gather(1, torch.tensor(new)[:, None])[:, 0].tolist()


def export(model: Model, fmt: str, folder: Path, tokenizer_files) -> Path:
    save_model(model, folder / "canonical.safetensors")
    with CheckpointReader(folder / "canonical.safetensors") as reader:
        if fmt in ("llama", "gemma4_text"):  # a dense model as its HF architecture, the tokenizer from its folder
            return save_hf(reader, folder / "export", fmt, tokenizer_files=tokenizer_files)
        return exporter(fmt).write(reader, folder / "export", ExportOptions(
            tokenizer_files=tokenizer_files, generation={"eos_token_id": EOS, "pad_token_id": 1}))


def _text(tokens: list[int]) -> str:
    return " ".join(f"w{i}" if i > 2 else ("<unk>", "<pad>", "</s>")[i] for i in tokens)


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    save_word_tokenizer(folder)
    return tuple(sorted(folder.iterdir()))


@pytest.fixture(scope="module")
def models(tokenizer_files, tmp_path_factory) -> dict[str, dict]:
    """name -> {"dir": the export, "max_len", "expected": the runtime's (tokens, logprobs) per prompt, "text": the
    runtime's tokens for TEXT_PROMPT}, for every kind and every family's merges."""
    out = {}
    built = [(kind, KINDS[kind][0], lambda kind=kind: merged_model(
        kind, list(KINDS).index(kind), tmp_path_factory.mktemp(kind)) if kind in MERGED else random_model(
        kind, seed=list(KINDS).index(kind))) for kind in KINDS]
    built += [(name, "hf", lambda case=case, recipe=recipe, name=name: family_mixture(
        case, recipe, tmp_path_factory.mktemp(name.replace("/", "-"))))
              for name, (case, recipe) in family_models().items()]
    for name, fmt, build in built:
        model = build()
        folder = tmp_path_factory.mktemp(name.replace("/", "-") + "-export")
        out[name] = {"dir": str(export(model, DENSE_ARCH.get(name, fmt), folder, tokenizer_files)),
                     "max_len": min(MAX_LEN, model.config.max_positions),
                     "expected": [runtime_reference(model, p) for p in PROMPTS],
                     "text": runtime_reference(model, TEXT_PROMPT)[0]}
        if name.split("/")[0] in ("llama-longrope", "phi3"):
            out[name]["max_len"] = LONGROPE_ORIGINAL
    return out


@pytest.fixture(scope="module")
def served(models, tmp_path_factory) -> dict[str, dict]:
    """vllm_engine.py's results for every model (and REFUSALS), one engine at a time in one process."""
    folder = tmp_path_factory.mktemp("engine")
    jobs = [dict(name=name, dir=m["dir"], max_model_len=m["max_len"], new=NEW, prompts=PROMPTS,
                 text=" ".join(f"w{i}" for i in TEXT_PROMPT)) for name, m in models.items()]
    jobs += [dict(name=name, dir=models[name.split(" ")[0]]["dir"], max_model_len=max_len, new=NEW, prompts=PROMPTS,
                  text=None) for name, (max_len, _) in REFUSALS.items()]
    jobs += [dict(name=name, dir=models[model]["dir"], max_model_len=models[model]["max_len"], new=NEW, prompts=PROMPTS,
                  text=None, tensor_parallel_size=2) for name, model in TENSOR_PARALLEL.items()]
    (folder / "jobs.json").write_text(json.dumps(jobs))
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1")
    log = folder / "engine.log"
    started = time.monotonic()
    with log.open("w") as f:
        engine = [sys.executable, str(Path(__file__).with_name("vllm_engine.py")), str(folder / "jobs.json"),
                  str(folder / "results.json")]
        done = subprocess.run(engine, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=ENGINE_TIMEOUT, cwd=folder)
    assert done.returncode == 0 and (folder / "results.json").is_file(), log.read_text()[-4000:]
    results = json.loads((folder / "results.json").read_text())
    print(f"\nvllm_engine.py: {len(jobs)} models in {time.monotonic() - started:.0f} s; per model (start, generate "
          "s): " + ", ".join(f"{n} {r.get('start_s')}/{r.get('generate_s')}" for n, r in results.items()))
    return results


def _check(name: str, expected: dict, got: dict, logprob_tol: float = LOGPROB_TOL) -> float:
    assert "error" not in got, (name, got["error"])
    worst = 0.0
    for prompt, (tokens, logprobs), new, got_logprobs in zip(PROMPTS, expected["expected"], got["tokens"],
                                                               got["logprobs"]):
        assert new == tokens, (name, len(prompt), new, tokens)
        worst = max(worst, max(abs(a - b) for a, b in zip(got_logprobs, logprobs)))
    assert worst <= logprob_tol, (name, worst)
    return worst


@pytest.mark.parametrize("name", list(KINDS) + list(family_models()))
def test_vllm_serves_the_runtimes_tokens(name, models, served):
    worst = _check(name, models[name], served[name])
    assert served[name]["text_tokens"] == models[name]["text"], name
    assert served[name]["text"].split() == _text(models[name]["text"]).split(), name
    print(f"{name}: greedy tokens equal, logprobs within {worst:.2e}")


@pytest.mark.parametrize("name", list(TENSOR_PARALLEL))
def test_tensor_parallel_ranks_serve_the_runtimes_tokens(name, models, served):
    worst = _check(name, models[TENSOR_PARALLEL[name]], served[name])
    print(f"{name}: greedy tokens equal, logprobs within {worst:.2e}")


@pytest.mark.parametrize("name", list(REFUSALS))
def test_what_vllm_cannot_serve_is_refused_in_one_line(name, served):
    error = served[name].get("error", "")
    assert REFUSALS[name][1] in error and "\n" not in error, (name, served[name])


# ---- vLLM's OpenAI server (what `vllm serve` runs) -------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())


class Server:
    """vLLM's OpenAI-compatible server (what `vllm serve` runs) for DIR on 127.0.0.1, stopped (its process group)
    on exit."""

    def __init__(self, model_dir: str, log: Path, max_len: int):
        self.port, self.log = _free_port(), log
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1")
        # vllm-cpu's `vllm` command looks up the version of a distribution named vllm and stops; its server module
        # is the same server
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--host", "127.0.0.1",
               "--port", str(self.port), "--dtype", "float32", "--enforce-eager", "--max-model-len", str(max_len),
               "--seed", "0", "--served-model-name", "bam"]
        self.proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

    def __enter__(self) -> "Server":
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"vllm serve exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5):
                    return self
            except OSError:
                time.sleep(2)
        pytest.fail(f"vllm serve did not answer within {START_TIMEOUT} s:\n{self.log.read_text()[-3000:]}")

    def complete(self, prompt, **extra) -> dict:
        return _post(f"http://127.0.0.1:{self.port}/v1/completions",
                     {"model": "bam", "prompt": prompt, "max_tokens": NEW, "temperature": 0, "ignore_eos": True,
                      "skip_special_tokens": False, **extra})

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)


def test_the_openai_server_serves_the_runtimes_tokens(models, tmp_path):
    expected = models[SERVER_MODEL]
    with Server(expected["dir"], tmp_path / "serve.log", expected["max_len"]) as server:
        batch = server.complete(PROMPTS, logprobs=0, return_token_ids=True)
        text = server.complete(" ".join(f"w{i}" for i in TEXT_PROMPT))
    choices = sorted(batch["choices"], key=lambda c: c["index"])
    got = {"tokens": [c["token_ids"] for c in choices], "logprobs": [c["logprobs"]["token_logprobs"] for c in choices]}
    worst = _check(SERVER_MODEL, expected, got)
    assert text["choices"][0]["text"].split() == _text(expected["text"]).split(), (text, expected["text"])
    print(f"vllm serve {SERVER_MODEL}: greedy tokens equal, logprobs within {worst:.2e}")
