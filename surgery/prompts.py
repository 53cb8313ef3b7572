"""Linear routers initialized from prompts (merge --router-prompts FILE): a stage between compiling a merge plan
and executing it, like the warm starts of surgery/warm_start.py.

    prompts = read_prompt_file("moe.yaml")       # mergekit-moe's shape, checked before any checkpoint is read
    check_prompts(plan, prompts)                 # one entry per FFN expert, naming that expert's input
    plan = prompt_start(plan, prompts)           # the routers' rows enter the plan as op `calibrated`

The file is mergekit-moe's merge config, of which this reads:

    base_model: PATH|NAME            optional; must name the --seed
    gate_mode: hidden                hidden | hidden_avg | hidden_last | cheap_embed | random (default hidden)
    experts_per_token: 2             optional; must equal the mixture's top-k (coarse: --ffn-top-k)
    experts:                         one entry per FFN expert, in order (the seed's slot first when it joins,
      - source_model: PATH|NAME        then the --experts, then the copies of --extra-ffn-experts); source_model
        positive_prompts: [...]        names that expert's input (its name, e.g. code, or its path)
        negative_prompts: [...]        optional

Expert e's row, for every linear router that routes it (each layer's FFN router; the attention routers too, whose
expert e is the same input), is the unit vector along m(positive) - m(negative) (m(negative) = 0 without negative
prompts):
    hidden, hidden_last m = the mean over the prompts of their last token's router-input state (the block's normed
                        state the router reads), as mergekit's "hidden" takes each prompt's last token; the merged
                        model in float32 runs the prompts layer by layer, so a router sees the states that the
                        routers before it, already set, produce
    hidden_avg          m = the mean router-input state over every token of the prompts (mergekit's hidden_avg)
    cheap_embed         m = the unit sum of the prompts' token embeddings, the same rows in every layer (mergekit's,
                        which also subtracts unit sums)
    random              no rows from prompts: the routers' random init (the file is accepted as mergekit takes it)
Each prompt is tokenized by the seed's tokenizer (or --tokenizer), after the token a document starts with (BOS, or
else EOS as between documents in training); that token is left out of the means. Fine-grained mixtures
(--ffn-granularity G): a coarse expert's row repeated over its G experts (virtual groups kept). mergekit's "hidden"
reads the base model's residual stream before each layer; here it is what each router reads.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from bam_surgery.converters.yamlfile import read_yaml, shown
from bam_surgery.runtime import model_from_reader
from bam_surgery.runtime.routers import LinearRouter

from .errors import BamSurgeryError
from .plan import Plan
from .plan_reader import PlanReader

GATE_MODES = ("hidden", "hidden_avg", "hidden_last", "cheap_embed", "random")
TOP_LEVEL = ("base_model", "gate_mode", "experts_per_token", "experts")
EXPERT_KEYS = ("source_model", "positive_prompts", "negative_prompts")
# mergekit-moe keys this tool takes from its own options, and the option to use
ELSEWHERE = {"dtype": "--dtype", "architecture": "--format", "shared_experts": "--recipe btx-shared-expert",
             "noise_scale": "no counterpart", "residual_scale": "no counterpart"}
MAX_PROMPT_TOKENS = 4096  # per expert and sign: prompts are a few sentences
Log = Callable[[str], None]


@dataclass(frozen=True)
class ExpertPrompts:
    source_model: str
    positive: tuple[str, ...]
    negative: tuple[str, ...]


@dataclass(frozen=True)
class PromptFile:
    path: str
    gate_mode: str
    experts: tuple[ExpertPrompts, ...]
    base_model: str | None = None
    experts_per_token: int | None = None

    def record(self) -> dict[str, Any]:
        """What the provenance keeps: the whole request, prompts included (the file may change later)."""
        return {"file": self.path, "gate_mode": self.gate_mode,
                "experts": [{"source_model": e.source_model, "positive_prompts": list(e.positive),
                             "negative_prompts": list(e.negative)} for e in self.experts]}


def read_prompt_file(path: str) -> PromptFile:
    """The file, checked (bounded YAML; every error one line naming the file and the field)."""
    where = f"--router-prompts {path}"

    def fail(fld: str, msg: str) -> BamSurgeryError:
        return BamSurgeryError(f"{where}: {fld}: {msg}")

    if not Path(path).is_file():
        raise BamSurgeryError(f"{where}: file not found")
    doc = read_yaml(path, where, error=BamSurgeryError)
    if not isinstance(doc, dict):
        raise BamSurgeryError(f"{where}: must be a YAML mapping with {', '.join(TOP_LEVEL)} (mergekit-moe's shape)")
    for key in doc:
        if key in ELSEWHERE:
            raise fail(str(key), f"not read from this file ({ELSEWHERE[key]})")
        if key not in TOP_LEVEL:
            raise fail(shown(key, 40), f"unknown field; the fields are {', '.join(TOP_LEVEL)}")
    mode = doc.get("gate_mode", "hidden")
    if mode not in GATE_MODES:
        raise fail("gate_mode", f"{shown(mode, 40)} is not one of {', '.join(GATE_MODES)}")
    base = doc.get("base_model")
    if base is not None and not isinstance(base, str):
        raise fail("base_model", "a path or an input's name")
    k = doc.get("experts_per_token")
    if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 1):
        raise fail("experts_per_token", f"a positive integer, got {shown(k, 40)}")
    entries = doc.get("experts")
    if not isinstance(entries, list) or not entries:
        raise fail("experts", "a list with one entry per FFN expert ({source_model, positive_prompts, "
                              "negative_prompts})")
    experts = tuple(_expert(e, f"experts[{i}]", fail, mode) for i, e in enumerate(entries))
    if mode != "random" and len({(e.positive, e.negative) for e in experts}) == 1 and len(experts) > 1:
        raise fail("experts", "every expert has the same prompts: their rows would be equal and route nothing apart")
    return PromptFile(str(path), mode, experts, base, k)


def _expert(entry: Any, where: str, fail, mode: str) -> ExpertPrompts:
    if not isinstance(entry, dict):
        raise fail(where, "a mapping with source_model, positive_prompts and negative_prompts")
    for key in entry:
        if key in ELSEWHERE:
            raise fail(f"{where}.{key}", f"not read from this file ({ELSEWHERE[key]})")
        if key not in EXPERT_KEYS:
            raise fail(f"{where}.{shown(key, 40)}", f"unknown field; the fields are {', '.join(EXPERT_KEYS)}")
    source = entry.get("source_model")
    if not isinstance(source, str) or not source:
        raise fail(f"{where}.source_model", "required: the expert's input (its name, e.g. code, or its path)")
    lists = []
    for key in ("positive_prompts", "negative_prompts"):
        value = entry.get(key) or []
        if not isinstance(value, list) or not all(isinstance(p, str) and p.strip() for p in value):
            raise fail(f"{where}.{key}", "a list of non-empty strings")
        lists.append(tuple(value))
    if mode != "random" and not lists[0]:
        raise fail(f"{where}.positive_prompts", f"required by gate_mode {mode}: at least one prompt")
    return ExpertPrompts(source, *lists)


# ---- against the plan ------------------------------------------------------------------------------------
def _names_input(plan: Plan, i: int, spec: str) -> bool:
    inp = plan.inputs[i]
    if spec in (inp.name, inp.label):
        return True
    try:
        return Path(spec).expanduser().resolve() == Path(inp.label).resolve()
    except (OSError, ValueError):
        return False


def routed(plan: Plan) -> list[tuple[str, str, int]]:
    """(router prefix, kind, experts) of every router of the mixture, in execution order."""
    cfg = plan.config
    return [(f"layers.{i}.{group}_router", kind, E) for i in range(cfg.n_layers)
            for group, kind, E in (("attn", cfg.attn_router_kind, cfg.attn_experts),
                                   ("ffn", cfg.ffn_router_kind, cfg.ffn_experts)) if E]


def check_prompts(plan: Plan, prompts: PromptFile) -> None:
    """The file against the mixture: linear routers only, one entry per FFN expert naming its input, the seed,
    the top-k."""
    where = f"--router-prompts {prompts.path}"
    cfg = plan.config
    kinds = sorted({kind for _, kind, _ in routed(plan)})
    if not cfg.ffn_experts:
        raise BamSurgeryError(f"{where}: one entry per FFN expert; recipe {plan.recipe.name} has no FFN experts")
    if kinds != [LinearRouter.kind]:
        raise BamSurgeryError(f"{where}: sets linear routers; this mixture's routers are {', '.join(kinds)} (use "
                              "--router linear; expert_embedding routers warm-start with --router-init)")
    slots = plan.ffn_slots
    if len(prompts.experts) != len(slots):
        raise BamSurgeryError(f"{where}: experts: {len(prompts.experts)} entries for {len(slots)} FFN experts (the "
                              f"inputs {', '.join(plan.inputs[i].name for i in slots)}, in this order)")
    for e, (entry, i) in enumerate(zip(prompts.experts, slots)):
        if not _names_input(plan, i, entry.source_model):
            raise BamSurgeryError(f"{where}: experts[{e}].source_model: {shown(entry.source_model, 80)} is not FFN "
                                  f"expert {e}'s input, {plan.inputs[i].name}={plan.inputs[i].label}")
    if prompts.base_model is not None and not _names_input(plan, 0, prompts.base_model):
        raise BamSurgeryError(f"{where}: base_model: {shown(prompts.base_model, 80)} is not the --seed "
                              f"{plan.inputs[0].label}")
    top_k = cfg.ffn_top_k // plan.granularity
    if prompts.experts_per_token is not None and prompts.experts_per_token != top_k:
        raise BamSurgeryError(f"{where}: experts_per_token: {prompts.experts_per_token}, the mixture routes to "
                              f"{top_k} (give --ffn-top-k {prompts.experts_per_token})")


# ---- the rows ---------------------------------------------------------------------------------------------
PromptIds = list[list[list[int]]]  # per entry, per sign (positive, negative): each prompt's ids, the start token first


def unit(v: torch.Tensor, what: str) -> torch.Tensor:
    """v / |v|; a zero difference (the positive and negative means equal) is an error naming `what`."""
    n = float(v.norm())
    if not math.isfinite(n) or n <= 1e-12 * max(1.0, float(v.abs().max())):
        raise BamSurgeryError(f"{what}: the positive and negative texts give the same mean; their row would be zero")
    return v / n


def prompt_ids(prompts: PromptFile, seed, cfg, tokenizer: str | None) -> PromptIds:
    """Every entry's prompts tokenized by the seed's tokenizer (or `tokenizer`), checked against max_positions."""
    from bam_surgery.train.tokenize import resolve_tokenizer  # lazy: the tokenizers package, for prompts only

    tok = resolve_tokenizer(tokenizer, seed, cfg.vocab_size)
    start = tok.bos_id if tok.bos_id is not None else tok.eos_id
    limit = cfg.max_positions
    out = []
    for e, entry in enumerate(prompts.experts):
        signs = []
        for sign, texts in (("positive", entry.positive), ("negative", entry.negative)):
            ids = [[start, *map(int, a)] for a in tok.encode_batch(list(texts))]
            for p, seq in enumerate(ids):
                if len(seq) < 2 or len(seq) > limit:
                    raise BamSurgeryError(f"--router-prompts {prompts.path}: experts[{e}].{sign}_prompts[{p}]: "
                                          f"{len(seq) - 1} tokens; a prompt needs 1 to {limit - 1} (max_positions)")
            if sum(len(s) - 1 for s in ids) > MAX_PROMPT_TOKENS:
                raise BamSurgeryError(f"--router-prompts {prompts.path}: experts[{e}].{sign}_prompts: more than "
                                      f"{MAX_PROMPT_TOKENS} tokens; a few sentences per expert are what routing needs")
            signs.append(ids)
        out.append(signs)
    return out


def cheap_rows(embed: torch.Tensor, ids: PromptIds) -> torch.Tensor:
    """cheap_embed: per entry, the unit sum of its positive prompts' embeddings minus that of its negative ones, as
    a unit vector [entries, D]."""
    def unit_sum(seqs, e):
        return unit(embed[[t for s in seqs for t in s[1:]]].float().sum(0), f"--router-prompts experts[{e}]")

    return torch.stack([unit(unit_sum(pos, e) - (unit_sum(neg, e) if neg else 0), f"--router-prompts experts[{e}]")
                        for e, (pos, neg) in enumerate(ids)])


def prompt_windows(ids: PromptIds, last_only: bool) -> tuple[list, torch.Tensor, int]:
    """The prompts as windows (one each), the group of every input position (2 e: entry e's positive prompts,
    2 e + 1 its negative ones; the start token, and all but the last token in last_only, to the ignored group),
    and that group's index."""
    from .warm_start import Window  # lazy, as prompt_ids

    ignore = 2 * len(ids)
    windows, labels = [], []
    for e, signs in enumerate(ids):
        for s, seqs in enumerate(signs):
            for seq in seqs:
                windows.append(Window(2 * e + s, torch.tensor(seq + [seq[-1]])))  # a dummy target after the prompt
                lab = [ignore] * len(seq)
                for p in range(len(seq) - 1 if last_only else 1, len(seq)):
                    lab[p] = 2 * e + s
                labels.append(torch.tensor(lab))
    return windows, torch.cat(labels), ignore


def prompt_contrasts(ids: PromptIds, router: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """From a router's group means (prompt_windows' groups), each entry's unit contrast [entries, D]."""
    def rows(means: torch.Tensor) -> torch.Tensor:
        return torch.stack([unit(means[2 * e] - (means[2 * e + 1] if neg else 0),
                                 f"--router-prompts experts[{e}], {router}") for e, (_, neg) in enumerate(ids)])
    return rows


RowsOf = Callable[[str, torch.Tensor], torch.Tensor]  # (router, its group means [groups, D]) -> its weight


@torch.no_grad()
def layer_by_layer(model, routers: list[str], windows, labels: torch.Tensor, n_groups: int, rows_of: RowsOf
                   ) -> dict[str, torch.Tensor]:
    """Each router's weight from the mean input states of the windows' groups, router by router in execution
    order, each set in the model before the next is computed (so a router sees the states the routers before it
    produce); a group without tokens has a zero mean."""
    from .warm_start import group_means  # lazy, as prompt_ids

    modules = model.routers()
    out: dict[str, torch.Tensor] = {}
    for name in routers:
        sums, counts = group_means(model, modules[name], windows, labels, n_groups, model.config.d_model)
        out[name] = rows_of(name, (sums / counts[:, None].clamp(min=1)).float())
        modules[name].weight.copy_(out[name])
    return out


def _router_rows(plan: Plan, router: str, entries: torch.Tensor) -> torch.Tensor:
    """A router's weight from one row per FFN-expert entry: an FFN router's coarse rows repeated over their G
    fine-grained experts; an attention router's expert e is the member e (the first entries)."""
    if router.endswith("ffn_router"):
        return entries.repeat_interleave(plan.granularity, dim=0)
    return entries[:len(plan.members)]


@torch.no_grad()
def prompt_start(plan: Plan, prompts: PromptFile, tokenizer: str | None = None, log: Log | None = None) -> Plan:
    """The plan with every linear router's weight computed from the prompts (op calibrated)."""
    log = log or (lambda msg: None)
    check_prompts(plan, prompts)
    record = prompts.record()
    if prompts.gate_mode == "random":
        return dataclasses.replace(plan, router_prompts=record)
    ids = prompt_ids(prompts, plan.inputs[0].reader, plan.config, tokenizer)
    routers = [name for name, _, _ in routed(plan)]
    if prompts.gate_mode == "cheap_embed":
        same = cheap_rows(PlanReader(plan, hash_inputs=False).get("embed.weight"), ids)
        weights = {name: _router_rows(plan, name, same) for name in routers}
    else:
        windows, labels, ignore = prompt_windows(ids, prompts.gate_mode != "hidden_avg")
        model = model_from_reader(PlanReader(plan, hash_inputs=False), dtype=torch.float32)
        weights = layer_by_layer(model, routers, windows, labels, ignore + 1,
                                 lambda name, means: _router_rows(plan, name, prompt_contrasts(ids, name)(means)))
        log(f"router prompts: {len(routers)} routers from {int((labels != ignore).sum()):,} prompt tokens")
    calibrated = {**plan.calibrated, **{f"{name}.weight": w for name, w in weights.items()}}
    tensors = [dataclasses.replace(t, op="calibrated", sources=(), std=0.0, rng_seed=0, repeat=1)
               if t.name in calibrated else t for t in plan.tensors]
    record["tokens"] = int(sum(len(s) - 1 for signs in ids for seqs in signs for s in seqs))
    return dataclasses.replace(plan, tensors=tensors, calibrated=calibrated, router_prompts=record)
