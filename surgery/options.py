"""The options of a merge, declared once: MergeOptions.

Each field carries, in its metadata, everything the other places need to know about it, so that a new merge
option is one field here:

    flag      the `bam-surgery merge` flag (cli/commands.py builds the click option from the field: its help,
              metavar, choices, bounds and default)
    recipe    the recipe key whose value a field left at None takes (`defaults.ffn_top_k`, `routers.std`):
              `recipe_value` reads it, so the plan and the mixture config resolve it in one way
    yaml      the types a pipeline file may give it (pipeline/schema.py offers the fields that have some, under
              the same name, and pipeline/run.py writes them back as flags with `command_args`)
    counts    the option changes what `count-params` counts (the mixture's experts, routing, routers): count-params
              takes these flags as merge does (cli/audit.py), so a count and a merge read the same options

    options = MergeOptions(ffn_top_k=2, router="mlp")
    plan = compile_plan(load_recipe("bam"), readers, options)
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, get_args

from bam_surgery.runtime.config import GATE_NORMS, MAX_EXPERTS, ROUTERS, GateNorm, Router
from bam_surgery.runtime.options import declared

from .errors import BamSurgeryError

if TYPE_CHECKING:  # annotations only (recipe.py imports this module)
    import torch

    from .recipe import Recipe

SharedKVRule = Literal["mean", "seed"]  # how a shared K/V is made
WarmStart = Literal["domain-mean", "profile"]  # merge --router-init besides random (surgery/warm_start.py)
SHARED_KV_RULES, WARM_STARTS = get_args(SharedKVRule), get_args(WarmStart)
ROUTER_INITS = ("random", *WARM_STARTS)  # --router-init: random (no warm start), or a warm start
DTYPES = ("float32", "bfloat16", "float16")


def merge_option(default: Any, flag: str, help: str, *, recipe: str | None = None, yaml: tuple[type, ...] | None = None,
                 counts: bool = False, **flag_attrs: Any) -> Any:
    """A field of MergeOptions with its flag, help sentence and allowed values (runtime/options.py:declared), its
    recipe key, the YAML types a pipeline may give it and whether count-params takes it."""
    return declared(default, flag, help, recipe=recipe, yaml=yaml, counts=counts, **flag_attrs)


def seed_option(flag: str, what: str) -> Any:
    """A MergeOptions field seeding one of the merge's random draws, 0 by default: `what` is drawn from a generator
    per tensor seeded from N and the tensor's own place, so results do not depend on order."""
    return merge_option(0, flag, f"Seed of {what}, so results do not depend on order.", metavar="N",
                        show_default=True, yaml=(int,))


def parse_weights(text: str | None) -> tuple[float, ...] | None:
    """--weights W0,W1,... as numbers."""
    if text is None:
        return None
    try:
        return tuple(float(w) for w in text.split(","))
    except ValueError:
        raise BamSurgeryError(f"--weights: cannot read {text!r}; write comma-separated numbers, e.g. 0.4,0.2,0.2,0.2"
                              ) from None


@dataclass(frozen=True)
class MergeOptions:
    """Every option of a merge, its flag and its recipe default; None means: the recipe's default (or, for
    warm_start, a random router init). The field order is the order of `bam-surgery merge --help`."""

    ffn_top_k: int | None = merge_option(
        None, "--ffn-top-k", counts=True, metavar="K", bounds=(1, MAX_EXPERTS), recipe="defaults.ffn_top_k",
        yaml=(int,),
        help="FFN experts each token is routed to (default: the recipe's: 2 for the shipped recipes, 1 for "
             "btx-shared-expert; the paper's is 1, which count-params --convention paper takes).")
    attention_routing: str | int | None = merge_option(  # soft | topK
        None, "--attention-routing", counts=True, metavar="soft|topK", recipe="defaults.attention_routing",
        yaml=(str, int),
        help="Attention-expert routing: soft (every token to every expert, the paper's choice) or topK, "
             "e.g. top2 (default: the recipe's).")
    gate_norm: GateNorm | None = merge_option(
        None, "--gate-norm", counts=True, choices=GATE_NORMS, recipe="defaults.gate_norm", yaml=(str,),
        help="Gate values: softmax takes p_i from the full softmax (paper); topk_softmax renormalizes "
             "over the chosen top-k (default: the recipe's: topk_softmax for the shipped recipes, softmax for "
             "btx-shared-expert).")
    extra_ffn_experts: int | None = merge_option(
        None, "--extra-ffn-experts", counts=True, metavar="N", bounds=(0, MAX_EXPERTS), yaml=(int,),
        recipe="defaults.extra_ffn_experts",
        help="Add N FFN experts initialized from the seed's FFN (paper, Table 6: BTX with 5-8 experts; "
             "for upcycle, the number of copies besides the seed's own slot).")
    drop_ratio: float | None = merge_option(
        None, "--drop-ratio", metavar="R", bounds=(0, 1), recipe="defaults.drop_ratio", yaml=(float, int),
        help="Drop-Upcycling (Nakamura et al., ICLR 2025): in every FFN expert, re-initialize a random share R of "
             "its intermediate dimensions (the same rows of gate and up, the same columns of down; a different "
             "subset per expert) from a normal with the mean and std of the source values they replace; 0 keeps "
             "exact copies (default: the recipe's, 0; the paper's best over long training is 0.5).")
    drop_seed: int = seed_option(
        "--drop-seed", "--drop-ratio's subsets and values: each expert's generator is seeded from N, its layer and "
                       "its slot")
    ffn_granularity: int | None = merge_option(
        None, "--ffn-granularity", counts=True, metavar="G", bounds=(1, MAX_EXPERTS), recipe="defaults.ffn_granularity",
        yaml=(int,),
        help="Fine-grained upcycling (He et al. 2024): each FFN expert split along its intermediate dimension into "
             "G experts of 1/G its width; G times the FFN experts, each token routed to G x top-k of them, router "
             "rows in virtual groups and down projections scaled so that the fresh mixture computes what the "
             "coarse one does (default: the recipe's, 1).")
    seed_expert: bool | None = merge_option(
        None, "--seed-expert/--no-seed-expert", recipe="defaults.seed_expert", yaml=(bool,),
        help="Whether the seed joins the mixture as expert 0 (default: yes). Without it the seed is "
             "still the reference for shapes and for --extra-ffn-experts.")
    weights: tuple[float, ...] | None = merge_option(  # one per mixture member (seed first when it joins)
        None, "--weights", metavar="W0,W1,...", parse=parse_weights, yaml=(list,),
        help="Weights of the averaged tensors (norms, embeddings, ...), one per mixture input in expert "
             "order (seed first when it joins); normalized to sum 1. Default: uniform.")
    shared_kv_rule: SharedKVRule | None = merge_option(
        None, "--shared-kv-rule", choices=SHARED_KV_RULES, recipe="tensors.attn.k", yaml=(str,),
        help="For shared-KV recipes: make the one K/V projection by averaging the inputs' (mean) or by "
             "copying the seed's (seed). Default: the recipe's (mean for bam-shared-kv).")
    router_seed: int = seed_option(
        "--router-seed", "the random router init; each router's generator is seeded from N and its tensor name")
    router_std: float | None = merge_option(
        None, "--router-std", metavar="X", bounds=(0, None), recipe="routers.std", yaml=(float, int),
        help="Routers are initialized from normal(0, X) (default: the recipe's, 0.02).")
    router: Router | None = merge_option(  # router kind of every router (runtime/routers.py)
        None, "--router", counts=True, choices=ROUTERS, recipe="routers.kind", yaml=(str,),
        help="Router kind of every router: linear, mlp, attention or expert_embedding (docs/routers.md; "
             "default: the recipe's, linear).")
    ffn_router: Router | None = merge_option(  # the FFN routers' kind (over `router`)
        None, "--ffn-router", counts=True, choices=ROUTERS, recipe="routers.ffn_kind", yaml=(str,),
        help="Router kind of the FFN routers (overrides --router).")
    attn_router: Router | None = merge_option(  # the attention routers' kind (over `router`)
        None, "--attn-router", counts=True, choices=ROUTERS, recipe="routers.attn_kind", yaml=(str,),
        help="Router kind of the attention routers (overrides --router).")
    router_hidden: int | None = merge_option(
        None, "--router-hidden", counts=True, metavar="N", bounds=(1, None), recipe="routers.hidden", yaml=(int,),
        help="mlp routers: hidden width (default 2*d_model); attention routers: query/key width "
             "(default head_dim).")
    router_temperature: float | None = merge_option(
        None, "--router-temperature", metavar="T", bounds=(0, None), min_open=True, recipe="routers.temperature",
        yaml=(float, int),
        help="expert_embedding routers: initial temperature tau of logits = cos(x, m_e) / tau (learned; "
             "default 0.1).")
    warm_start: WarmStart | None = merge_option(  # None: random init
        None, "--router-init", choices=ROUTER_INITS, show_default="random",
        parse=lambda init: None if init == "random" else init,
        help="Expert embeddings of expert_embedding routers: random, or the mean router-input state of each "
             "expert's calibration domain (domain-mean) or of the tokens its dense model predicts best "
             "(profile); the warm starts need --calibration.")
    router_prompts: str | None = merge_option(
        None, "--router-prompts", metavar="FILE", yaml=(str,),
        help="Linear routers (FFN and attention) initialized from prompts: a YAML file in mergekit-moe's shape "
             "(gate_mode: hidden | hidden_avg | cheap_embed, experts: [{source_model, positive_prompts, "
             "negative_prompts}], one per FFN expert in order); each expert's row is the mean router-input state "
             "(hidden) or token embedding (cheap_embed) of its positive prompts minus that of its negative ones, "
             "unit length (docs/routers.md). Tokenized by --tokenizer.")
    calibration: str | None = merge_option(
        None, "--calibration", metavar="SPEC",
        help="Calibration data for --router-init domain-mean|profile, a data SPEC as train takes it "
             "(NAME=SOURCE,...; domain-mean: one domain per expert, named like the expert; the seed's "
             "domain is general).")
    calibration_tokens: int = merge_option(
        8192, "--calibration-tokens", metavar="N", bounds=(1, None), show_default=True,
        help="Calibration tokens per domain (the first N of its train split).")
    tokenizer: str | None = merge_option(
        None, "--tokenizer", metavar="PATH|bytes",
        help="Tokenizer of the calibration text and the router prompts (default: the seed's tokenizer.json, or "
             "bytes for vocabularies of at most 512).")
    token_cache: str | None = merge_option(
        None, "--token-cache", metavar="DIR",
        help="Token cache folder of the calibration data (default: ~/.cache/bam-surgery/tokens).")
    lb_coef: float | None = merge_option(
        None, "--lb-coef", metavar="ALPHA", bounds=(0, None), recipe="defaults.lb_coef", yaml=(float, int),
        help="Load-balancing loss weight alpha written into the output config (paper eq. 3; default "
             "0.01).")
    z_coef: float | None = merge_option(
        None, "--z-coef", metavar="BETA", bounds=(0, None), recipe="defaults.z_coef", yaml=(float, int),
        help="Router z-loss weight beta written into the output config (paper eq. 3; default 0.001).")
    dtype: str | torch.dtype | None = merge_option(  # None: the seed's embedding dtype
        None, "--dtype", choices=DTYPES, yaml=(str,),
        help="Output dtype (default: the dtype of the seed's embedding). Averages are accumulated in "
             "float32 either way.")
    allow_nonfinite: bool = merge_option(
        False, "--allow-nonfinite", yaml=(bool,),
        help="Merge even if an input holds NaN or Inf values (they are reported as warnings).")

    def resolved(self, name: str, recipe: Recipe) -> Any:
        """The option's value, or where it was left at None the recipe's (its field's `recipe` key)."""
        value = getattr(self, name)
        return recipe_value(recipe, FIELDS[name].metadata["recipe"]) if value is None else value


FIELDS = {f.name: f for f in dataclasses.fields(MergeOptions)}
# the options a pipeline's mixture may set (the fields with YAML types), with those types
PIPELINE_OPTIONS: dict[str, tuple[type, ...]] = {n: f.metadata["yaml"] for n, f in FIELDS.items() if f.metadata["yaml"]}


ExtendInit = Literal["random", "prompts", "domain"]  # extend --router-init: how the new experts' router rows start
EXTEND_INITS = get_args(ExtendInit)


def _as_in_merge(name: str, help: str | None = None) -> Any:
    """A field of ExtendOptions declared as MergeOptions declares it (its flag, default, bounds), with its own help
    sentence where the meaning differs."""
    f = FIELDS[name]
    return field(default=f.default, metadata={**f.metadata, "recipe": None, "yaml": None,
                                              **({"help": help} if help else {})})


@dataclass(frozen=True)
class ExtendOptions:
    """Every option of `bam-surgery extend` (surgery/extend.py) that is not an input or the output: how the new
    experts' router rows start. Declared like MergeOptions, so the command's flags come from the fields."""

    router_init: ExtendInit = merge_option(
        "random", "--router-init", choices=EXTEND_INITS, show_default=True,
        help="The new experts' router rows: random (normal(0, --router-std)), prompts (linear routers: "
             "--router-prompts, one entry per new expert) or domain (linear routers: --calibration, a domain named "
             "like each new expert and at least one other); prompts and domain rows are scaled to the mean norm of "
             "the router's trained rows.")
    router_prompts: str | None = _as_in_merge(
        "router_prompts", "For --router-init prompts: a YAML file in mergekit-moe's shape (gate_mode hidden | "
                          "hidden_avg | hidden_last | cheap_embed), experts: one entry per new expert, in --experts "
                          "order, source_model naming it.")
    calibration: str | None = _as_in_merge(
        "calibration", "For --router-init domain: a data SPEC as train takes it (NAME=SOURCE,...), a domain named "
                       "like each new expert and at least one other (e.g. general).")
    calibration_tokens: int = _as_in_merge("calibration_tokens")
    tokenizer: str | None = _as_in_merge(
        "tokenizer", "Tokenizer of the prompts and the calibration text (default: the mixture's tokenizer.json, or "
                     "bytes for vocabularies of at most 512).")
    token_cache: str | None = _as_in_merge("token_cache")
    router_std: float = merge_option(
        0.02, "--router-std", metavar="X", bounds=(0, None), show_default=True,
        help="--router-init random: the new rows are normal(0, X) (expert embeddings normal(0, 1)).")
    router_seed: int = _as_in_merge(
        "router_seed", "Seed of the new random rows; each router's generator is seeded from N and its tensor name.")
    allow_nonfinite: bool = _as_in_merge("allow_nonfinite", "Extend even if an input holds NaN or Inf values.")


def recipe_value(recipe: Recipe, key: str) -> Any:
    """A recipe's value for a key as the recipe file writes it: defaults.X, routers.X or tensors.X."""
    section, _, name = key.partition(".")
    if section == "defaults":
        return recipe.defaults[name]
    if section == "tensors":
        return recipe.tensors[name]
    attribute = {"std": "router_std", "kind": "ffn_router", "ffn_kind": "ffn_router", "attn_kind": "attn_router",
                 "hidden": "router_hidden", "temperature": "router_temperature"}[name]
    return getattr(recipe, attribute)


def command_args(given: dict[str, Any]) -> list[str]:
    """The `bam-surgery merge` flags that give these options (a pipeline's mixture as its command line)."""
    args: list[str] = []
    for name, f in FIELDS.items():
        if name not in given:
            continue
        flag, value = f.metadata["flag"], given[name]
        if "/" in flag:  # --x/--no-x
            args.append(flag.split("/")[0 if value else 1])
        elif f.type == "bool":
            args += [flag] if value else []
        elif name == "weights":
            args += [flag, ",".join(repr(float(w)) for w in value)]
        else:
            args += [flag, str(value)]
    return args
