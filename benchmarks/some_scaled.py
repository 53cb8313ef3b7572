"""The SoME experiment at CPU size (docs/routers.md, "key store: the SoME experiment"): the some-E presets' shape
rules (sequential blocks, LayerNorm with bias, biases everywhere, untied head, no final norm, a non-gated GELU FFN
expert of width 2 * d_model in every layer, top-4 through a key-store router at temperature 0.8, alpha 0.01,
beta 0.005, delta 0.001, theta_percentile 0.05, ema_decay 0.99, experts frozen) with fewer layers and less width,
trained on the repository's domain corpus at byte level. After each "epoch" (a quarter of the run: the seed's
runs evaluate after each of 4 epochs over a fixed subset) the held-out loss and perplexity over all domains, and
the Gini coefficient, usage entropy and experts used of the middle layer's router on the held-out tokens, printed
the way the seed's logs show them.

    nice .venv/bin/python -m benchmarks.some_scaled --experts 64 --out some-runs

Not a speed benchmark: it reports quality numbers; its wall time depends on the machine.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from bam_surgery.runtime import preset
from bam_surgery.train import TrainConfig, evaluate, train
from bam_surgery.train.checkpoints import list_checkpoints
from bam_surgery.train.metrics import entropy_bits, gini

ROOT = Path(__file__).resolve().parents[1]
DOMAINS = ",".join(f"{d}={ROOT}/data/domains/{d}" for d in ("code", "general", "law", "math"))


def model_config(experts: int, d_model: int, layers: int, heads: int, seq_len: int):
    return preset("some-64", vocab_size=256, d_model=d_model, n_layers=layers, n_heads=heads,
                  ffn_hidden=2 * d_model, max_positions=seq_len, ffn_experts=experts, name=f"some-{experts}-cpu")


def middle_layer(report, layer: int, experts: int) -> dict:
    """Pooled over the domains: assignment counts of layers.{layer}.ffn_router on the held-out tokens."""
    counts = torch.zeros(experts, dtype=torch.float64)
    loss_sum, tokens = 0.0, 0
    for dom in report.domains.values():
        r = dom.routing[f"layers.{layer}.ffn_router"]
        counts += torch.tensor(r["usage"], dtype=torch.float64) * r["tokens"]
        loss_sum += dom.loss * dom.tokens
        tokens += dom.tokens
    loss = loss_sum / tokens
    return {"val_loss": loss, "val_perplexity": math.exp(loss), "gini": gini(counts), "entropy": entropy_bits(counts),
            "max_entropy": math.log2(experts), "used": int((counts > 0).sum()), "experts": experts, "tokens": tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", type=int, default=64, help="FFN experts per layer (the seed: 64 to 512).")
    ap.add_argument("--d-model", type=int, default=128, help="Model width (the seed: 512).")
    ap.add_argument("--layers", type=int, default=4, help="Blocks (the seed: 10); the middle one is layers // 2.")
    ap.add_argument("--heads", type=int, default=4, help="Attention heads (the seed: 8).")
    ap.add_argument("--seq-len", type=int, default=128, help="Tokens per sequence (the seed: 768).")
    ap.add_argument("--batch", type=int, default=16, help="Sequences per optimizer step (the seed: 32).")
    ap.add_argument("--steps", type=int, default=400, help="Optimizer steps, split into 4 epochs.")
    ap.add_argument("--lr", type=float, default=2e-3, help="Peak learning rate (the seed: 6e-4 over 1248 steps).")
    ap.add_argument("--eval-tokens", type=int, default=32768, help="Held-out tokens per domain at each epoch.")
    ap.add_argument("--threads", type=int, default=1, help="Torch intra-op threads.")
    ap.add_argument("--out", default="some-runs", help="Folder for the run and its results JSON.")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = model_config(args.experts, args.d_model, args.layers, args.heads, args.seq_len)
    cfg_path = out / f"some-{args.experts}.json"
    cfg_path.write_text(cfg.to_json())
    epoch = args.steps // 4
    run = out / f"run-{args.experts}"
    t0, c0 = time.perf_counter(), time.process_time()
    train(TrainConfig(model_config=str(cfg_path), data=DOMAINS, out=str(run), steps=4 * epoch,
                      warmup_steps=max(1, epoch // 5), lr=args.lr, seq_len=args.seq_len, micro_batch=args.batch,
                      batch_tokens=args.batch * args.seq_len, save_every=epoch, keep_last=4, eval_every=-1,
                      trainable=["*", "!ffn_experts"], token_cache=str(out / "tokens"), progress=False, plot=False,
                      device="cpu", seed=0))
    train_s, train_cpu = time.perf_counter() - t0, time.process_time() - c0
    train_losses = [json.loads(line) for line in open(run / "metrics.jsonl")]
    results = []
    for step, path in list_checkpoints(run):
        report = evaluate(str(path), DOMAINS, max_tokens=args.eval_tokens, token_cache=out / "tokens", device="cpu",
                          batch_size=args.batch)
        m = middle_layer(report, args.layers // 2, args.experts)
        window = [r["loss"] for r in train_losses if r.get("kind") == "train" and step - epoch < r["step"] <= step]
        m.update(epoch=step // epoch, step=step, train_loss=sum(window) / len(window))
        results.append(m)
        print(f"Epoch {m['epoch']} (step {step}): train loss {m['train_loss']:.4f}, val loss {m['val_loss']:.4f}, "
              f"val perplexity {m['val_perplexity']:.2f}; middle layer (layer {args.layers // 2}): "
              f"Gini {m['gini']:.3f}, entropy {m['entropy']:.3f} of {m['max_entropy']:.0f} bits, "
              f"{m['used']}/{args.experts} used", flush=True)
    body = {"args": vars(args), "config": cfg.to_dict(), "train_wall_s": round(train_s, 1),
            "train_cpu_s": round(train_cpu, 1), "epochs": results}
    (out / f"results-{args.experts}.json").write_text(json.dumps(body, indent=2) + "\n")
    print(f"training: {train_s:.0f} s wall, {train_cpu:.0f} s CPU; {out / f'results-{args.experts}.json'}")


if __name__ == "__main__":
    main()
