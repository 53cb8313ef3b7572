"""Model cards (README.md) for exported directories, and tokenizer checks across inputs."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from bam_surgery.converters.hf.files import GENERATION_CONFIG, check_token_ids, side_file
from bam_surgery.converters.hf.writer import TOKEN_ID_KEYS
from bam_surgery.converters.hf_bam import schema_bam
from bam_surgery.runtime.jsonfile import read_json
from bam_surgery.runtime.reader import Reader
from bam_surgery.train.data import file_sha256

from .audit import audit
from .errors import InputError
from .inspect import render_audit
from .plan import Plan

# Files whose content defines the token <-> id mapping (the rest: special tokens, chat templates).
_VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt")

LOAD_SNIPPETS = {
    "mixtral": ("from transformers import AutoModelForCausalLM, AutoTokenizer\n"
                "model = AutoModelForCausalLM.from_pretrained(\"{out}\")   # MixtralForCausalLM\n"
                "tokenizer = AutoTokenizer.from_pretrained(\"{out}\")"),
    "hf-mixture": ("from transformers import AutoModelForCausalLM, AutoTokenizer\n"
                   "model = AutoModelForCausalLM.from_pretrained(\"{out}\", trust_remote_code=True)\n"
                   "tokenizer = AutoTokenizer.from_pretrained(\"{out}\", trust_remote_code=True)\n"
                   "# lm-eval: lm_eval --model hf --model_args pretrained={out},trust_remote_code=True ..."),
    "hf-dense": ("from transformers import AutoModelForCausalLM\n"
                 "model = AutoModelForCausalLM.from_pretrained(\"{out}\")"),
}
_TESTED = ", ".join(schema_bam.TRANSFORMERS_TESTED)
REQUIRES = {
    "mixtral": f"transformers' own MixtralForCausalLM; checked with transformers {_TESTED}.",
    "hf-mixture": (f"transformers {schema_bam.TRANSFORMERS_RANGE} (checked with {_TESTED}); the remote code refuses "
                   "an older one at load time, in one line. It imports only torch and transformers."),
}


def tokenizer_files(reader: Reader) -> list[Path]:
    """The tokenizer files of an HF input (generation_config.json is carried separately: exporters
    write their own, see generation_config)."""
    return [f for f in reader.tokenizer_files() if f.name != GENERATION_CONFIG]


def generation_config(reader: Reader) -> dict:
    """The seed's generation settings: its generation_config.json, else the token ids of its
    config.json (a generation_config.json linking outside the folder is refused, as tokenizer files
    are: converters.hf.files.side_file). Token ids (they also go into the exported config.json) must
    be integers, non-empty lists of integers or null (an empty list was an IndexError in generate); anything else
    is an InputError naming the file and key."""
    gen_file = side_file(reader.source_dir, GENERATION_CONFIG) if reader.source_dir is not None else next(
        (f for f in reader.tokenizer_files() if f.name == GENERATION_CONFIG), None)  # a GGUF's rebuilt one
    if gen_file is not None and gen_file.is_file():
        body = read_json(gen_file, expect=dict)
        where, out = gen_file, {k: v for k, v in body.items() if not k.startswith("_") and k != "transformers_version"}
    else:
        hf = reader.hf_config or {}
        where, out = reader.source_dir / "config.json" if reader.source_dir else "config.json", \
            {k: hf[k] for k in TOKEN_ID_KEYS if hf.get(k) is not None}
    for key, value in out.items():
        if key.endswith("_token_id"):
            check_token_ids(where, key, value, error=InputError)
    return out


def _vocab_digest(files: list[Path]) -> dict[str, str]:
    return {f.name: file_sha256(f) for f in files if f.name in _VOCAB_FILES}


def check_tokenizers(plan: Plan, warn: Callable[[str], None]) -> list[Path]:
    """The seed's tokenizer files (they go into every output). Vocabulary *sizes* must agree (the plan
    already refuses a differing vocab_size, naming the file); same size but different token files
    only warns, since the ids still line up but may mean different strings."""
    seed_files = tokenizer_files(plan.inputs[0].reader)
    seed_digest = _vocab_digest(seed_files)
    for inp in plan.inputs[1:]:
        other = _vocab_digest(tokenizer_files(inp.reader))
        differing = sorted(n for n in seed_digest.keys() & other.keys() if seed_digest[n] != other[n])
        if differing:
            warn(f"{inp.label}: {differing[0]} differs from the seed's ({plan.inputs[0].label}) although the "
                 f"vocabulary size is the same ({plan.config.vocab_size}); token ids may mean different strings")
    return seed_files


def _untrained_note(cfg) -> str:
    """Top-k softmax gates (the paper's) scale each FFN output by ~1/E until the routers learn."""
    if not cfg.ffn_experts or cfg.gate_norm != "softmax":
        return ""
    return (f" Until the routers learn, the softmax gates give each chosen FFN expert about 1/{cfg.ffn_experts} of "
            "its output, so perplexity before training is far above the dense models' (expected).")


def model_card(plan: Plan, fmt: str, out: str) -> str:
    cfg = plan.config
    inputs = "\n".join(f"| {i.index} | {i.name} | {i.role} | `{i.label}` |" for i in plan.inputs)
    opts = "\n".join(f"- `{k}`: {v}" for k, v in plan.resolved_options().items())
    key = "mixtral" if fmt == "mixtral" else ("hf-mixture" if cfg.is_mixture else "hf-dense")
    exact, paper = audit(cfg, "exact"), audit(cfg, "paper")
    return f"""---
library_name: transformers
tags: [mixture-of-experts, bam-surgery, {plan.recipe.name}]
---
# {Path(out).name}

A mixture built by **bam-surgery** with recipe **{plan.recipe.name}** from {len(plan.inputs)} dense
checkpoints: {cfg.ffn_experts} FFN experts (top-{cfg.ffn_top_k}, gates `{cfg.gate_norm}`){
", an always-on shared FFN expert with a sigmoid gate" if cfg.ffn_shared_hidden else ""},
{cfg.attn_experts} attention experts ({"dense attention" if not cfg.attn_experts else
("soft routing" if cfg.attn_top_k is None else f"top-{cfg.attn_top_k} routing") + f", KV {cfg.kv_mode}"}).
Routers are randomly initialized: train the mixture before use (loss: NLL + {cfg.lb_coef} * load balancing
+ {cfg.z_coef} * router z-loss; `bam-surgery train`).{_untrained_note(cfg)}

## Inputs

| # | name | role | checkpoint |
|---|---|---|---|
{inputs}

## Options

{opts}

## Parameters

```
{render_audit(exact, "this model")}
```

Total {exact.total:,}, active per token {exact.active:,} (exact); paper convention (Table 5 of the BAM
paper): total {paper.total:,}, active {paper.active:,}.

## Load

```python
{LOAD_SNIPPETS[key].format(out=out)}
```
{"" if key not in REQUIRES else chr(10) + "Requires " + REQUIRES[key] + chr(10)}"""
