"""Compile a recipe and dense inputs into a plan: output tensor <- op(input tensors), from headers alone.

    plan = compile_plan(load_recipe("bam"), [seed_reader, code_reader, math_reader], MergeOptions())
    print(format_plan(plan))          # what --dry-run shows

Inputs are a list of readers (runtime.reader protocol, as converters.open_checkpoint returns them);
index 0 is the seed, then the --experts in order. Tensors are paired
across inputs by canonical name, never by position. Compiling reads configs, names, shapes and
dtypes only; it never calls reader.get.

Mixture members are the inputs that become experts: the seed (expert 0, unless --no-seed-expert)
then the --experts. Expert slot e of a stacked tensor comes from member e; FFN slots past the
members (--extra-ffn-experts) are copies of the seed's FFN (paper, Table 6). `mean` averages over
the members with weights w (uniform unless --weights; normalized to sum 1).

Ops in a plan:
    stack   out[e] = source_e                      [E, *dense_shape]
    mean    out = sum_i w_i * source_i             accumulated in float32, then cast
    copy    out = source_0                         (recipe op `seed`, or a mean over one member)
    normal  out ~ normal(0, std), torch CPU generator seeded from (--router-seed, tensor name)
    zeros   out = 0
    full    out = value                            (an expert_embedding router's log temperature)
    calibrated  out = a tensor computed before the merge (surgery/warm_start.py: expert embeddings from data)

Router tensors follow their kind's definition (runtime/routers.py RouterTensor.init): the tensor the logits
are read from is normal(0, std) or, with the recipe's routers.init zeros, zeros; other matrices normal(0, std);
expert embeddings normal(0, 1); a log temperature log(router_temperature).
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Literal, Sequence, get_args

import torch

from bam_surgery.runtime.config import ConfigError, ModelConfig
from bam_surgery.runtime.dtypes import COMPUTE_DTYPES, nbytes
from bam_surgery.runtime.layout import ranges, router_tensors, tensor_shapes
from bam_surgery.runtime.memory import check_fits
from bam_surgery.runtime.reader import Reader, check_layout
from bam_surgery.runtime.routers import RouterTensor, router_class

from .errors import BamSurgeryError, InputError
from .names import input_names
from .options import SHARED_KV_RULES, WARM_STARTS, MergeOptions, SharedKVRule, WarmStart
from .recipe import Recipe, dense_kind, mixture_config

# Output names that are not dense names: expert tensors stacked from a dense tensor (and the routers:
# runtime.layout.router_tensors).
STACKED = re.compile(r"^(?P<layer>layers\.\d+)\.(?P<group>attn|ffn|linear)_experts\."
                     r"(?P<rest>(q|k|v|o|q_norm|k_norm|gate|up|down|qkv|z|b|a|out|conv|dt|a_log|norm)\.(weight|bias))$")
SHARED = re.compile(r"^(?P<layer>layers\.\d+)\.ffn_shared(?P<gate>_gate)?\.(?P<rest>.+)$")  # the shared FFN expert


# The ops of a plan's tensors (the module docstring; surgery/kernels.py computes them)
PlanOp = Literal["stack", "mean", "copy", "normal", "unit_rows", "zeros", "full", "calibrated"]
PLAN_OPS = get_args(PlanOp)


@dataclass(frozen=True)
class Source:
    input: int  # index into Plan.inputs (0 = seed)
    name: str  # canonical tensor name in that input (dense; a stacked one with `row`)
    row: int | None = None  # a stacked source tensor [E, ...]: its expert `row` (extend: a trained mixture's expert)
    shard: tuple[int, int, int] | None = None  # (axis, g, G): the g-th of G equal parts along axis (fine-grained)
    scale: float = 1.0  # the part times this (fine-grained upcycling's weight scaling of the down projection)

    @property
    def whole(self) -> "Source":
        """The tensor read from the input (this source's part is cut from it)."""
        return Source(self.input, self.name) if self.is_part else self

    @property
    def is_part(self) -> bool:
        return self.row is not None or self.shard is not None or self.scale != 1.0

    def part(self) -> dict[str, Any]:
        """How the part is cut (provenance): only what differs from the whole tensor."""
        out: dict[str, Any] = {}
        if self.row is not None:
            out["row"] = self.row
        if self.shard is not None:
            out["shard"] = list(self.shard[1:])
        if self.scale != 1.0:
            out["scale"] = self.scale
        return out


@dataclass(frozen=True)
class Drop:
    """Drop-Upcycling of a stacked FFN tensor (Nakamura et al., ICLR 2025): in each slot e, the intermediate
    dimensions subset(e) (a share `ratio` of them, the same for the slot's gate, up and down) along `axis` are
    re-initialized from normal(mean, std) of the source values they replace. Generators: subsets[e] seeds slot e's
    subset (shared by its tensors), values[e] this tensor's new values."""

    ratio: float
    axis: int  # the intermediate axis of a slot's tensor: gate/up rows (0), down columns (1)
    subsets: tuple[int, ...]
    values: tuple[int, ...]


@dataclass(frozen=True)
class TensorOp:
    name: str  # canonical output name (runtime.layout for the output config)
    op: PlanOp
    shape: tuple[int, ...]
    dtype: torch.dtype
    sources: tuple[Source, ...] = ()
    weights: tuple[float, ...] = ()  # mean: one per source
    std: float = 0.0  # normal
    rng_seed: int = 0  # normal
    value: float = 0.0  # full
    repeat: int = 1  # normal / unit_rows: each row drawn once and repeated this many times (virtual groups)
    drop: Drop | None = None  # stack: Drop-Upcycling's re-initialized dimensions

    @property
    def nbytes(self) -> int:
        return nbytes(self.shape, self.dtype)

    def provenance(self) -> dict[str, Any]:
        """Compact record of how this tensor was made (stored in the output's metadata)."""
        rec: dict[str, Any] = {"op": self.op}
        if self.sources:
            names = {s.name for s in self.sources}
            if len(names) == 1:
                rec["from"] = self.sources[0].name
                rec["inputs"] = [s.input for s in self.sources]
            else:
                rec["sources"] = [[s.input, s.name] for s in self.sources]
            if any(s.is_part for s in self.sources):
                rec["parts"] = [s.part() for s in self.sources]
        if self.op == "mean":
            rec["weights"] = list(self.weights)
        if self.op == "normal":
            rec["std"], rec["seed"] = self.std, self.rng_seed
        if self.op == "unit_rows":
            rec["seed"] = self.rng_seed
        if self.repeat != 1:
            rec["repeat"] = self.repeat
        if self.drop is not None:
            rec["drop"] = {"ratio": self.drop.ratio, "axis": self.drop.axis}
        if self.op == "full":
            rec["value"] = self.value
        return rec


@dataclass
class PlanInput:
    index: int
    role: Literal["seed", "expert", "mixture"]  # mixture: the trained mixture extend adds to (surgery/extend.py)
    label: str  # where it was read from (path)
    reader: Reader
    name: str = ""  # unique identifier: "seed", "code", ... (surgery.names)


@dataclass
class Plan:
    recipe: Recipe
    options: MergeOptions
    inputs: list[PlanInput]
    members: tuple[int, ...]  # input index of attention/FFN expert e, e < len(members)
    ffn_slots: tuple[int, ...]  # input index of each coarse FFN expert (members, then seed copies)
    weights: tuple[float, ...]  # normalized mean weight per member
    dense_config: ModelConfig
    config: ModelConfig
    dtype: torch.dtype
    router_std: float
    shared_kv_rule: SharedKVRule | None
    tensors: list[TensorOp] = field(default_factory=list)
    calibrated: dict[str, torch.Tensor] = field(default_factory=dict)  # op calibrated: name -> tensor
    warm_start: dict[str, Any] | None = None  # how `calibrated` was made (surgery/warm_start.py), for provenance
    router_prompts: dict[str, Any] | None = None  # the linear routers from prompts (surgery/prompts.py)

    def __post_init__(self) -> None:
        self._by_name = {t.name: t for t in self.tensors}

    @property
    def granularity(self) -> int:
        """Fine-grained experts per coarse FFN expert (1: coarse)."""
        return self.config.ffn_experts // len(self.ffn_slots) if self.ffn_slots else 1

    @property
    def ffn_expert_inputs(self) -> tuple[int, ...]:
        """Input index of each FFN expert of the output: a coarse slot's G fine-grained experts side by side."""
        return tuple(i for i in self.ffn_slots for _ in range(self.granularity))

    def __getitem__(self, name: str) -> TensorOp:
        return self._by_name[name]

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def resolved_options(self) -> dict[str, Any]:
        """Every option with its effective value (recipe defaults filled in), for provenance."""
        cfg = self.config
        return dict(seed_expert=self.members[:1] == (0,), extra_ffn_experts=len(self.ffn_slots) - len(self.members)
                    if cfg.ffn_experts else 0, ffn_top_k=cfg.ffn_top_k, gate_norm=cfg.gate_norm,
                    attention_routing="soft" if cfg.attn_top_k is None else f"top{cfg.attn_top_k}",
                    lb_coef=cfg.lb_coef, z_coef=cfg.z_coef, weights=list(self.weights),
                    dtype=str(self.dtype).removeprefix("torch."), router_seed=self.options.router_seed,
                    router_std=self.router_std, router_init=self.recipe.router_init,
                    shared_kv_rule=self.shared_kv_rule,
                    **({"router_warm_start": self.warm_start} if self.warm_start else {}),
                    **({"router_prompts": self.router_prompts} if self.router_prompts else {}),
                    **self.upcycling_options())

    def upcycling_options(self) -> dict[str, Any]:
        """Drop-Upcycling's and fine-grained upcycling's options, where they are in use (so a merge without them
        records what it always did)."""
        out: dict[str, Any] = {}
        ratio = float(self.options.resolved("drop_ratio", self.recipe)) if self.config.ffn_experts else 0.0
        if ratio:
            out.update(drop_ratio=ratio, drop_seed=self.options.drop_seed)
        if self.granularity > 1:
            out.update(ffn_granularity=self.granularity, ffn_scale=ffn_scale(self.config, self.granularity))
        return out


def ffn_scale(cfg: ModelConfig, granularity: int) -> float:
    """Fine-grained upcycling's weight scaling (He et al. 2024): the factor on each fine-grained expert's down
    projection that makes a fresh mixture compute its coarse experts. A token picks G x k experts; with virtual-group
    router rows they are k whole groups, each expert of a group at the same gate. top-k-then-softmax (topk_softmax):
    a group's G gates sum to its coarse gate, each 1/G of it, so G. softmax-then-top-k (softmax): the k groups' mass
    is k/N of a uniform router's (N coarse experts), each expert 1/(N G), so N G / k."""
    if granularity == 1:
        return 1.0
    if cfg.gate_norm == "topk_softmax":
        return float(granularity)
    return cfg.ffn_experts / (cfg.ffn_top_k / granularity)


def input_label(reader: Reader, index: int) -> str:
    return str(reader.path) if reader.path is not None else f"input {index}"


def router_rng_seed(router_seed: int, name: str) -> int:
    """Per-tensor generator seed: depends on --router-seed and the tensor name only, never on order."""
    digest = hashlib.sha256(f"{router_seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


# ---- input checks (headers only) ---------------------------------------------------------------
def check_inputs(inputs: Sequence[PlanInput]) -> dict[str, tuple[int, ...]]:
    """Every input is dense, agrees with the seed's config, and has exactly its canonical tensors.

    Returns the dense layout {name: shape} all inputs share.
    """
    seed = inputs[0]
    ref = seed.reader.config
    if ref.is_mixture:
        raise InputError(f"{seed.label}: the seed is a mixture (ffn_experts={ref.ffn_experts}, attn_experts="
                         f"{ref.attn_experts}); merge takes dense checkpoints")
    ref_fields = ref.to_dict()
    for inp in inputs[1:]:
        fields = inp.reader.config.to_dict()
        diff = [k for k in ref_fields if k != "name" and fields.get(k) != ref_fields[k]]
        if diff:
            shown = ", ".join(f"{k}={fields.get(k)!r} (seed: {ref_fields[k]!r})" for k in diff[:3])
            more = f" and {len(diff) - 3} more" if len(diff) > 3 else ""
            raise InputError(f"{inp.label}: config disagrees with the seed {seed.label}: {shown}{more}; "
                             "every input must have the seed's architecture")
    layout = tensor_shapes(ref)
    for inp in inputs:  # merges compute in float: FP8 or integer weights are refused here, not mid-merge
        check_layout(inp.reader, layout, label=inp.label, dtypes=COMPUTE_DTYPES.values())
    return layout


def file_label(reader: Reader, name: str, label: str) -> str:
    """The file holding tensor `name` (for error messages), or the input's label if the reader cannot say."""
    return str(reader.file_of(name) or label)


# ---- compile -----------------------------------------------------------------------------------
def compile_plan(recipe: Recipe, inputs: Sequence[Reader], options: MergeOptions | None = None,
                 names: Sequence[str | None] | None = None) -> Plan:
    """Plan a merge. `inputs`: readers, the seed first, then the experts in --experts order.
    `names`: one per input (None: the default, surgery.names), kept in provenance."""
    options = options or MergeOptions()
    _check_expert_count(recipe, len(inputs) - 1)
    labels = [input_label(r, i) for i, r in enumerate(inputs)]
    if names is not None and len(names) != len(inputs):
        raise ValueError(f"compile_plan: {len(names)} names for {len(inputs)} inputs")
    names = input_names(labels, list(names) if names is not None else [None] * len(inputs))
    plan_inputs = [PlanInput(i, "seed" if i == 0 else "expert", label, r, name)
                   for i, (r, label, name) in enumerate(zip(inputs, labels, names))]
    layout = check_inputs(plan_inputs)
    dense_cfg = inputs[0].config
    _check_family_kinds(recipe, dense_cfg)

    seed_expert = options.resolved("seed_expert", recipe)
    members = tuple(range(0 if seed_expert else 1, len(inputs)))
    if not members:
        raise BamSurgeryError(f"--no-seed-expert leaves recipe {recipe.name} with no input to build from; "
                              "give --experts or let the seed join")
    _check_finite_options(options)
    weights = _mean_weights(options.weights, plan_inputs, members)
    _check_shared_kv_rule(recipe, options.shared_kv_rule)
    try:
        out_cfg = mixture_config(recipe, dense_cfg, len(members), options)
    except ConfigError as e:
        raise BamSurgeryError(f"{e} (recipe {recipe.name}, {len(members)} mixture input(s))") from None
    router_std = float(options.resolved("router_std", recipe))
    std_from = "--router-std" if options.router_std is not None else f"recipe {recipe.name}: routers.std"
    dtype = _output_dtype(options.dtype, inputs[0])
    if dtype.is_floating_point and router_std * 16 > torch.finfo(dtype).max:  # |N(0,1)| samples stay below 16
        raise BamSurgeryError(f"{std_from}: {router_std:g} overflows {str(dtype).removeprefix('torch.')} (largest "
                              f"value {torch.finfo(dtype).max:.4g}): the routers would hold Inf")
    _check_router_init(recipe, out_cfg, options.warm_start)
    _check_tensors_fit(out_cfg)
    n_ffn = out_cfg.ffn_experts // options.resolved("ffn_granularity", recipe)  # coarse FFN experts
    ffn_slots = members + (0,) * (n_ffn - len(members)) if out_cfg.ffn_experts else ()
    shared_rule = options.resolved("shared_kv_rule", recipe) if recipe.shared_kv else None
    choices = Plan(recipe, options, plan_inputs, members, ffn_slots, weights, dense_cfg, out_cfg,
                   dtype, router_std, shared_rule)  # everything but the tensors
    routers = router_tensors(out_cfg)
    return dataclasses.replace(choices, tensors=[_router_op(choices, name, routers[name]) if name in routers
                                                 else _shared_op(choices, layout, name, shape) if SHARED.match(name)
                                                 else _tensor_op(choices, layout, name, shape)
                                                 for name, shape in tensor_shapes(out_cfg).items()])



def _check_family_kinds(recipe: Recipe, cfg: ModelConfig) -> None:
    """A recipe merging a model with Gated DeltaNet layers or per-layer inputs says what becomes of them
    (recipe.OPTIONAL_KINDS): a recipe written without them is refused for such a model, naming the field."""
    needs = (("attn.linear", bool(cfg.linear_layers),
              f"the seed has Gated DeltaNet layers ({ranges(cfg.linear_layers or [])}): stack (DeltaNet experts, each "
              "with its own recurrent state, mixed by the attention router), mean or seed"),
             ("ple", bool(cfg.per_layer_dim), "the seed has per-layer input embeddings: mean or seed"))
    for kind, has, what in needs:
        if has and kind not in recipe.tensors:
            raise BamSurgeryError(f"recipe {recipe.name} ({recipe.path}): tensors.{kind}: missing; {what}")


def _check_tensors_fit(cfg: ModelConfig) -> None:
    """The merge holds one output tensor at a time, in float32 while it is made: the largest must fit in
    memory (--router-hidden 2000000000 makes a 512 GB router), refused before anything is read."""
    name, shape = max(tensor_shapes(cfg).items(), key=lambda kv: math.prod(kv[1]))
    check_fits(4 * math.prod(shape), f"output tensor {name} {list(shape)} (float32)", BamSurgeryError)


def _check_router_init(recipe: Recipe, cfg: ModelConfig, warm_start: WarmStart | None) -> None:
    kinds = {k for k, n in ((cfg.ffn_router_kind, cfg.ffn_experts),
                            (cfg.attn_router_kind, cfg.attn_experts or cfg.linear_experts)) if n}
    if warm_start is not None:
        if warm_start not in WARM_STARTS:
            raise BamSurgeryError(f"--router-init: unknown init {warm_start!r}; choose one of random, "
                                  f"{', '.join(WARM_STARTS)}")
        if "expert_embedding" not in kinds:
            raise BamSurgeryError(f"--router-init {warm_start}: warm starts set expert embeddings; this mixture's "
                                  f"routers are {', '.join(sorted(kinds)) or 'none'} (use --router expert_embedding)")
    if recipe.router_init == "zeros":
        for kind in sorted(kinds):
            if not any(t.init == "logits" for t in router_class(kind).tensors(cfg, 2)):
                raise BamSurgeryError(f"recipe {recipe.name}: routers.init zeros: router kind {kind} has no tensor "
                                      "its logits are read from to zero; use routers.init normal")


def per_expert_router_tensors(kind: str, cfg: ModelConfig, n_experts: int) -> set[str]:
    """The tensors of a router kind that hold one row per expert (their leading dimension grows with E)."""
    more = {t.name: t.shape for t in router_class(kind).tensors(cfg, n_experts + 1)}
    return {t.name for t in router_class(kind).tensors(cfg, n_experts) if more[t.name] != t.shape}


def _router_op(plan: Plan, name: str, spec: RouterTensor) -> TensorOp:
    """A router tensor, made as its kind's definition says (runtime/routers.py). Fine-grained upcycling: an FFN
    router's per-expert rows are drawn once per coarse expert and repeated over its G experts (He et al.'s virtual
    groups: the G parts of one FFN always score alike, so top-(G k) routing picks k whole FFNs)."""
    dtype, init = plan.dtype, spec.init
    repeat = 1
    if plan.granularity > 1 and ".ffn_router." in name:
        cfg = plan.config
        if spec.name in per_expert_router_tensors(cfg.ffn_router_kind, cfg, cfg.ffn_experts):
            repeat = plan.granularity
    if init == "logits":
        init = "zeros" if plan.recipe.router_init == "zeros" else "normal"
    if init in ("normal", "unit"):
        return TensorOp(name, "normal", spec.shape, dtype, std=plan.router_std if init == "normal" else 1.0,
                        rng_seed=router_rng_seed(plan.options.router_seed, name), repeat=repeat)
    if init == "zeros":
        return TensorOp(name, "zeros", spec.shape, dtype)
    if init == "log_temperature":
        return TensorOp(name, "full", spec.shape, dtype, value=math.log(plan.config.router_temperature))
    if init == "unit_rows":  # random unit directions (a key store's keys)
        return TensorOp(name, "unit_rows", spec.shape, dtype, rng_seed=router_rng_seed(plan.options.router_seed, name),
                        repeat=repeat)
    if init == "fair_share":  # 1/E everywhere (a key store's usage EMA)
        return TensorOp(name, "full", spec.shape, dtype, value=1.0 / spec.shape[-1])
    raise AssertionError(f"{name}: router init {init!r} has no plan op")


def _check_finite_options(options: MergeOptions) -> None:
    """Numbers from the command line that go into the output: finite, never Inf or NaN."""
    for flag, value in (("--router-std", options.router_std), ("--lb-coef", options.lb_coef),
                        ("--z-coef", options.z_coef)):
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise BamSurgeryError(f"{flag}: must be a finite number >= 0, got {value}")


def _check_expert_count(recipe: Recipe, n_experts: int) -> None:
    if n_experts < 0:
        raise BamSurgeryError("merge needs a --seed")
    if n_experts < recipe.min_experts:
        raise BamSurgeryError(f"recipe {recipe.name} needs at least {recipe.min_experts} --experts "
                              f"(experts.min), got {n_experts}")
    if recipe.max_experts is not None and n_experts > recipe.max_experts:
        what = "no --experts" if recipe.max_experts == 0 else f"at most {recipe.max_experts} --experts"
        raise BamSurgeryError(f"recipe {recipe.name} takes {what} (experts.max), got {n_experts}")


def _check_shared_kv_rule(recipe: Recipe, rule: SharedKVRule | None) -> None:
    if rule is None:
        return
    if rule not in SHARED_KV_RULES:
        raise BamSurgeryError(f"--shared-kv-rule: unknown rule {rule!r}; choose one of {', '.join(SHARED_KV_RULES)}")
    if not recipe.shared_kv:
        raise BamSurgeryError(f"--shared-kv-rule: recipe {recipe.name} has no shared K/V (it needs "
                              "tensors.attn.q: stack and tensors.attn.k: mean or seed)")


def _shared_op(plan: Plan, layout: dict[str, tuple[int, ...]], name: str, shape: tuple[int, ...]) -> TensorOp:
    """The shared FFN expert (recipe shared_expert: seed): a copy of the seed's FFN; its gate's weight starts at
    zero, so the shared expert's output is scaled by sigmoid(0) = 1/2 for every token until training moves it."""
    m = SHARED.match(name)
    if m["gate"]:
        return TensorOp(name, "zeros", shape, plan.dtype)
    src = f"{m['layer']}.ffn.{m['rest']}"
    if tuple(layout[src]) != tuple(shape):
        raise AssertionError(f"{name}: planned shape {layout[src]} != layout shape {shape}")
    return TensorOp(name, "copy", shape, plan.dtype, (Source(0, src),))


def _tensor_op(plan: Plan, layout: dict[str, tuple[int, ...]], name: str, shape: tuple[int, ...]) -> TensorOp:
    """How output tensor `name` is made (not a router): a stack over expert slots, a copy or a mean."""
    dtype, members = plan.dtype, plan.members
    stacked = STACKED.match(name)
    # the dense tensor it is made from: layers.3.ffn_experts.up.weight <- layers.3.ffn.up.weight
    src = f"{stacked['layer']}.{stacked['group']}.{stacked['rest']}" if stacked else name
    kind = dense_kind(src)
    op = plan.recipe.op(kind, plan.shared_kv_rule)
    if stacked and stacked["group"] == "ffn":
        t = _ffn_stack(plan, name, src, shape)
        expected = (len(plan.ffn_expert_inputs), *part_shape(layout[src], intermediate_axis(src), plan.granularity))
    elif stacked:
        t = TensorOp(name, "stack", shape, dtype, tuple(Source(i, src) for i in members))
        expected = (len(members), *layout[src])
    elif op == "stack":  # cannot happen: mixture_config stacks exactly the recipe's stacked kinds
        raise AssertionError(f"{name}: recipe stacks {kind} but the output layout does not")
    elif op == "seed" or len(members) == 1:
        t = TensorOp(name, "copy", shape, dtype, (Source(0 if op == "seed" else members[0], src),))
        expected = layout[src]
    else:
        t = TensorOp(name, "mean", shape, dtype, tuple(Source(i, src) for i in members), plan.weights)
        expected = layout[src]
    if tuple(expected) != tuple(shape):
        raise AssertionError(f"{name}: planned shape {expected} != layout shape {shape}")
    return t


def part_shape(shape: tuple[int, ...], axis: int | None, granularity: int) -> tuple[int, ...]:
    """A dense FFN tensor's shape as each of its `granularity` parts along `axis` holds it."""
    if axis is None:
        return tuple(shape)
    return tuple(n // granularity if a == axis else n for a, n in enumerate(shape))


def intermediate_axis(dense_name: str) -> int | None:
    """The FFN intermediate dimension of a dense FFN tensor: rows of gate and up (weights and biases), columns of
    down's weight; None for down's bias [D]."""
    if dense_name.endswith("down.bias"):
        return None
    return 1 if dense_name.endswith("down.weight") else 0


def ffn_part(i: int, src: str, g: int, granularity: int, scale: float, row: int | None = None) -> Source:
    """Source of one FFN expert: expert `row` of input i's tensor (or its dense tensor), its g-th of `granularity`
    parts along the intermediate axis; the down projection times `scale` (down's bias times scale / granularity:
    each of a group's experts adds it at 1/G of the group's gate)."""
    axis = intermediate_axis(src)
    if granularity == 1:
        return Source(i, src, row)
    if axis is None:
        return Source(i, src, row, None, scale / granularity)
    return Source(i, src, row, (axis, g, granularity), scale if src.endswith("down.weight") else 1.0)


def _ffn_stack(plan: Plan, name: str, src: str, shape: tuple[int, ...]) -> TensorOp:
    """A stacked FFN tensor: one slot per FFN expert (fine-grained: G parts of each coarse slot's FFN, scaled),
    with Drop-Upcycling's re-initialized dimensions."""
    G, scale = plan.granularity, ffn_scale(plan.config, plan.granularity)
    sources = tuple(ffn_part(i, src, g, G, scale) for i in plan.ffn_slots for g in range(G))
    return TensorOp(name, "stack", shape, plan.dtype, sources, drop=drop_spec(plan, name, src, len(sources)))


def drop_spec(plan: Plan, name: str, src: str, n_slots: int, first_slot: int = 0) -> Drop | None:
    """Drop-Upcycling of an FFN tensor's slots first_slot.. (None: --drop-ratio 0, or down's bias, which has no
    intermediate dimension). A slot's subset is seeded from --drop-seed, its layer and its slot alone, so its gate,
    up and down share it; its values from the tensor's name and the slot."""
    ratio = float(plan.options.resolved("drop_ratio", plan.recipe))
    axis = intermediate_axis(src)
    if not ratio or axis is None:
        return None
    layer = name.split(".ffn_experts.")[0]
    seed = plan.options.drop_seed
    slots = range(first_slot, first_slot + n_slots)
    return Drop(ratio, axis, tuple(router_rng_seed(seed, f"{layer}.ffn_experts/{e}") for e in slots),
                tuple(router_rng_seed(seed, f"{name}/{e}") for e in slots))


def _mean_weights(weights: Sequence[float] | None, inputs: list[PlanInput], members: tuple[int, ...]
                  ) -> tuple[float, ...]:
    if weights is None:
        return tuple(1.0 / len(members) for _ in members)
    who = ", ".join(inputs[i].label for i in members)
    if len(weights) != len(members):
        raise BamSurgeryError(f"--weights: got {len(weights)} weight(s) for {len(members)} mixture input(s) "
                              f"({who}); give one per input, in that order")
    if any(not math.isfinite(w) or w < 0 for w in weights) or max(weights) <= 0:
        raise BamSurgeryError(f"--weights: {list(weights)} must be finite, >= 0 and not all zero")
    top = max(weights)  # scaled first: 1e308 + 1e308 would overflow the sum
    scaled = [w / top for w in weights]
    total = math.fsum(scaled)
    return tuple(w / total for w in scaled)


def _output_dtype(dtype: str | torch.dtype | None, seed: Reader) -> torch.dtype:
    if dtype is None:
        return seed.dtype("embed.weight")
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in COMPUTE_DTYPES:
        raise BamSurgeryError(f"--dtype: unknown dtype {dtype!r}; choose one of {', '.join(COMPUTE_DTYPES)}")
    return COMPUTE_DTYPES[dtype]


# ---- printing (--dry-run) ----------------------------------------------------------------------
_LAYER = re.compile(r"layers\.(\d+)\.")


def _plan_header(plan: Plan) -> list[str]:
    """format_plan's first lines: the recipe, the inputs, the output's experts and routing, the routers, the means."""
    cfg, lines = plan.config, []
    lines.append(f"recipe   {plan.recipe.name} ({plan.recipe.path}): {plan.recipe.summary()}")
    for inp in plan.inputs:
        member = (f"expert {plan.members.index(inp.index)}" if inp.index in plan.members else "not an expert")
        lines.append(f"input {inp.index}  {inp.role:<6} {inp.name}={inp.label}  [{member}]")
    extra = len(plan.ffn_slots) - len(plan.members) if cfg.ffn_experts else 0
    routing = []
    if cfg.ffn_experts:
        G, up = plan.granularity, plan.upcycling_options()
        routing.append(f"FFN experts {cfg.ffn_experts}" + (f" ({extra} copied from the seed)" if extra else "")
                       + (f", fine-grained: {G} per FFN of width {cfg.ffn_hidden}, down x{up['ffn_scale']:g}"
                          if G > 1 else "")
                       + (f", Drop-Upcycling {up['drop_ratio']:g} (--drop-seed {up['drop_seed']})"
                          if "drop_ratio" in up else "")
                       + f", top-{cfg.ffn_top_k} {cfg.gate_norm}")
    if cfg.attn_experts:
        routing.append(f"attention experts {cfg.attn_experts} (kv {cfg.kv_mode}"
                       + (f", shared K/V by {plan.shared_kv_rule}" if cfg.kv_mode == "shared" else "") + "), "
                       + ("soft routing" if cfg.attn_top_k is None else f"top-{cfg.attn_top_k} routing"))
    if cfg.linear_experts:
        routing.append(f"Gated DeltaNet experts {cfg.linear_experts} in layers {ranges(cfg.linear_layers)}, "
                       + ("soft routing" if cfg.attn_top_k is None else f"top-{cfg.attn_top_k} routing"))
    lines.append("output   " + ("; ".join(routing) or "dense") + f"; dtype {str(plan.dtype).removeprefix('torch.')}"
                 f"; alpha={cfg.lb_coef} beta={cfg.z_coef}")
    if cfg.ffn_experts or cfg.attn_experts or cfg.linear_experts:
        attn = cfg.attn_experts or cfg.linear_experts
        kinds = {k for k, n in ((cfg.ffn_router_kind, cfg.ffn_experts), (cfg.attn_router_kind, attn)) if n}
        kind = ("" if kinds == {"linear"} else f"kind FFN {cfg.ffn_router_kind}, attention {cfg.attn_router_kind}; "
                if cfg.ffn_experts and attn else f"kind {kinds.pop()}; ")
        warm = (f"; expert embeddings warm-started ({plan.warm_start['init']}, {plan.warm_start['tokens']:,} "
                "calibration tokens)" if plan.warm_start else f"; expert embeddings from --router-init "
                f"{plan.options.warm_start} (computed when the merge runs)" if plan.options.warm_start else "")
        if plan.options.router_prompts:
            warm += f"; linear routers from --router-prompts {plan.options.router_prompts}" + (
                "" if plan.router_prompts else " (computed when the merge runs)")
        lines.append(f"routers  {kind}{plan.recipe.router_init}" + (f"(0, {plan.router_std})" if plan.recipe.router_init
                     == "normal" else "") + f", seeded per tensor from --router-seed {plan.options.router_seed}"
                     + warm)
    if len(plan.members) > 1:
        lines.append("mean     weights " + ", ".join(f"{w:.4g}" for w in plan.weights)
                     + " over inputs " + ",".join(map(str, plan.members)))
    return lines


def format_plan(plan: Plan) -> str:
    """The plan, one line per tensor pattern; layers with identical patterns are folded into {i}."""
    lines = _plan_header(plan)
    lines.append("")
    groups: dict[tuple, list[int]] = defaultdict(list)
    order: list[tuple] = []
    for t in plan.tensors:
        m = _LAYER.match(t.name)
        layer = int(m.group(1)) if m else -1
        pattern = _LAYER.sub("layers.{i}.", t.name)
        srcs = tuple(_LAYER.sub("layers.{i}.", s.name) for s in t.sources)
        key = (pattern, t.op, t.shape, tuple(s.input for s in t.sources), srcs)
        if key not in groups:
            order.append(key)
        groups[key].append(layer)
    width = max(len(k[0]) for k in order)
    for key in order:
        pattern, op, shape, ins, srcs = key
        layers = groups[key]
        where = "" if layers == [-1] else f"  i={ranges(layers)}"
        if op in ("stack", "mean"):
            how = f"{op} inputs {','.join(map(str, ins))} <- {srcs[0]}" if len(set(srcs)) == 1 else f"{op} {srcs}"
        elif op == "copy":
            how = f"copy input {ins[0]} <- {srcs[0]}"
        else:
            how = op
        lines.append(f"  {pattern:<{width}}  {str(list(shape)):<16} {how}{where}")
    lines.append("")
    lines.append(f"{len(plan.tensors)} tensors, {sum(math.prod(t.shape) for t in plan.tensors):,} parameters, "
                 f"{plan.total_bytes:,} bytes")
    return "\n".join(lines)
