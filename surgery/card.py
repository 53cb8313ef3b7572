"""Model cards (README.md) for exported directories (a merge's: `model_card`; any other export's, e.g. `convert
--format hf`: `conversion_card`), and tokenizer checks across inputs."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from bam_surgery import __version__
from bam_surgery.converters.hf.architectures import ARCHITECTURES
from bam_surgery.converters.hf.families import NATIVE_MIXTURES
from bam_surgery.converters.hf.files import GENERATION_CONFIG, check_token_ids, side_file
from bam_surgery.converters.hf.writer import TOKEN_ID_KEYS
from bam_surgery.converters.hf_bam import schema_bam
from bam_surgery.runtime.config import ModelConfig
from bam_surgery.runtime.jsonfile import read_json
from bam_surgery.runtime.reader import Reader
from bam_surgery.runtime.text import render_table
from bam_surgery.train.data import file_sha256

from .audit import audit
from .errors import InputError
from .inspect import describe_kind, key_config, parse_provenance, render_audit
from .plan import Plan

# Files whose content defines the token <-> id mapping (the rest: special tokens, chat templates).
_VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt")

# the native HF mixture formats (converters/hf/families.py NATIVE_MIXTURES: mixtral, qwen2_moe, ...): format -> class
NATIVE = {f.model_type: f.hf_class for f in NATIVE_MIXTURES}
HF_FORMATS = ("hf", *NATIVE)  # the formats whose folder carries the card as README.md
LOAD_SNIPPETS = {
    "native": ("from transformers import AutoModelForCausalLM, AutoTokenizer\n"
               "model = AutoModelForCausalLM.from_pretrained(\"{out}\")   # {hf_class}, no remote code\n"
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
    "native": f"transformers' own {{hf_class}} (vLLM serves it too); checked with transformers {_TESTED}.",
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


def _load(fmt: str, cfg: ModelConfig, out: str) -> str:
    """The card's Load section: how transformers loads the folder, and what it needs."""
    key = "native" if fmt in NATIVE else ("hf-mixture" if cfg.is_mixture else "hf-dense")
    text = f"```python\n{LOAD_SNIPPETS[key].format(out=out, hf_class=NATIVE.get(fmt))}\n```\n"
    return text + ("" if key not in REQUIRES else "\nRequires " + REQUIRES[key].format(hf_class=NATIVE.get(fmt)) + "\n")


def format_note(fmt: str, cfg: ModelConfig) -> str:
    """What a native format writes beyond the model's own tensors: the q/k/v biases or shared expert its architecture
    always has, as zeros that add nothing (converters/native_moe.py)."""
    if fmt not in NATIVE:
        return ""
    arch = ARCHITECTURES[fmt].config
    zeros = [what for what, missing in (("q/k/v biases", arch.qkv_bias_always and not cfg.qkv_bias),
                                         ("a shared expert", arch.shared_expert and not cfg.ffn_shared_hidden))
             if missing]
    return (f" {ARCHITECTURES[fmt].stands_for}'s layout has {' and '.join(zeros)}, which this model has "
            "not: written as zeros, which add exactly nothing, so the folder computes the model's own function."
            if zeros else "")


def conversion_card(reader: Reader, fmt: str, out: str, source: str | None = None) -> str:
    """README.md of an export that is not a merge's (convert, export of a trained run): what the model is, where it
    came from (the source, and the merge and training records it carries), its config, parameters and how to load
    it."""
    cfg = reader.config
    prov = parse_provenance(dict(reader.metadata))
    made = ""
    if prov is not None and prov.fields is not None and prov.recipe:
        names = ", ".join(f"{i.get('name', '?')} (`{i.get('path', i.get('spec', '?'))}`)" for i in prov.inputs)
        made = f" Merged by bam-surgery with recipe **{prov.recipe}** from {names or 'its inputs'}"
        made += f", then trained in {len(prov.training)} run(s)." if prov.training else "."
    kind = "mixture-of-experts" if cfg.is_mixture else "dense"
    rows = [(k, "-" if v is None else v) for k, v in key_config(cfg).items()]
    exact = audit(cfg, "exact")
    return f"""---
library_name: transformers
tags: [bam-surgery, {kind}]
---
# {Path(out).name}

Written by **bam-surgery** {__version__} as the `{fmt}` format from
`{source or reader.path or 'a checkpoint'}`.{made}{format_note(fmt, cfg)}

Model: {describe_kind(cfg)}.

## Config

```
{render_table(("field", "value"), rows, left=2)}
```

## Parameters

```
{render_audit(exact, "this model")}
```

Total {exact.total:,}, active per token {exact.active:,}.

## Load

{_load(fmt, cfg, out)}"""


def model_card(plan: Plan, fmt: str, out: str) -> str:
    cfg = plan.config
    inputs = "\n".join(f"| {i.index} | {i.name} | {i.role} | `{i.label}` |" for i in plan.inputs)
    opts = "\n".join(f"- `{k}`: {v}" for k, v in plan.resolved_options().items())
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
+ {cfg.z_coef} * router z-loss; `bam-surgery train`).{_untrained_note(cfg)}{format_note(fmt, cfg)}

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

{_load(fmt, cfg, out)}"""
