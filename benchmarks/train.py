"""Training benchmark: tokens/s of `bam-surgery train` on CPU for small mixtures, the share of step
time spent waiting for data, and transformers' MixtralForCausalLM trained by a plain loop on the same
batches as the Mixtral-shaped peer.

    .venv/bin/python -m benchmarks.train --steps 30 --skip 5 --work-dir bench-out/train

Models (byte-level vocabulary 256, RoPE, SwiGLU, fp32 on CPU), all d_model D, L layers, E experts:
    bam      the paper's BAM: parallel block, LayerNorm, E FFN experts top-1 with softmax gates and E
             attention experts with soft routing (expert K/V)
    btx      Mixtral-shaped: sequential block, RMSNorm, E FFN experts top-2 (renormalized gates), dense
             attention; trained by `bam-surgery train` (the train API, as the CLI runs it)
    mixtral  transformers MixtralForCausalLM of the btx shape, same batches (drawn by the same sampler
             from the same token files), AdamW with the same settings and schedule, gradient clipping, its own
             load-balancing loss (router_aux_loss_coef = alpha); a plain loop: forward, backward, clip,
             step, zero_grad
Data: the repository's corpus (data/domains/*/train.txt.gz), four domains, equal weights.
Reported: median tokens/s over the steps after the first --skip (warm-up), and for ours the share of
the measured step time spent fetching batches (metrics.jsonl data_s / step_s; target < 5%). The
z-loss weight is 0 for btx so the two losses match term for term.

No GPU part runs here: with a CUDA device, pass --device cuda to time paper-small shapes yourself
(--d-model 1024 --layers 6 --heads 8 --ffn 2048 --seq-len 2048); MFU is then in metrics.jsonl.
"""
from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "data" / "domains"
DATA = ",".join(f"{d}={CORPUS}/{d}" for d in ("code", "law", "math", "general"))


def model_configs(a):
    from bam_surgery.runtime import ModelConfig

    common = dict(vocab_size=256, d_model=a.d_model, n_layers=a.layers, n_heads=a.heads, ffn_hidden=a.ffn,
                  max_positions=a.seq_len, activation="swiglu", position="rope")
    bam = ModelConfig(**common, norm="layernorm", block="parallel", ffn_experts=a.experts, ffn_top_k=1,
                      gate_norm="softmax", attn_experts=a.experts, name="bench-bam")
    btx = ModelConfig(**common, norm="rmsnorm", block="sequential", ffn_experts=a.experts, ffn_top_k=2,
                      gate_norm="topk_softmax", name="bench-btx")
    return {"bam": bam, "btx": btx}


def run_ours(name, cfg, a, work: Path) -> dict:
    from bam_surgery.runtime import Model, save_model
    from bam_surgery.train import TrainConfig, train

    model = Model(cfg)
    model.reset_parameters(seed=0)
    init = save_model(model, work / f"{name}.safetensors")
    out = work / f"run-{name}"
    shutil.rmtree(out, ignore_errors=True)
    tc = TrainConfig(init=str(init), data=DATA, out=str(out), steps=a.steps, warmup_steps=5, lr=3e-4,
                     seq_len=a.seq_len, micro_batch=a.micro_batch, save_every=0, eval_every=-1,
                     token_cache=str(work / "cache"), progress=False, plot=False, device=a.device,
                     z_coef=0.0 if name == "btx" else None)
    t0 = time.perf_counter()
    res = train(tc, log=lambda m: None)
    wall = time.perf_counter() - t0
    recs = [r for r in map(json.loads, open(out / "metrics.jsonl")) if r["kind"] == "train"][a.skip:]
    step_s = sum(r["step_s"] for r in recs)
    return {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in recs),
            "data_share": sum(r["data_s"] for r in recs) / step_s, "final_loss": res.loss,
            "wall_s_incl_setup_and_eval": round(wall, 1), "steps": a.steps}


def run_mixtral(cfg, a, work: Path) -> dict:
    """MixtralForCausalLM of cfg's shape, plain loop, on the batches our sampler draws."""
    from transformers import MixtralConfig, MixtralForCausalLM

    from bam_surgery.train import TrainConfig
    from bam_surgery.train.data import open_source, parse_data_spec
    from bam_surgery.train.optim import lr_at
    from bam_surgery.train.packing import MixtureSampler
    from bam_surgery.train.tokenize import ByteTokenizer, tokenize_source

    hf = MixtralConfig(vocab_size=256, hidden_size=cfg.d_model, intermediate_size=cfg.ffn_hidden,
                       num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
                       num_key_value_heads=cfg.n_kv_heads, num_local_experts=cfg.ffn_experts,
                       num_experts_per_tok=cfg.ffn_top_k, max_position_embeddings=cfg.max_positions,
                       rope_theta=cfg.rope_theta, rms_norm_eps=cfg.norm_eps, router_aux_loss_coef=cfg.lb_coef,
                       output_router_logits=True, tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    device = torch.device("cuda" if a.device == "cuda" else "cpu")
    model = MixtralForCausalLM(hf).to(device).train()
    domains = parse_data_spec(DATA)
    tok = ByteTokenizer()
    streams = [tokenize_source(open_source(d, "train"), tok, work / "cache").tokens for d in domains]
    sampler = MixtureSampler(streams, [d.weight for d in domains], a.seq_len, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    schedule = TrainConfig(steps=a.steps, warmup_steps=5, lr=3e-4)  # the same warm-up and cosine as ours
    rates, data_s, step_s = [], 0.0, 0.0
    for step in range(a.steps):
        t0 = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = lr_at(step + 1, schedule)
        batch = sampler.batch(sampler.draw(a.micro_batch))
        inputs, targets = batch.inputs.to(device), batch.targets.to(device)
        t1 = time.perf_counter()
        # our targets are already shifted (labels= would shift again): NLL here, plus Mixtral's own
        # load-balancing loss, which it returns with output_router_logits=True
        out = model(input_ids=inputs)
        loss = torch.nn.functional.cross_entropy(out.logits.float().reshape(-1, 256), targets.reshape(-1))
        loss = loss + hf.router_aux_loss_coef * out.aux_loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        t2 = time.perf_counter()
        if step >= a.skip:
            rates.append(a.micro_batch * a.seq_len / (t2 - t0))
            data_s += t1 - t0
            step_s += t2 - t0
    return {"tokens_per_s": statistics.median(rates), "data_share": data_s / step_s, "final_loss": float(loss.detach()),
            "steps": a.steps}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--skip", type=int, default=5, help="warm-up steps left out of the medians")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--only", default="bam,btx,mixtral", help="comma-separated subset of bam,btx,mixtral")
    p.add_argument("--work-dir", default="bench-out/train")
    a = p.parse_args()
    work = Path(a.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    cfgs = model_configs(a)
    results = {}
    for name in a.only.split(","):
        runner = run_mixtral if name == "mixtral" else run_ours
        results[name] = runner(cfgs["btx"], a, work) if name == "mixtral" else runner(name, cfgs[name], a, work)
        print(name, json.dumps(results[name]), flush=True)
    meta = {"machine": platform.processor() or platform.machine(), "cpus": torch.get_num_threads(),
            "torch": torch.__version__, "args": vars(a)}
    (work / "results.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    print("\n| model | tokens/s (median) | data wait share | final loss |\n|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['tokens_per_s']:,.0f} | {100 * r['data_share']:.2f}% | {r['final_loss']:.3f} |")


if __name__ == "__main__":
    main()
