"""Recipes: declarative YAML that says how each canonical tensor of a mixture is made from dense inputs.

A recipe is validated against SCHEMA before any checkpoint is opened; every error names the recipe
and the field, and says what to change. recipes/README.md documents the format with a worked example.

    tensors:             one entry per dense tensor kind (KINDS), each one op:
        stack            one slice per expert, copied from that expert's tensor -> *_experts [E, ...]
        mean             (weighted) average over the mixture's inputs, accumulated in float32
        seed             copied from the seed
    routers:             routers are new tensors: their kind (runtime/routers.py), init normal(0, std) or zeros
    defaults:            option defaults (top-k, gate normalization, alpha/beta, ...); CLI overrides
    experts: {min, max}  how many --experts the recipe accepts
    shared_expert: seed  an always-on shared FFN expert beside the routed ones, copied from the seed's FFN, with
                         its own gate sigmoid(x . w), w starting at zero (Qwen2-MoE's shared expert)

Which experts exist follows from the ops: ffn.* stacked -> FFN experts; attn.q/o stacked -> attention
experts, with attn.k/v stacked (kv_mode "expert") or made once (kv_mode "shared").
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Literal, get_args

from bam_surgery.converters.yamlfile import parse_yaml, read_yaml_text, shown
from bam_surgery.runtime.config import (GATE_NORMS, MAX_DIM, MAX_EXPERTS, ROUTERS, ConfigError, KVMode,
                                        ModelConfig, Router)
from bam_surgery.runtime.errors import printable

from .errors import RecipeError
from .options import MergeOptions, SharedKVRule

SCHEMA_VERSION = 1

# Dense tensor kinds: a canonical dense name without its layer prefix and param suffix.
# Weight and bias of a kind always share the op.
KINDS = ("embed", "pos_embed", "attn_norm", "ffn_norm", "attn.q", "attn.k", "attn.v", "attn.o",
         "ffn.gate", "ffn.up", "ffn.down", "final_norm", "lm_head")
# Kinds only some architectures have, which a recipe must list only to merge one that has them (a recipe written
# before them still merges everything else): a Gated DeltaNet layer's whole token mixer (Qwen3.5; stack: each
# expert keeps its own DeltaNet and recurrent state, mixed by the layer's attention router), and Gemma 4's per-layer
# inputs (their table, projection and norm, and each layer's gate, output projection and norm).
OPTIONAL_KINDS = ("attn.linear", "ple")
ATTENTION_KINDS = ("attn.q", "attn.k", "attn.v", "attn.o", "attn.linear")
FFN_KINDS = ("ffn.gate", "ffn.up", "ffn.down")
Op = Literal["stack", "mean", "seed"]  # a recipe's tensor ops
RouterInit = Literal["normal", "zeros"]
SharedExpert = Literal["seed"]  # where a recipe's shared FFN expert comes from
OPS, ROUTER_INITS = get_args(Op), get_args(RouterInit)
SHARED_EXPERTS = get_args(SharedExpert)

# Built-in defaults for fields a recipe leaves out of `defaults:`.
DEFAULTS: dict[str, Any] = dict(seed_expert=True, extra_ffn_experts=0, ffn_top_k=1, gate_norm="softmax",
                                attention_routing="soft", lb_coef=0.01, z_coef=0.001, drop_ratio=0.0,
                                ffn_granularity=1)
TOP_LEVEL = ("schema", "name", "description", "experts", "defaults", "routers", "tensors", "shared_expert")

_DENSE_NAME = re.compile(
    r"^(?P<prefix>layers\.\d+\.)?(?P<kind>embed|pos_embed|attn_norm|ffn_norm|final_norm|lm_head|"
    r"attn\.[qkvo]|ffn\.(?:gate|up|down))\.(?P<param>weight|bias)$")
# tensors without a kind of their own: a QK-norm (attn.q_norm) and a post-norm (attn_post_norm, ffn_post_norm)
_FOLLOWER = re.compile(r"^layers\.\d+\.(?:(?P<qk>attn\.[qk])_norm|(?P<post>attn|ffn)_post_norm)\.(?:weight|bias)$")
# the newer families' tensors, by the kind they take the op of: the attention output gate its query's (Qwen3.5),
# a Gated DeltaNet's tensors attn.linear, the per-layer inputs' ple, the block scale the norms' (Gemma 4)
_FAMILY_KIND = [(re.compile(r"^layers\.\d+\.attn\.gate\.(?:weight|bias)$"), "attn.q"),
                (re.compile(r"^layers\.\d+\.linear\.[a-z_]+\.(?:weight|bias)$"), "attn.linear"),
                (re.compile(r"^(?:ple_embed|ple_proj|ple_proj_norm)\.weight$|^layers\.\d+\.(?:ple\.(?:gate|out)|ple_norm)"
                            r"\.weight$"), "ple"),
                (re.compile(r"^layers\.\d+\.layer_scale\.weight$"), "attn_norm")]


def dense_kind(name: str) -> str:
    """The kind of a canonical dense tensor name: 'layers.3.attn.q.bias' -> 'attn.q'. Tensors without a kind of
    their own take the op of the kind they belong to: a QK-norm its projection's ('attn.q_norm' -> 'attn.q', so
    an attention expert keeps its own and a shared K keeps one shared k norm), a post-norm the pre-norm kind of
    its sublayer ('attn_post_norm' -> 'attn_norm': averaged, like every norm)."""
    m = _DENSE_NAME.match(name)
    if m:
        return m.group("kind")
    f = _FOLLOWER.match(name)
    if f:
        return f["qk"] or f"{f['post']}_norm"
    for rx, kind in _FAMILY_KIND:
        if rx.match(name):
            return kind
    raise KeyError(f"{name}: not a canonical dense tensor name")


def parse_attention_routing(value: Any) -> int | None:
    """'soft' (or 0) -> None; 'top2' / 2 -> 2. Raises ValueError with a usable message."""
    if value is None or value == "soft" or value == 0:
        return None
    if isinstance(value, bool):
        raise ValueError(f"{shown(value)} is not soft or topK")
    if isinstance(value, int) and value > 0:
        return value
    m = re.fullmatch(r"top-?(\d+)", str(value).strip().lower())
    if m and int(m.group(1)) > 0:
        return int(m.group(1))
    raise ValueError(f"{shown(value)} is neither 'soft' nor 'topK' (e.g. top1, top2)")


@dataclass(frozen=True)
class Recipe:
    name: str
    description: str
    tensors: dict[str, Op]  # kind -> op
    min_experts: int
    max_experts: int | None
    defaults: dict[str, Any]  # complete: DEFAULTS overridden by the recipe
    router_init: RouterInit
    router_std: float
    text: str = ""  # the YAML source, recorded in output provenance
    path: str | None = None
    ffn_router: Router = "linear"  # router kinds (runtime/routers.py): routers.kind, or routers.ffn_kind / attn_kind
    attn_router: Router = "linear"
    router_hidden: int | None = None  # routers.hidden (None: each kind's default)
    router_temperature: float | None = None  # routers.temperature (None: the config's default)
    shared_expert: SharedExpert | None = None  # an always-on shared FFN expert, from the seed's FFN

    # -- structure implied by the ops ---------------------------------------------------------
    @property
    def ffn_experts(self) -> bool:
        return self.tensors["ffn.up"] == "stack"

    @property
    def attention_experts(self) -> bool:
        return self.tensors["attn.q"] == "stack"

    @property
    def linear_experts(self) -> bool:
        """A Gated DeltaNet layer becomes DeltaNet experts (tensors.attn.linear: stack)."""
        return self.tensors.get("attn.linear") == "stack"

    @property
    def kv_mode(self) -> KVMode:
        return "expert" if self.tensors["attn.k"] == "stack" else "shared"

    @property
    def shared_kv(self) -> bool:
        return self.attention_experts and self.kv_mode == "shared"

    def op(self, kind: str, shared_kv_rule: SharedKVRule | None = None) -> Op:
        """The op for a kind; `shared_kv_rule` overrides the op of a shared K/V (attn.k, attn.v)."""
        if shared_kv_rule is not None and self.shared_kv and kind in ("attn.k", "attn.v"):
            return shared_kv_rule
        return self.tensors[kind]

    def summary(self) -> str:
        parts = []
        parts.append("FFN experts" if self.ffn_experts else f"FFN {self.tensors['ffn.up']}")
        if self.shared_expert:
            parts.append(f"a shared FFN expert ({self.shared_expert}'s)")
        if self.attention_experts:
            parts.append(f"attention experts (kv {self.kv_mode}"
                         + (f", K/V {self.tensors['attn.k']})" if self.shared_kv else ")"))
        else:
            parts.append(f"attention {self.tensors['attn.q']}")
        if "attn.linear" in self.tensors:
            parts.append("Gated DeltaNet experts" if self.linear_experts else f"Gated DeltaNet {self.tensors['attn.linear']}")
        return ", ".join(parts)


# ---- loading and validation -------------------------------------------------------------------
def available_recipes() -> list[str]:
    return sorted(p.name[:-5] for p in resources.files("bam_surgery.recipes").iterdir() if p.name.endswith(".yaml"))


def load_recipe(name_or_path: str | Path) -> Recipe:
    """A shipped recipe by name ('bam', 'btx', ...) or a YAML file by path."""
    spec = str(name_or_path)
    path = Path(spec)
    if spec.endswith((".yaml", ".yml")) or "/" in spec or os.sep in spec:
        if not path.is_file():
            raise RecipeError(f"recipe {spec}: file not found")
        text = read_yaml_text(path, f"recipe {spec}", error=RecipeError)
        return parse_recipe(text, str(path))
    shipped = resources.files("bam_surgery.recipes") / f"{spec}.yaml"
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", spec) or not shipped.is_file():
        raise RecipeError(f"recipe {spec!r}: no such recipe; choose one of {', '.join(available_recipes())} "
                          "or give the path of a .yaml file")
    return parse_recipe(shipped.read_text(encoding="utf-8"), f"{spec}.yaml")


def parse_recipe(text: str, origin: str = "<recipe>") -> Recipe:
    doc = parse_yaml(text, f"recipe {origin}", error=RecipeError)  # bounded: converters/yamlfile.py
    return validate_recipe(doc, origin, text)


def validate_recipe(doc: Any, origin: str = "<recipe>", text: str = "") -> Recipe:
    def fail(fld: str, msg: str) -> RecipeError:
        return RecipeError(f"recipe {origin}: {printable(fld)[:80]}: {msg}")

    if not isinstance(doc, dict):
        raise RecipeError(f"recipe {origin}: must be a YAML mapping with keys {', '.join(TOP_LEVEL)}")
    for key in doc:
        if key not in TOP_LEVEL:
            raise fail(str(key), f"unknown field; the fields are {', '.join(TOP_LEVEL)}")
    if doc.get("schema", SCHEMA_VERSION) != SCHEMA_VERSION:
        raise fail("schema", f"version {shown(doc.get('schema'))} is not supported; this tool reads schema "
                             f"{SCHEMA_VERSION}")
    name = doc.get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise fail("name", "required: a short identifier (letters, digits, '-', '_', '.')")
    description = doc.get("description")
    if not isinstance(description, str) or not description.strip():
        raise fail("description", "required: one or more sentences saying what the recipe builds")

    tensors = _validate_tensors(doc.get("tensors"), fail)
    min_experts, max_experts = _validate_experts(doc.get("experts", {}), fail)
    defaults = _validate_defaults(doc.get("defaults", {}), fail, tensors)
    routers = _validate_routers(doc.get("routers", {}), fail)
    if defaults["extra_ffn_experts"] and tensors["ffn.up"] != "stack":
        raise fail("defaults.extra_ffn_experts", "needs FFN experts (tensors.ffn.*: stack)")
    shared = doc.get("shared_expert")
    if shared is not None and shared not in SHARED_EXPERTS:
        raise fail("shared_expert", f"unknown source {shown(shared)}; choose {', '.join(SHARED_EXPERTS)} (the seed's "
                                    "FFN) or leave it out")
    if shared is not None and tensors["ffn.up"] != "stack":
        raise fail("shared_expert", "a shared expert sits beside routed FFN experts: needs tensors.ffn.*: stack")
    return Recipe(name=name, description=" ".join(description.split()), tensors=tensors,
                  min_experts=min_experts, max_experts=max_experts, defaults=defaults,
                  text=text, path=origin, shared_expert=shared, **routers)


def _validate_tensors(section: Any, fail) -> dict[str, str]:
    if not isinstance(section, dict):
        raise fail("tensors", f"required: a mapping from each tensor kind ({', '.join(KINDS)}) to an op "
                              f"({', '.join(OPS)})")
    for kind in section:
        if kind not in KINDS + OPTIONAL_KINDS:
            raise fail(f"tensors.{kind}", f"unknown tensor kind; the kinds are {', '.join(KINDS + OPTIONAL_KINDS)}")
    tensors: dict[str, str] = {}
    for kind in KINDS + OPTIONAL_KINDS:
        if kind not in section and kind in OPTIONAL_KINDS:
            continue
        if kind not in section:
            raise fail(f"tensors.{kind}", f"missing; every kind needs an op ({', '.join(OPS)}), "
                                          "even if the architecture has no such tensor")
        op = section[kind]
        if op not in OPS:
            raise fail(f"tensors.{kind}", f"unknown op {shown(op)}; choose one of {', '.join(OPS)}")
        if op == "stack" and kind not in ATTENTION_KINDS + FFN_KINDS:
            raise fail(f"tensors.{kind}", "only attention and FFN projections can be stacked into experts; "
                                          "use mean or seed")
        tensors[kind] = op
    ffn_stacked = {k for k in FFN_KINDS if tensors[k] == "stack"}
    if ffn_stacked and ffn_stacked != set(FFN_KINDS):
        missing = next(k for k in FFN_KINDS if k not in ffn_stacked)
        raise fail(f"tensors.{missing}", "FFN experts stack all of ffn.gate, ffn.up, ffn.down; set it to stack "
                                         "too, or none of them")
    if (tensors["attn.q"] == "stack") != (tensors["attn.o"] == "stack"):
        raise fail("tensors.attn.o" if tensors["attn.q"] == "stack" else "tensors.attn.q",
                   "an attention expert has its own query and output projections: stack attn.q and attn.o "
                   "together, or neither")
    if (tensors["attn.k"] == "stack") != (tensors["attn.v"] == "stack"):
        raise fail("tensors.attn.v" if tensors["attn.k"] == "stack" else "tensors.attn.k",
                   "stack attn.k and attn.v together (key/value experts), or neither (one shared K/V)")
    if tensors["attn.k"] == "stack" and tensors["attn.q"] != "stack":
        raise fail("tensors.attn.k", "key/value experts exist only inside attention experts: stack attn.q "
                                     "and attn.o too, or set attn.k and attn.v to mean or seed")
    return tensors


def _validate_experts(section: Any, fail) -> tuple[int, int | None]:
    if not isinstance(section, dict):
        raise fail("experts", "must be a mapping with min and max (max: null for no limit)")
    for key in section:
        if key not in ("min", "max"):
            raise fail(f"experts.{key}", "unknown field; the fields are min, max")
    lo, hi = section.get("min", 1), section.get("max", None)
    if not _is_int(lo) or not 0 <= lo <= MAX_EXPERTS:
        raise fail("experts.min", f"must be an integer >= 0 and <= {MAX_EXPERTS}, got {shown(lo)}")
    if hi is not None and (not _is_int(hi) or not lo <= hi <= MAX_EXPERTS):
        raise fail("experts.max", f"must be null or an integer >= experts.min ({lo}) and <= {MAX_EXPERTS}, "
                                  f"got {shown(hi)}")
    return lo, hi


def _validate_defaults(section: Any, fail, tensors: dict[str, str]) -> dict[str, Any]:
    if not isinstance(section, dict):
        raise fail("defaults", f"must be a mapping; its fields are {', '.join(DEFAULTS)}")
    for key in section:
        if key not in DEFAULTS:
            raise fail(f"defaults.{key}", f"unknown field; the fields are {', '.join(DEFAULTS)}")
    d = {**DEFAULTS, **section}
    if not isinstance(d["seed_expert"], bool):
        raise fail("defaults.seed_expert", "must be true or false")
    if not _is_int(d["extra_ffn_experts"]) or not 0 <= d["extra_ffn_experts"] <= MAX_EXPERTS:
        raise fail("defaults.extra_ffn_experts", f"must be an integer >= 0 and <= {MAX_EXPERTS}, got "
                                                 f"{shown(d['extra_ffn_experts'])}")
    if not _is_int(d["ffn_top_k"]) or not 1 <= d["ffn_top_k"] <= MAX_EXPERTS:
        raise fail("defaults.ffn_top_k", f"must be an integer >= 1 and <= {MAX_EXPERTS}, got {shown(d['ffn_top_k'])}")
    if d["gate_norm"] not in GATE_NORMS:
        raise fail("defaults.gate_norm", f"choose one of {', '.join(GATE_NORMS)}")
    try:
        parse_attention_routing(d["attention_routing"])
    except ValueError as e:
        raise fail("defaults.attention_routing", str(e)) from None
    if ("attention_routing" in section and tensors["attn.q"] != "stack" and tensors.get("attn.linear") != "stack"
            and section["attention_routing"] != "soft"):
        raise fail("defaults.attention_routing", "the recipe has no attention experts (tensors.attn.q and "
                                                 "attn.linear are not stack); remove this field")
    for key in ("lb_coef", "z_coef"):
        if not _is_finite_number(d[key]) or d[key] < 0:
            raise fail(f"defaults.{key}", f"must be a finite number >= 0, got {shown(d[key])}")
        d[key] = float(d[key])
    if not _is_finite_number(d["drop_ratio"]) or not 0 <= d["drop_ratio"] <= 1:
        raise fail("defaults.drop_ratio", f"must be a number from 0 to 1, got {shown(d['drop_ratio'])}")
    d["drop_ratio"] = float(d["drop_ratio"])
    if not _is_int(d["ffn_granularity"]) or not 1 <= d["ffn_granularity"] <= MAX_EXPERTS:
        raise fail("defaults.ffn_granularity", f"must be an integer >= 1 and <= {MAX_EXPERTS}, got "
                                               f"{shown(d['ffn_granularity'])}")
    for key in ("drop_ratio", "ffn_granularity"):
        if key in section and d[key] != DEFAULTS[key] and tensors["ffn.up"] != "stack":
            raise fail(f"defaults.{key}", "needs FFN experts (tensors.ffn.*: stack)")
    return d


ROUTER_FIELDS = ("init", "std", "kind", "ffn_kind", "attn_kind", "hidden", "temperature")


def _validate_routers(section: Any, fail) -> dict[str, Any]:
    """The routers section -> Recipe fields (router_init, router_std, ffn_router, attn_router, router_hidden,
    router_temperature)."""
    if not isinstance(section, dict):
        raise fail("routers", "must be a mapping with init (normal | zeros), std and optionally kind, ffn_kind, "
                              "attn_kind, hidden, temperature")
    for key in section:
        if key not in ROUTER_FIELDS:
            raise fail(f"routers.{key}", f"unknown field; the fields are {', '.join(ROUTER_FIELDS)}")
    init = section.get("init", "normal")
    if init not in ROUTER_INITS:
        raise fail("routers.init", f"unknown init {shown(init)}; choose one of {', '.join(ROUTER_INITS)}")
    std = section.get("std", 0.02)
    if not _is_finite_number(std) or std < 0:
        raise fail("routers.std", f"must be a finite number >= 0, got {shown(std)}")
    kinds = {}
    for key in ("kind", "ffn_kind", "attn_kind"):
        value = section.get(key)
        if value is not None and value not in ROUTERS:
            raise fail(f"routers.{key}", f"unknown router kind {shown(value)}; choose one of {', '.join(ROUTERS)}")
        kinds[key] = value
    both = kinds["kind"] or "linear"
    hidden = section.get("hidden")
    if hidden is not None and (not _is_int(hidden) or not 0 < hidden <= MAX_DIM):
        raise fail("routers.hidden", f"must be a positive integer, got {shown(hidden)}")
    temperature = section.get("temperature")
    if temperature is not None and (not _is_finite_number(temperature) or temperature <= 0):
        raise fail("routers.temperature", f"must be a finite number > 0, got {shown(temperature)}")
    return dict(router_init=init, router_std=float(std), ffn_router=kinds["ffn_kind"] or both,
                attn_router=kinds["attn_kind"] or both, router_hidden=hidden,
                router_temperature=None if temperature is None else float(temperature))


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_finite_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# ---- the output config ------------------------------------------------------------------------
def mixture_config(recipe: Recipe, dense_cfg: ModelConfig, n_inputs: int, options: MergeOptions | None = None,
                   **given: Any) -> ModelConfig:
    """The config of the mixture a recipe builds from `n_inputs` dense models of shape `dense_cfg`.

    n_inputs counts the mixture's members: the seed (when it joins) plus the --experts. `options` (or its
    fields as keywords, `given`) left at None take the recipe's defaults. FFN experts: n_inputs +
    extra_ffn_experts; attention experts: n_inputs.
    """
    options = dataclasses.replace(options or MergeOptions(), **given)
    return build_mixture_config(recipe, dense_cfg, options, check_mixture(recipe, dense_cfg, n_inputs, options))


def check_mixture(recipe: Recipe, dense_cfg: ModelConfig, n_inputs: int, options: MergeOptions) -> dict[str, Any]:
    """Validation: every option against the recipe and the inputs (ConfigError naming the option), resolved into
    the mixture's ModelConfig fields: its experts, their routing and their routers."""
    if dense_cfg.is_mixture:
        raise ConfigError(f"dense_cfg: is already a mixture (ffn_experts={dense_cfg.ffn_experts}, "
                          f"attn_experts={dense_cfg.attn_experts}); merge takes dense inputs")
    n_ffn, n_attn, top_k, attn_k = _check_experts(recipe, n_inputs, options)
    n_linear = n_inputs if recipe.linear_experts and dense_cfg.linear_layers else 0
    if attn_k is not None and not n_attn and n_linear and not 1 <= attn_k <= n_linear:
        raise ConfigError(f"attn_top_k: top-{attn_k} routing needs between 1 and {n_linear} attention experts")
    ffn_kind, attn_kind, hidden, temperature = _check_routers(recipe, options, n_ffn, n_attn or n_linear)
    # the config's `router` is the FFN routers' kind (or the attention routers' when there is no FFN mixture)
    routed = n_attn or n_linear  # attention experts of either kind (softmax, Gated DeltaNet)
    kind = ffn_kind if n_ffn else (attn_kind if routed else "linear")
    temperature_default = {f.name: f.default for f in dataclasses.fields(ModelConfig)}["router_temperature"]
    G = _check_upcycling(recipe, dense_cfg, options, n_ffn)  # fine-grained: G experts of width F/G per coarse one
    return dict(ffn_experts=n_ffn * G, ffn_top_k=top_k * G if n_ffn else 1, ffn_hidden=dense_cfg.ffn_hidden // G,
                attn_experts=n_attn, linear_experts=n_linear, attn_top_k=attn_k if routed else None, router=kind,
                attn_router=attn_kind if routed and attn_kind != kind else None, router_hidden=hidden,
                router_temperature=temperature_default if temperature is None else float(temperature))


def _check_upcycling(recipe: Recipe, dense_cfg: ModelConfig, options: MergeOptions, n_ffn: int) -> int:
    """Drop-Upcycling's ratio and fine-grained upcycling's granularity against the FFN experts; the granularity."""
    drop, granularity = options.resolved("drop_ratio", recipe), options.resolved("ffn_granularity", recipe)
    if not _is_finite_number(drop) or not 0 <= drop <= 1:
        raise ConfigError(f"drop_ratio: must be a number from 0 to 1, got {shown(drop)}")
    if not _is_int(granularity) or not 1 <= granularity <= MAX_EXPERTS:
        raise ConfigError(f"ffn_granularity: must be an integer from 1 to {MAX_EXPERTS}, got {shown(granularity)}")
    for fld, value, default in (("drop_ratio", options.drop_ratio, 0), ("ffn_granularity", options.ffn_granularity, 1)):
        if value not in (None, default) and not n_ffn:
            raise ConfigError(f"{fld}: recipe {recipe.name} has no FFN experts (tensors.ffn.*: "
                              f"{recipe.tensors['ffn.up']})")
    if granularity > 1:
        F = dense_cfg.ffn_hidden
        if F % granularity:
            raise ConfigError(f"ffn_granularity: the FFN width {F} is not divisible by {granularity}; each fine-grained "
                              "expert is an equal share of it")
        if n_ffn * granularity > MAX_EXPERTS:
            raise ConfigError(f"ffn_granularity: {n_ffn} FFN experts split {granularity} ways make "
                              f"{n_ffn * granularity}, past the limit of {MAX_EXPERTS}")
    return granularity


def _check_experts(recipe: Recipe, n_inputs: int, options: MergeOptions) -> tuple[int, int, int, int | None]:
    """(FFN experts, attention experts, FFN top-k, attention top-k or None: soft)."""
    extra = options.resolved("extra_ffn_experts", recipe)
    if not _is_int(extra) or not 0 <= extra <= MAX_EXPERTS:
        raise ConfigError(f"extra_ffn_experts: must be an integer from 0 to {MAX_EXPERTS}, got {shown(extra)}")
    if options.extra_ffn_experts and not recipe.ffn_experts:
        raise ConfigError(f"extra_ffn_experts: recipe {recipe.name} has no FFN experts "
                          f"(tensors.ffn.*: {recipe.tensors['ffn.up']})")
    if options.ffn_top_k is not None and not recipe.ffn_experts:
        raise ConfigError(f"ffn_top_k: recipe {recipe.name} has no FFN experts to route")
    try:
        attn_k = parse_attention_routing(options.resolved("attention_routing", recipe))
    except ValueError as e:
        raise ConfigError(f"attn_top_k: {e}") from None
    if attn_k is not None and not recipe.attention_experts and not recipe.linear_experts:
        raise ConfigError(f"attn_top_k: recipe {recipe.name} has no attention experts "
                          f"(attention is merged by {recipe.tensors['attn.q']}); only soft applies")

    n_ffn = n_inputs + extra if recipe.ffn_experts else 0
    n_attn = n_inputs if recipe.attention_experts else 0
    for what, n in (("FFN", n_ffn), ("attention", n_attn)):
        if n == 1:
            hint = "add --experts or --extra-ffn-experts" if what == "FFN" else "add --experts"
            raise ConfigError(f"{what.lower()}_experts: recipe {recipe.name} would build 1 {what} expert from "
                              f"{n_inputs} input(s); a mixture needs at least 2 ({hint})")
    top_k = options.resolved("ffn_top_k", recipe)
    if n_ffn and not 1 <= top_k <= n_ffn:
        raise ConfigError(f"ffn_top_k: top-{top_k} routing needs between 1 and {n_ffn} FFN experts")
    if attn_k is not None and not 1 <= attn_k <= n_attn:
        raise ConfigError(f"attn_top_k: top-{attn_k} routing needs between 1 and {n_attn} attention experts")
    return n_ffn, n_attn, top_k, attn_k


def _check_routers(recipe: Recipe, options: MergeOptions, n_ffn: int, n_attn: int
                   ) -> tuple[Router, Router, int | None, float | None]:
    """(FFN router kind, attention router kind, hidden width, temperature): the options over the recipe's."""
    router, ffn_router, attn_router = options.router, options.ffn_router, options.attn_router
    ffn_kind = ffn_router or router or recipe.ffn_router
    attn_kind = attn_router or router or recipe.attn_router
    for fld, kind in (("router", router), ("ffn_router", ffn_kind), ("attn_router", attn_kind)):
        if fld == "router" and kind is None:
            continue
        if kind not in ROUTERS:
            raise ConfigError(f"{fld}: unknown router kind {shown(kind)}; choose one of {', '.join(ROUTERS)}")
    if attn_router is not None and not n_attn:
        raise ConfigError(f"attn_router: recipe {recipe.name} has no attention experts to route")
    if ffn_router is not None and not n_ffn:
        raise ConfigError(f"ffn_router: recipe {recipe.name} has no FFN experts to route")
    # a recipe's hidden / temperature are defaults for the kinds that have them; given explicitly for kinds
    # that have none, they are an error
    used = {k for k, n in ((ffn_kind, n_ffn), (attn_kind, n_attn)) if n}
    takes_hidden, takes_temperature = bool(used & {"mlp", "attention"}), "expert_embedding" in used
    if options.router_hidden is not None and not takes_hidden:
        raise ConfigError(f"router_hidden: applies to mlp and attention routers; this mixture's routers are "
                          f"{', '.join(sorted(used)) or 'none'}")
    if options.router_temperature is not None and not takes_temperature:
        raise ConfigError(f"router_temperature: applies to expert_embedding routers; this mixture's routers are "
                          f"{', '.join(sorted(used)) or 'none'}")
    hidden = options.resolved("router_hidden", recipe) if takes_hidden else None
    temperature = options.resolved("router_temperature", recipe) if takes_temperature else None
    return ffn_kind, attn_kind, hidden, temperature


def build_mixture_config(recipe: Recipe, dense_cfg: ModelConfig, options: MergeOptions,
                         mixture: dict[str, Any]) -> ModelConfig:
    """Construction: the mixture's config from the dense one and the checked fields (check_mixture)."""
    base = f"{dense_cfg.name}-" if dense_cfg.name else ""
    return dense_cfg.replace(
        **mixture,
        ffn_shared_hidden=dense_cfg.ffn_hidden if recipe.shared_expert and mixture["ffn_experts"] else 0,
        gate_norm=options.resolved("gate_norm", recipe),
        kv_mode=recipe.kv_mode if mixture["attn_experts"] else "expert",
        lb_coef=float(options.resolved("lb_coef", recipe)),
        z_coef=float(options.resolved("z_coef", recipe)),
        name=f"{base}{recipe.name}",
    )
