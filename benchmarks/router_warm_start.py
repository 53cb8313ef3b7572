"""Expert-embedding warm starts on the repository's domain corpus: how long the calibration stage takes and
how each domain's held-out tokens are routed before any training.

    .venv/bin/python -m benchmarks.router_warm_start --work-dir bench-routers

Inputs: the `make demo` family (preset "tiny": D 64, 2 layers, vocab 256 with the byte tokenizer; a seed
and three branches code, law, math = seed + 2% noise), merged with the bam recipe and expert_embedding
routers: random, --router-init domain-mean and --router-init profile, calibration data/domains (train
splits, --calibration-tokens per domain). For each merge: wall time of the merge command, and per router
the share of each domain's validation tokens (data/domains/*/val, the first --eval-tokens) whose top-1
expert is the domain's own expert (general -> the seed, expert 0; code 1, law 2, math 3). The branches are
random perturbations, not trained specialists, so profile has little to find here; domain-mean's shares
show what the warm start does with real text.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from click.testing import CliRunner

from bam_surgery.runtime import load_model
from bam_surgery.cli.commands import cli
from bam_surgery.cli.demo import DOMAINS, build_dense
from bam_surgery.train.data import open_source, parse_data_spec
from bam_surgery.train.tokenize import ByteTokenizer, tokenize_source

ROOT = Path(__file__).resolve().parents[1]
ORDER = ("general", *DOMAINS)  # expert e's domain


def corpus() -> str:
    return ",".join(f"{d}={ROOT / 'data' / 'domains' / d}" for d in ORDER)


def own_expert_shares(model, cache: Path, eval_tokens: int, T: int = 128) -> dict[str, dict[str, float]]:
    """router -> domain -> share of the domain's validation tokens whose top-1 expert is its own."""
    out: dict[str, dict[str, float]] = {}
    tok = ByteTokenizer(None)
    for e, dom in enumerate(parse_data_spec(corpus())):
        stream = tokenize_source(open_source(dom, "val"), tok, cache).tokens
        ids = torch.from_numpy(stream[:eval_tokens].astype("int64"))
        ids = ids[: len(ids) // T * T].view(-1, T)
        with torch.no_grad():
            routing = model(ids).routing
        for name, r in routing.items():
            out.setdefault(name, {})[dom.name] = float((r.probs.argmax(-1) == e).float().mean())
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work-dir", default="bench-routers", help="Folder for the checkpoints and the token cache.")
    ap.add_argument("--calibration-tokens", type=int, default=8192, help="Calibration tokens per domain.")
    ap.add_argument("--eval-tokens", type=int, default=16384, help="Validation tokens per domain for the shares.")
    args = ap.parse_args(argv)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    cache = work / "tokens"
    seed, experts = build_dense(work)
    specs = ",".join(f"{d}={p}" for d, p in zip(DOMAINS, experts))
    print(f"calibration: {corpus()}, {args.calibration_tokens} tokens per domain; eval: first {args.eval_tokens} "
          "validation tokens per domain")
    for init in ("random", "domain-mean", "profile"):
        out = work / f"mix-{init}.safetensors"
        cmd = ["merge", "--seed", f"general={seed}", "--experts", specs, "--router", "expert_embedding",
               "--router-init", init, "--out", str(out), "--force", "--quiet", "--token-cache", str(cache)]
        if init != "random":
            cmd += ["--calibration", corpus(), "--calibration-tokens", str(args.calibration_tokens)]
        t = time.perf_counter()
        res = CliRunner().invoke(cli, cmd, catch_exceptions=False)
        wall = time.perf_counter() - t
        assert res.exit_code == 0, res.output
        shares = own_expert_shares(load_model(out), cache, args.eval_tokens)
        print(f"\n{init}: merge {wall:.2f} s")
        print(f"  {'router':<22}" + "".join(f"{d:>9}" for d in ORDER))
        for name, by_dom in shares.items():
            print(f"  {name:<22}" + "".join(f"{by_dom[d]:>9.3f}" for d in ORDER))


if __name__ == "__main__":
    main()
