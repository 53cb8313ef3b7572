"""The model card (README.md) written into every run checkpoint."""
from __future__ import annotations

from typing import Any

from bam_surgery.runtime.config import ModelConfig


def _kind(cfg: ModelConfig) -> str:
    if not cfg.is_mixture:
        return "dense"
    parts = []
    if cfg.ffn_experts:
        parts.append(f"{cfg.ffn_experts} FFN experts (top-{cfg.ffn_top_k}, gates {cfg.gate_norm})")
    if cfg.attn_experts:
        routing = "soft routing" if cfg.attn_top_k is None else f"top-{cfg.attn_top_k}"
        parts.append(f"{cfg.attn_experts} attention experts ({routing}, KV {cfg.kv_mode})")
    return "mixture: " + ", ".join(parts)


def model_card(cfg: ModelConfig, run: dict[str, Any], step: int, tokens: int, loss: float | None,
               last_eval: dict[str, Any] | None, experts: dict[str, list[str]], path: str) -> str:
    lines = [f"# {cfg.name or 'model'}, step {step}", "",
             f"Trained with **bam-surgery train** from `{run['init']['spec']}`: {_kind(cfg)}.", ""]
    for kind, label in (("ffn", "FFN experts"), ("attn", "Attention experts")):
        if experts.get(kind):
            lines.append(f"- {label}: " + ", ".join(f"{e} `{n}`" for e, n in enumerate(experts[kind])))
    lines += [f"- Steps: {step:,} ({tokens:,} tokens), sequence length {run['seq_len']}, "
              f"{run['world_size']} process(es), strategy {run['strategy']}",
              "- Data: " + ", ".join(f"{d['domain']} {d['weight']:.3g}" for d in run["data"]),
              f"- Tokenizer: {run['tokenizer']['name']}"]
    if run["tokenizer"].get("eos_reason"):
        lines.append(f"- Document separator: {run['tokenizer']['eos_reason']}")
    if loss is not None:
        lines.append(f"- Training loss at this step: {loss:.4f}")
    if last_eval:
        lines += ["", f"## Held-out evaluation (step {last_eval['step']})", "",
                  "| domain | tokens | loss | perplexity |", "|---|---|---|---|"]
        for name, r in last_eval["domains"].items():
            lines.append(f"| {name} | {r['tokens']:,} | {r['loss']:.4f} | {r['perplexity']:.3f} |")
    lines += ["", "## Load", "", "```python", "from bam_surgery.runtime import load_model",
              f'model = load_model("{path}")', "```", "",
              "The training configuration, data hashes and the init checkpoint's provenance are in the "
              "checkpoint metadata (`bam-surgery inspect` shows them).", ""]
    return "\n".join(lines)
