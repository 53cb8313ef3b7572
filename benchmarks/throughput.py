"""Training throughput of a pipeline's models on a device, for its time-matched setting (pipeline/spec.py): the
tokens/s of one training step of every mixture of the pipeline and of its dense seed, at the pipeline's shapes (or
at another pipeline's, `--shapes-of`, e.g. paper-small's on a GPU), written as the JSON file
`stages.train.throughput` reads.

    .venv/bin/python -m benchmarks.throughput paper-shape-time --device cuda --compile \\
        --shapes-of paper-small --out benchmarks/results/throughput-h200.json
    .venv/bin/python -m benchmarks.throughput tiny-upcycling --device cpu --steps 3 --out bench-out/throughput.json

Each model: random init (the merge's config of each mixture, built from the pipeline's seed config, or from
`--shapes-of` PRESET's dense config with the mixture's options), AdamW, the pipeline's micro-batch and sequence
length (with --shapes-of a preset: --batch and --seq, default 8 x 1024); median step time of --steps timed steps after
--warmup (benchmarks/profile_train.py's step: fp32 master weights, bf16 autocast on CUDA; --compile: torch.compile and
fused AdamW). The file holds {source, device, tokens_per_s: {dense, MIXTURE...}}; only the ratios matter to the
pipeline. The step times are printed. Timing on a busy machine is what it is: run it on the device the comparison is about, alone.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from benchmarks.profile_train import step_fn, timed


def configs(pipeline: str, shapes_of: str | None):
    """{name: ModelConfig} of the dense model and every mixture of the pipeline."""
    from bam_surgery.pipeline.schema import load_pipeline
    from bam_surgery.runtime.config import preset
    from bam_surgery.surgery.recipe import mixture_config

    spec = load_pipeline(pipeline, check_data=False)
    dense = spec.dense_config if shapes_of is None else preset(shapes_of)
    out = {"dense": dense}
    for mix in spec.mixtures:
        members = (len(spec.domains) if mix.recipe.max_experts != 0 else 0) + (
            1 if mix.options.resolved("seed_expert", mix.recipe) else 0)
        out[mix.name] = mixture_config(mix.recipe, dense, members, mix.options)
    return spec, out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pipeline", help="a shipped pipeline's name or a pipeline file")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--shapes-of", metavar="PRESET", help="time the models at this preset's shapes instead")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--compile", action="store_true", help="torch.compile the model, fused AdamW")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    import torch

    from bam_surgery.runtime import Model

    spec, cfgs = configs(args.pipeline, args.shapes_of)
    B, T = (args.batch, args.seq) if args.shapes_of else (spec.knobs.get("micro_batch", 8), spec.seq_len)
    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    device_name = torch.cuda.get_device_name() if cuda else "cpu"
    tps = {}
    for name, cfg in cfgs.items():
        torch.manual_seed(0)
        model = Model(cfg.replace(max_positions=max(cfg.max_positions, T))).to(args.device)
        run_model = torch.compile(model) if args.compile else model
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True if args.compile else None)
        tokens = torch.randint(0, cfg.vocab_size, (B, T + 1), generator=torch.Generator().manual_seed(1))
        times = timed(step_fn(run_model, optimizer, tokens.to(args.device), args.device, cuda), sync, args.warmup,
                      args.steps)
        tps[name] = B * T / statistics.median(times)
        print(f"{name:20s} {tps[name]:12,.0f} tokens/s", flush=True)
        del model, run_model, optimizer
    shapes = f"{args.shapes_of} shapes, {B} x {T} tokens" if args.shapes_of else f"{spec.name}'s shapes, {B} x {T}"
    record = {"source": f"benchmarks/throughput.py on {device_name}, {shapes}, "
                        f"{'compiled' if args.compile else 'eager'} training step, median of {args.steps}, "
                        f"{time.strftime('%Y-%m-%d')}",
              "device": device_name, "tokens_per_s": tps}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
