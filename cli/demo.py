"""`make demo`: the whole job on an embedded toy, no downloads.

1. branch: a tiny seed model (paper-small's architecture at toy size, preset "tiny") and three
   specialists branched from it. Continued pre-training is simulated by a small seeded perturbation
   of every weight, so the specialists differ from the seed and from each other the way real
   branches do (relative distance ~1-2%).
2. save and reload each dense checkpoint, print parameter counts and a forward pass.
3. mix: merge them with the bam recipe, inspect the result, count its parameters, run it.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from bam_surgery.runtime import ForcedRouting, Model, load_model, preset, save_model

from .commands import cli

DOMAINS = ("code", "law", "math")


def build_dense(out: Path) -> tuple[Path, list[Path]]:
    cfg = preset("tiny")
    torch.manual_seed(0)
    seed = Model(cfg)
    seed.reset_parameters(seed=0)
    seed_path = save_model(seed, out / "seed.safetensors", metadata={"demo": "seed"})
    paths = []
    for i, domain in enumerate(DOMAINS):
        gen = torch.Generator().manual_seed(100 + i)
        state = {k: v + 0.02 * v.abs().mean() * torch.randn(v.shape, generator=gen)
                 for k, v in seed.state_dict().items()}
        branch = Model(cfg)
        branch.load_state_dict(state)
        paths.append(save_model(branch, out / f"{domain}.safetensors", metadata={"demo": domain}))
    return seed_path, paths


def show_dense(paths: list[Path], tokens: torch.Tensor) -> None:
    print(f"{'checkpoint':<22}{'params':>12}  logits[0, -1, :4]")
    for p in paths:
        m = load_model(p)
        n = sum(t.numel() for t in m.parameters())
        with torch.no_grad():
            logits = m(tokens).logits
        print(f"{p.name:<22}{n:>12,}  {[round(x, 4) for x in logits[0, -1, :4].tolist()]}")


def run_cli(args: list[str], title: str) -> None:
    print(f"\n== {title} ==\n$ bam-surgery {' '.join(args)}")
    cli.main(args=args, prog_name="bam-surgery", standalone_mode=False)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="demo-out", help="directory for the demo's checkpoints")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tokens = torch.arange(16).view(1, 16) % preset("tiny").vocab_size

    print("== 1-2. branch: a seed and three specialists, saved and reloaded ==")
    seed_path, expert_paths = build_dense(out)
    show_dense([seed_path, *expert_paths], tokens)

    mix = out / "mix.safetensors"
    experts = ",".join(str(p) for p in expert_paths)
    run_cli(["merge", "--seed", str(seed_path), "--experts", experts, "--recipe", "bam", "--out", str(mix),
             "--force", "--quiet"], "3. mix: BAM (expert KV), the seed joins as expert 0")
    run_cli(["inspect", str(mix)], "inspect the mixture")
    run_cli(["count-params", str(mix)], "count its parameters")
    run_cli(["count-params", "--preset", "paper-small", "--recipe", "bam", "--experts", "4",
             "--convention", "paper"], "the paper's 590M setup (top-1 FFN routing), counted as in its Table 5")

    print("\n== forward pass of the mixture ==")
    model = load_model(mix)
    with torch.no_grad():
        out_mix = model(tokens, targets=tokens.roll(-1, dims=1))
        print(f"logits {tuple(out_mix.logits.shape)}; nll {out_mix.nll.item():.4f}, load balancing "
              f"{out_mix.lb_loss.item():.4f}, z-loss {out_mix.z_loss.item():.4f}, total {out_mix.loss.item():.4f}")
        for i, p in enumerate([seed_path, *expert_paths]):
            forced = model(tokens, routing=ForcedRouting(expert=i)).logits
            dense = load_model(p)(tokens).logits
            print(f"forced to expert {i} ({p.stem:>4}): max |logits - dense {p.stem} logits| = "
                  f"{(forced - dense).abs().max().item():.2e}  (norms and embeddings are averaged, so not 0)")


if __name__ == "__main__":
    main()
