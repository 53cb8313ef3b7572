"""Merge benchmark: wall time and peak memory of `bam-surgery merge`, next to the I/O floor measured in
the same run, and next to mergekit-moe on the same Hugging Face inputs.

    .venv/bin/python -m benchmarks.merge --sizes 1b,0.5b --recipes btx,bam --work-dir bench-out

Inputs, per size: a seed and three specialists (seed + a small seeded perturbation), Llama-shaped
(sequential blocks, RMSNorm, SwiGLU, RoPE, GQA), bf16, random. They are generated tensor by tensor
with runtime.checkpoint.SafetensorsStreamWriter (four writers open at once, one tensor in memory),
and reused on the next run if a marker file says they match. Sizes (LLAMA_SIZES): 1b is
TinyLlama-1.1B's shape; 0.5b is the same tensors with fewer layers, so a merge engine whose memory
is bounded by one tensor uses the same peak memory at both sizes.

Measured steps, each in a child process, one at a time:
    merge   python -m bam_surgery merge --recipe R --seed seed --experts a,b,c --out OUT.safetensors
    floor   python -m benchmarks.floor: read every input byte, write as many bytes as the merge's
            output, fsync (no merge can beat a plain copy on the same disk)
    (part B, unless --skip-mergekit)
    mergekit-moe  on HF LlamaForCausalLM copies of the same inputs, gate_mode random, bf16
    ours          merge --recipe btx --format mixtral (when the CLI has --format) on the same HF dirs
Before each step the page cache is dropped (sync; echo 3 > /proc/sys/vm/drop_caches) when that is
allowed (root), so every step starts cold; otherwise (or with --warm) each step's inputs are read
once beforehand so every step starts warm. The cache state is in the report.

Reported per step (benchmarks/measure.py): wall time; peak RSS = the child's ru_maxrss (the
kernel's high-water mark); the peaks of its anonymous and file-backed resident memory (a 20 Hz
sampler of /proc/PID/status: file-backed pages are mmapped checkpoint pages, anonymous ones the
process's own tensors); its CPU time; and the CPU time other processes used during the step (from
/proc/stat), to show whether the machine was quiet. With --repeat N every step runs N times,
interleaved, and the report shows the median time and the largest RSS.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `python benchmarks/merge.py` as well as `python -m benchmarks.merge`
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bam_surgery.runtime.checkpoint import CONFIG_KEY, FORMAT, CheckpointReader  # noqa: E402
from bam_surgery.runtime.safetensors_file import SafetensorsStreamWriter  # noqa: E402
from bam_surgery.runtime.config import ModelConfig  # noqa: E402
from bam_surgery.runtime.layout import tensor_shapes  # noqa: E402

from benchmarks.measure import Step, can_drop_caches, files_under, measure, total_bytes  # noqa: E402

# ---- inputs -------------------------------------------------------------------------------------
# TinyLlama-1.1B's shape: V 32000, D 2048, 22 layers, 32 heads of 64, 4 KV heads, F 5632, untied head.
LLAMA_SHAPE = dict(vocab_size=32000, d_model=2048, n_heads=32, n_kv_heads=4, ffn_hidden=5632,
                   activation="swiglu", norm="rmsnorm", norm_eps=1e-5, position="rope", rope_theta=10000.0,
                   max_positions=2048, block="sequential", tie_embeddings=False)
# size label -> n_layers: 1,100,048,384 / 483,428,352 / 175,118,336 parameters (smoke: a quick check of the script)
LLAMA_SIZES = {"1b": 22, "0.5b": 8, "smoke": 1}
DENSE_NAMES = ("seed", "code", "law", "math")  # the seed first, then the specialists
DTYPE = torch.bfloat16
WEIGHT_STD = 0.02  # seed weights ~ normal(0, 0.02); norms are 1
BRANCH_STD = 0.002  # specialist = seed + normal(0, 0.002): a ~10% relative distance, like continued training
GENERATOR_VERSION = 1  # bump when generation changes, so cached inputs are regenerated


def llama_config(size: str) -> ModelConfig:
    if size not in LLAMA_SIZES:
        raise SystemExit(f"--sizes: unknown size {size!r}; choose from {', '.join(LLAMA_SIZES)}")
    return ModelConfig(n_layers=LLAMA_SIZES[size], name=f"llama-{size}-bench", **LLAMA_SHAPE)


def n_params(cfg: ModelConfig) -> int:
    total = 0
    for shape in tensor_shapes(cfg).values():
        n = 1
        for s in shape:
            n *= s
        total += n
    return total


def _generator(name: str, model: int) -> torch.Generator:
    # seeded by tensor name and model index, so every tensor is reproducible on its own
    return torch.Generator().manual_seed(zlib.crc32(name.encode()) * 16 + model)


def seed_tensor(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=DTYPE)
    return torch.randn(shape, generator=_generator(name, 0), dtype=DTYPE).mul_(WEIGHT_STD)


def generate_dense(directory: Path, cfg: ModelConfig) -> list[Path]:
    """The seed and the specialists as canonical .safetensors files, written in one streamed pass."""
    paths = [directory / f"{n}.safetensors" for n in DENSE_NAMES]
    marker = directory / "inputs.json"
    stamp = {"generator": GENERATOR_VERSION, "config": cfg.to_dict(), "files": [p.name for p in paths]}
    if marker.exists() and json.loads(marker.read_text()) == stamp and all(p.exists() for p in paths):
        return paths
    directory.mkdir(parents=True, exist_ok=True)
    marker.unlink(missing_ok=True)
    shapes = tensor_shapes(cfg)
    entries = [(n, s, DTYPE) for n, s in shapes.items()]
    meta = {"format": FORMAT, CONFIG_KEY: cfg.to_json()}
    writers = [SafetensorsStreamWriter(p, entries, dict(meta, bench_model=DENSE_NAMES[i])) for i, p in enumerate(paths)]
    for name, shape in shapes.items():  # one tensor (plus one perturbation) in memory at a time
        seed = seed_tensor(name, shape)
        writers[0].write(name, seed)
        for m, w in enumerate(writers[1:], start=1):
            delta = torch.randn(shape, generator=_generator(name, m), dtype=DTYPE).mul_(BRANCH_STD)
            w.write(name, delta.add_(seed))
            del delta
        del seed
    for w in writers:
        w.close()
    marker.write_text(json.dumps(stamp, indent=1))
    return paths


def write_tokenizer(directory: Path) -> Path:
    """A tiny word-level tokenizer (mergekit-moe loads the base model's tokenizer even for random gates)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    directory.mkdir(parents=True, exist_ok=True)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for w in "the a of code law math seed model merge expert".split():
        vocab[w] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
         "unk_token": "<unk>", "model_max_length": 2048}, indent=1))
    (directory / "config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    return directory


def generate_hf(dense: list[Path], directory: Path) -> list[Path]:
    """HF LlamaForCausalLM copies of the canonical inputs (same values), via converters.hf.save_hf."""
    from bam_surgery.converters.hf import save_hf
    out = [directory / p.stem for p in dense]
    marker = directory / "inputs.json"
    stamp = {"from": [p.name for p in dense], "mtimes": [p.stat().st_mtime_ns for p in dense]}
    if marker.exists() and json.loads(marker.read_text()) == stamp and all(d.is_dir() for d in out):
        return out
    marker.unlink(missing_ok=True)
    tokenizer = write_tokenizer(directory / "tokenizer")
    for src, dst in zip(dense, out):
        with CheckpointReader(src) as reader:
            save_hf(reader, dst, "llama", tokenizer_files=[tokenizer / "tokenizer.json", tokenizer / "tokenizer_config.json"],
                    generation={"bos_token_id": 1, "eos_token_id": 2})
    marker.write_text(json.dumps(stamp, indent=1))
    return out


# ---- the commands -------------------------------------------------------------------------------
def merge_help() -> str:
    return subprocess.run([sys.executable, "-m", "bam_surgery", "merge", "--help"], cwd=REPO,
                          capture_output=True, text=True).stdout


def merge_cmd(recipe: str, inputs: list[Path], out: Path, extra: list[str] = ()) -> list[str]:
    return [sys.executable, "-m", "bam_surgery", "merge", "--recipe", recipe, "--seed", str(inputs[0]),
            "--experts", ",".join(str(p) for p in inputs[1:]), "--out", str(out), "--force", *extra]


def floor_cmd(inputs: list[Path], out: Path, n_bytes: int) -> list[str]:
    return [sys.executable, "-m", "benchmarks.floor", str(out), str(n_bytes),
            *[str(f) for p in inputs for f in files_under(p)]]


MERGEKIT_TORCH = "torch==2.13.0"  # first, so mergekit's resolver keeps this CPU build


def mergekit_venv(venv: Path) -> Path:
    """A virtualenv with mergekit (created on first use): torch pinned first, then mergekit."""
    exe = venv / "bin" / "mergekit-moe"
    if exe.exists():
        return exe
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, MERGEKIT_TORCH], check=True)
    subprocess.run([*pip, "mergekit"], check=True)
    return exe


def mergekit_versions(venv: Path) -> str:
    code = ("import importlib.metadata as m; "
            "print(', '.join(f'{p} {m.version(p)}' for p in ('mergekit', 'torch', 'transformers', 'safetensors')))")
    return subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True).stdout.strip()


def mergekit_config(hf_inputs: list[Path], path: Path, top_k: int) -> Path:
    """mergekit-moe YAML: the seed as base model and expert 0, random gates, bf16."""
    lines = [f"base_model: {hf_inputs[0]}", "gate_mode: random", "dtype: bfloat16",
             f"experts_per_token: {top_k}", "experts:"]
    for p in hf_inputs:
        lines += [f"  - source_model: {p}", "    positive_prompts:", f"      - \"{p.name}\""]
    path.write_text("\n".join(lines) + "\n")
    return path


# ---- the run ------------------------------------------------------------------------------------
@dataclass
class Run:
    date: str
    machine: str
    command: str
    cache: str
    code: str  # the commit measured, and whether the engine's files had uncommitted changes
    steps: list[Step] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def machine_line() -> str:
    mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (f"{os.cpu_count()} CPU cores ({cpu}), {mem_gb:.1f} GB RAM, Linux {platform.release()}, "
            f"Python {platform.python_version()}, torch {torch.__version__}")


def code_line() -> str:
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True).stdout.strip()
    commit = git("rev-parse", "--short", "HEAD") or "unknown commit"
    dirty = git("status", "--porcelain", "--", "surgery", "runtime", "converters", "recipes")
    return f"commit {commit}" + (f" + uncommitted changes in {len(dirty.splitlines())} engine file(s)" if dirty else "")


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def timed(run: Run, step: Step, inputs: list[Path], output: Path, log: Path) -> Step:
    """Measure one step, record the size of what it wrote, then delete that output."""
    s = measure(step, inputs, log, run.cache == "cold")
    s.bytes_out = total_bytes([output])
    _remove(output)
    run.steps.append(s)
    report_step(s)
    return s


def digest_cache(work: Path) -> Path:
    """The merges' caches ($BAM_SURGERY_CACHE, set by main: the input digests among them), emptied before every
    merge step: a repeated merge would otherwise reuse its inputs' digests and not hash at all."""
    return work / "bam-surgery-cache"


def bench_size(size: str, recipes: list[str], work: Path, run: Run, args) -> None:
    cfg = llama_config(size)
    root = work / size
    t = time.perf_counter()
    dense = generate_dense(root / "dense", cfg)
    print(f"[{size}] inputs ready: 4 x {n_params(cfg):,} params, {total_bytes(dense) / 1e9:.2f} GB "
          f"({time.perf_counter() - t:.0f} s)", flush=True)
    out = root / "out"
    logs = root / "logs"
    out.mkdir(parents=True, exist_ok=True)
    logs.mkdir(parents=True, exist_ok=True)

    # part A: merge vs floor, interleaved so slow drifts of the disk hit both alike
    for rep in range(args.repeat):
        for recipe in recipes:
            merged = out / f"{recipe}.safetensors"
            _remove(digest_cache(work))  # every merge hashes its inputs from scratch: the first-time cost
            s = timed(run, Step(size, "merge", recipe, merge_cmd(recipe, dense, merged), run.cache), dense,
                      merged, logs / f"merge-{recipe}-{rep}.log")
            if s.rc:
                continue
            copy = out / "floor.bin"
            timed(run, Step(size, "floor", recipe, floor_cmd(dense, copy, s.bytes_out), run.cache), dense,
                  copy, logs / f"floor-{recipe}-{rep}.log")

    if args.skip_mergekit:
        return
    # part B: mergekit-moe vs ours, on the same HF directories
    exe = mergekit_venv(work / "mergekit-venv")
    if not any("mergekit" in n for n in run.notes):
        run.notes.append(f"mergekit venv: {mergekit_versions(work / 'mergekit-venv')}")
    t = time.perf_counter()
    hf = generate_hf(dense, root / "hf")
    print(f"[{size}] HF inputs ready ({time.perf_counter() - t:.0f} s)", flush=True)
    top_k = 2
    yaml_path = mergekit_config(hf, root / "mergekit-moe.yml", top_k)
    has_format = "--format" in merge_help()
    ours = out / ("ours-mixtral" if has_format else "ours-btx.safetensors")
    ours_extra = ["--ffn-top-k", str(top_k), "--gate-norm", "topk_softmax"]
    ours_note = "btx, top-2, topk_softmax"
    if has_format:
        ours_extra += ["--format", "mixtral"]
        ours_note += ", --format mixtral"
    else:
        ours_note += ", canonical output (this CLI has no --format yet)"
    variants = [("mergekit-moe", [str(exe), str(yaml_path), str(out / "mergekit-moe"), "--lazy-unpickle"],
                 out / "mergekit-moe", "defaults + --lazy-unpickle (5B out-shard-size)"),
                ("mergekit-moe 1B shards", [str(exe), str(yaml_path), str(out / "mergekit-moe"), "--lazy-unpickle",
                                            "--out-shard-size", "1B"],
                 out / "mergekit-moe", "--lazy-unpickle --out-shard-size 1B"),
                ("bam-surgery", merge_cmd("btx", hf, ours, ours_extra), ours, ours_note)]
    for rep in range(args.repeat):
        for label, cmd, target, note in variants:
            timed(run, Step(size, label, "btx", cmd, run.cache, note=note), hf, target,
                  logs / f"{label.replace(' ', '-')}-{rep}.log")


def report_step(s: Step) -> None:
    status = "ok" if not s.rc else f"FAILED (rc {s.rc}, log {s.log})"
    print(f"  [{s.size}] {s.step:<24} {s.recipe:<4} {s.wall_s:8.1f} s  peak RSS {s.peak_rss_mb:8.0f} MB "
          f"(anon {s.peak_anon_mb:.0f}, file {s.peak_file_mb:.0f})  cpu {s.cpu_s:.0f} s  "
          f"other cpu {s.other_cpu_s:.0f} s  {status}", flush=True)


# ---- report -------------------------------------------------------------------------------------
@dataclass
class Summary:
    """All repetitions of one (size, step, recipe): median time, worst memory."""
    size: str
    step: str
    recipe: str
    note: str
    runs: int
    failed: int
    wall_s: float  # median
    wall_min: float
    wall_max: float
    peak_rss_mb: float  # max
    peak_anon_mb: float
    peak_file_mb: float
    cpu_s: float  # median
    other_cpu_s: float  # max
    bytes_in: int
    bytes_out: int


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    n = len(xs)
    return 0.0 if not n else xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def summarize(run: Run) -> list[Summary]:
    groups: dict[tuple[str, str, str], list[Step]] = {}
    for s in run.steps:
        groups.setdefault((s.size, s.step, s.recipe), []).append(s)
    out = []
    for (size, step, recipe), steps in groups.items():
        ok = [s for s in steps if not s.rc] or steps
        walls = [s.wall_s for s in ok]
        out.append(Summary(size, step, recipe, steps[0].note.split("; FAILED")[0], len(steps),
                           sum(1 for s in steps if s.rc), _median(walls), min(walls), max(walls),
                           max(s.peak_rss_mb for s in ok), max(s.peak_anon_mb for s in ok),
                           max(s.peak_file_mb for s in ok), _median([s.cpu_s for s in ok]),
                           max(s.other_cpu_s for s in ok), ok[0].bytes_in, ok[0].bytes_out))
    return out


def _wall(s: Summary) -> str:
    return f"{s.wall_s:.1f}" if s.runs == 1 else f"{s.wall_s:.1f} ({s.wall_min:.1f}-{s.wall_max:.1f})"


def markdown(run: Run) -> str:
    rows = summarize(run)
    find = {(r.size, r.step, r.recipe): r for r in rows}
    reps = max((r.runs for r in rows), default=1)
    out = [f"date: {run.date}  ", f"machine: {run.machine}  ", f"code: {run.code}  ",
           f"page cache: {run.cache} before every step; "
           + ("one run per step" if reps == 1 else f"{reps} runs per step: median wall time (min-max), "
              "largest peak RSS"), "", f"command: `{run.command}`", ""]
    out += ["| size | recipe | step | wall s | x floor | peak RSS MB | anon / file-backed MB | CPU s | "
            "other CPU s | GB in | GB out |", "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r.step not in ("merge", "floor"):
            continue
        floor = find.get((r.size, "floor", r.recipe))
        ratio = f"{r.wall_s / floor.wall_s:.2f}" if floor and floor.wall_s and r.failed < r.runs else ""
        out.append(f"| {r.size} | {r.recipe} | {r.step}{f' ({r.failed} FAILED)' if r.failed else ''} | {_wall(r)} | "
                   f"{ratio} | {r.peak_rss_mb:,.0f} | {r.peak_anon_mb:,.0f} / {r.peak_file_mb:,.0f} | "
                   f"{r.cpu_s:.0f} | {r.other_cpu_s:.0f} | {r.bytes_in / 1e9:.2f} | {r.bytes_out / 1e9:.2f} |")
    others = [r for r in rows if r.step not in ("merge", "floor")]
    if others:
        out += ["", "| size | tool | options | wall s | peak RSS MB | anon / file-backed MB | CPU s | other CPU s | "
                "GB out | time / mergekit-moe | peak RSS / mergekit-moe |",
                "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in others:
            ref = find.get((r.size, "mergekit-moe", "btx"))
            usable = ref and ref.failed < ref.runs and r.failed < r.runs
            t_ratio = f"{r.wall_s / ref.wall_s:.2f}" if usable and ref.wall_s else ""
            m_ratio = f"{r.peak_rss_mb / ref.peak_rss_mb:.2f}" if usable and ref.peak_rss_mb else ""
            out.append(f"| {r.size} | {r.step}{f' ({r.failed} FAILED)' if r.failed else ''} | {r.note} | {_wall(r)} | "
                       f"{r.peak_rss_mb:,.0f} | {r.peak_anon_mb:,.0f} / {r.peak_file_mb:,.0f} | {r.cpu_s:.0f} | "
                       f"{r.other_cpu_s:.0f} | {r.bytes_out / 1e9:.2f} | {t_ratio} | {m_ratio} |")
    if run.notes:
        out += [""] + [f"- {n}" for n in run.notes]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1b,0.5b", help=f"comma-separated sizes: {', '.join(LLAMA_SIZES)}")
    ap.add_argument("--recipes", default="btx,bam", help="comma-separated recipes to time against the floor")
    ap.add_argument("--work-dir", default="bench-out", help="inputs, outputs, logs and results go here")
    ap.add_argument("--skip-mergekit", action="store_true", help="skip the mergekit-moe comparison (part B)")
    ap.add_argument("--keep", action="store_true",
                    help="keep the generated inputs (reused by the next run); default: delete them at the end")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run every measured step N times (interleaved); report the median time and the largest RSS")
    ap.add_argument("--warm", action="store_true",
                    help="warm page cache before every step instead of dropping it (cold is the default when allowed)")
    args = ap.parse_args(argv)
    work = Path(args.work_dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    os.environ["BAM_SURGERY_CACHE"] = str(digest_cache(work))  # inherited by every measured step
    cold = not args.warm and can_drop_caches()
    run = Run(date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"), machine=machine_line(),
              command=" ".join([".venv/bin/python -m benchmarks.merge", *(argv if argv is not None else sys.argv[1:])]),
              cache="cold" if cold else "warm", code=code_line())
    if not args.warm and not cold:
        run.notes.append("page cache could not be dropped (not root?): steps run warm (inputs pre-read)")
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    for size in sizes:
        llama_config(size)  # fail early on an unknown size
    try:
        for size in sizes:
            bench_size(size, recipes, work, run, args)
    finally:
        results = work / f"results-{time.strftime('%Y%m%d-%H%M%S')}.json"
        results.write_text(json.dumps(asdict(run), indent=1))
        text = markdown(run)
        (results.with_suffix(".md")).write_text(text + "\n")
        print("\n" + text)
        if not args.keep:
            for size in sizes:
                shutil.rmtree(work / size, ignore_errors=True)
    if any(s.rc for s in run.steps):
        sys.exit(1)


if __name__ == "__main__":
    main()
