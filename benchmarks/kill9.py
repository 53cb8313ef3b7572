"""kill -9 a merge at random points and check the invariant of atomic outputs.

    python -m benchmarks.kill9 --trials 20 [--work bench-out/kill9] [--layers 4] [--seed 0]

Makes a seed and two experts (canonical files, a few MB), runs one merge to completion for the
reference bytes (merges are deterministic), then, per trial, starts the same merge in a fresh
process, kills it with SIGKILL after a random delay (uniform from the moment the reference run's work
folder appeared to the end of that run, so kills land while writing and around the final
rename), and checks:

* OUT is absent, or complete: byte-identical to the reference (every file of a folder output);
* the killed run's work folder may remain; the next run on the same OUT (run to completion right
  after) removes it, and leaves no `.partial` debris and an OUT identical to the reference.

Outputs alternate between a single file and a sharded folder. Prints one line per trial and a
summary; exits 1 if any trial broke the invariant. tests/surgery/test_kill9.py runs a quick version.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

MERGE = [sys.executable, "-m", "bam_surgery", "merge", "--quiet"]


def make_inputs(work: Path, layers: int) -> list[Path]:
    import torch

    from bam_surgery.runtime.checkpoint import save_checkpoint
    from bam_surgery.runtime.config import ModelConfig
    from bam_surgery.runtime.layout import tensor_shapes

    cfg = ModelConfig(vocab_size=2048, d_model=256, n_layers=layers, n_heads=4, ffn_hidden=512, name="kill9")
    gen = torch.Generator().manual_seed(0)
    base = {n: torch.randn(s, generator=gen) / 16 for n, s in tensor_shapes(cfg).items()}
    paths = []
    for i, name in enumerate(("seed", "code", "math")):
        state = {n: t + 0.01 * i * torch.randn(t.shape, generator=gen) for n, t in base.items()}
        paths.append(save_checkpoint(state, cfg, work / "in" / f"{name}.safetensors"))
    return paths


def merge_args(inputs: list[Path], out: Path) -> list[str]:
    args = [*MERGE, "--seed", str(inputs[0]), "--experts", ",".join(map(str, inputs[1:])), "--out", str(out)]
    return args if out.suffix == ".safetensors" else [*args, "--max-shard-size", "200KB"]


def digest(path: Path) -> dict[str, str]:
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {str(p.relative_to(path.parent)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def debris(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".partial"))


def run_trials(work: Path, trials: int, layers: int = 4, seed: int = 0, log=print) -> list[str]:
    """Run the trials; return the list of invariant violations (empty: all held)."""
    rng = random.Random(seed)
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    inputs = make_inputs(work, layers)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    reference, window = {}, {}
    for kind in ("file", "folder"):
        out = work / "ref" / ("mix.safetensors" if kind == "file" else "mix")
        out.parent.mkdir(exist_ok=True)
        start, writing = time.perf_counter(), None
        proc = subprocess.Popen(merge_args(inputs, out), env=env)
        while proc.poll() is None:  # when does the work folder appear (start-up and planning are over)?
            if writing is None and debris(out.parent):
                writing = time.perf_counter() - start
            time.sleep(0.005)
        if proc.returncode != 0:
            raise SystemExit(f"the reference merge failed ({proc.returncode})")
        end = time.perf_counter() - start
        window[kind] = (writing if writing is not None else 0.0, end)
        reference[kind] = {k.split("/", 1)[-1]: v for k, v in digest(out).items()}
    problems: list[str] = []
    outcomes = {"absent": 0, "complete": 0}
    for trial in range(trials):
        kind = ("file", "folder")[trial % 2]
        folder = work / f"trial{trial}"
        folder.mkdir()
        out = folder / ("mix.safetensors" if kind == "file" else "mix")
        delay = rng.uniform(window[kind][0], window[kind][1] * 1.05)
        proc = subprocess.Popen(merge_args(inputs, out), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()

        def same() -> bool:
            return {k.split("/", 1)[-1]: v for k, v in digest(out).items()} == reference[kind]

        if os.path.lexists(out):
            state = "complete" if same() else "BROKEN"
        else:
            state = "absent"
        if state == "BROKEN":
            problems.append(f"trial {trial}: {out} exists but differs from the reference")
        else:
            outcomes[state] += 1
        left = debris(folder)
        # the next run on the same OUT: cleans up and completes (with --force if the killed run finished)
        nxt = subprocess.run(merge_args(inputs, out) + (["--force"] if os.path.lexists(out) else []), env=env,
                             capture_output=True, text=True)
        if nxt.returncode != 0:
            problems.append(f"trial {trial}: the next run failed: {nxt.stderr.strip()}")
        elif debris(folder) or not same():
            problems.append(f"trial {trial}: after the next run: debris {debris(folder)}, complete={same()}")
        log(f"trial {trial:3d}  {kind:6}  killed after {delay:5.2f}s  OUT {state:8}  work folder left: "
            f"{'yes' if left else 'no '}  next run: {'ok' if nxt.returncode == 0 else 'FAILED'}")
        shutil.rmtree(folder, ignore_errors=True)
    log(f"{trials} trials: OUT absent {outcomes['absent']}, complete {outcomes['complete']}, "
        f"invariant broken {len(problems)}")
    return problems


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=20, help="Merges to kill.")
    ap.add_argument("--work", type=Path, default=Path("bench-out/kill9"), help="Scratch folder (emptied first).")
    ap.add_argument("--layers", type=int, default=8, help="Layers of the generated models (longer runs: more).")
    ap.add_argument("--seed", type=int, default=0, help="Seed of the random kill delays.")
    args = ap.parse_args()
    problems = run_trials(args.work, args.trials, args.layers, args.seed)
    for p in problems:
        print(p, file=sys.stderr)
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
