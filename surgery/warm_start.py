"""Warm starts of expert_embedding routers from calibration data: a stage between compiling a merge plan and
executing it.

    plan = compile_plan(recipe, readers, MergeOptions(ffn_router="expert_embedding", warm_start="domain-mean"))
    plan = warm_start(plan, Calibration("code=data/code,general=data/general"))
    execute_plan(plan, out)          # the embeddings are written as op `calibrated`

The merged model (every tensor as the plan makes it, in float32) runs over the calibration tokens. Routers
are calibrated one at a time in execution order (layer 0's attention router, layer 0's FFN router, layer 1's,
...): each pass runs the data up to that router's input only, so a router sees the states produced by the
routers already calibrated before it ("layer by layer, through the merged model"). Each expert's embedding
m_e is the mean router-input state x (the block's normed state, [D]) over the tokens of its group:

    domain-mean   the group of expert e is the calibration domain of its input: the domain named like the
                  input (--experts code=PATH: domain `code`); the seed's domain is the one named like the seed
                  (--seed general=PATH) or else `general`. FFN slots copied from the seed (--extra-ffn-experts)
                  share the seed's domain. A missing domain is an error.
    profile       each calibration token position t goes to the input whose dense model predicts token t+1
                  with the lowest loss among the router's experts' inputs (ties: the first in input order);
                  slots copied from the same input share its embedding. An input that wins no token is an
                  error.

Memory: the merged model in float32 (and, for profile, one dense model at a time), one batch of states, and
per router a float64 sum [groups, D]; states are never kept. Cost: the pass for layer i's routers runs
blocks 0..i, so about L/2 forward passes over the calibration tokens (plus one per input for profile).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch
import torch.nn.functional as F

from bam_surgery.runtime import model_from_reader
from bam_surgery.runtime.routers import ExpertEmbeddingRouter
from bam_surgery.train.data import Domain, Source, open_source, parse_data_spec
from bam_surgery.train.tokenize import cached_tokens, resolve_tokenizer, token_cache_folder

from .errors import BamSurgeryError
from .plan import Plan
from .plan_reader import PlanReader

SEED_DOMAIN = "general"
DEFAULT_TOKENS = 8192  # per domain
MAX_WINDOW = 256
BATCH_WINDOWS = 8

Log = Callable[[str], None]


@dataclass(frozen=True)
class Calibration:
    spec: str  # a data SPEC as train takes it (train/data.py): NAME=SOURCE,...
    tokens_per_domain: int = DEFAULT_TOKENS
    tokenizer: str | None = None  # None: the seed's (train/tokenize.py rules)
    token_cache: str | None = None
    text_field: str = "text"


@dataclass
class Window:
    domain: int  # index into the calibration domains
    tokens: torch.Tensor  # [T + 1] int64: inputs tokens[:-1], targets tokens[1:]


class _Captured(Exception):
    """Stops a forward pass at the router being calibrated, once its input is accumulated."""


def seed_domain(plan: Plan, domain_names: list[str]) -> str:
    seed = plan.inputs[0].name
    return seed if seed in domain_names else SEED_DOMAIN


def calibration_windows(plan: Plan, calib: Calibration, domains: list[Domain], log: Log) -> list[Window]:
    """Tokenize each calibration domain (its train split, through the token cache) and cut its first
    tokens_per_domain tokens into windows of at most MAX_WINDOW tokens (plus the next token, the target)."""
    if calib.tokens_per_domain < 1:
        raise BamSurgeryError(f"--calibration-tokens: must be >= 1, got {calib.tokens_per_domain}")
    cfg = plan.config
    tok = resolve_tokenizer(calib.tokenizer, plan.inputs[0].reader, cfg.vocab_size)
    cache = token_cache_folder(calib.token_cache)
    T = min(MAX_WINDOW, cfg.max_positions)
    windows: list[Window] = []
    counts = []
    for d, dom in enumerate(domains):
        stream = first_tokens(open_source(dom, "train", calib.text_field), tok, cache, calib.tokens_per_domain + 1)
        n = min(calib.tokens_per_domain, len(stream) - 1)
        if n < 1:
            raise BamSurgeryError(f"--calibration: domain {dom.name} holds {len(stream)} token(s); it needs at "
                                  "least 2 (one token and the next)")
        ids = torch.from_numpy(np.asarray(stream[: n + 1], dtype=np.int64))
        windows += [Window(d, ids[s: min(s + T, n) + 1]) for s in range(0, n, T)]
        counts.append(n)
    shown = ", ".join(f"{dom.name} {c:,}" for dom, c in zip(domains, counts))
    log(f"calibration: {sum(counts):,} tokens ({shown}), tokenizer {tok.name}, windows of up to {T}")
    return windows


def first_tokens(source: Source, tok, cache: Path, n: int) -> np.ndarray:
    """The first n tokens of the source (fewer if it holds fewer), documents ended by EOS as in the token
    cache: the cached split if train or eval tokenized it (a trusted entry, verified: train/tokenize.py), else
    read from the start and tokenized only until n tokens are in hand, so a calibration never reads (or
    decompresses) more of its data than it uses. Nothing is cached: the cache holds whole splits."""
    cached = cached_tokens(source, tok, cache)
    if cached is not None:
        return cached.tokens[:n]
    eos = np.array([tok.eos_id], dtype=np.int64)
    parts: list[np.ndarray] = []
    have = 0
    for doc in source.documents():
        (ids,) = tok.encode_batch([doc])
        parts += [np.asarray(ids, dtype=np.int64), eos]
        have += len(ids) + 1
        if have >= n:
            break
    if have <= len(parts) // 2:  # only EOS tokens
        raise BamSurgeryError(f"--calibration: {source.describe()}: no text (no documents, or only empty ones)")
    return np.concatenate(parts)[:n]


def batches(windows: list[Window]) -> Iterator[list[Window]]:
    """Runs of up to BATCH_WINDOWS windows of equal length, in order (no padding)."""
    run: list[Window] = []
    for w in windows:
        if run and (len(run) == BATCH_WINDOWS or len(w.tokens) != len(run[0].tokens)):
            yield run
            run = []
        run.append(w)
    if run:
        yield run


def expert_inputs(plan: Plan, router: str) -> tuple[int, ...]:
    """Input index of each expert slot of a router (layers.{i}.ffn_router or layers.{i}.attn_router)."""
    return plan.ffn_expert_inputs if router.endswith("ffn_router") else plan.members


@torch.no_grad()
def token_losses(plan: Plan, windows: list[Window], inputs: tuple[int, ...]) -> torch.Tensor:
    """Next-token loss of each input's dense model at every calibration position: [len(inputs), positions],
    positions in window order (one float per position and input; states are not kept)."""
    out = []
    for i in inputs:  # one dense model in memory at a time
        model = model_from_reader(plan.inputs[i].reader, dtype=torch.float32)
        rows = []
        for run in batches(windows):
            ids = torch.stack([w.tokens for w in run])
            logits = model(ids[:, :-1]).logits.float()
            rows.append(F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none").reshape(-1))
        out.append(torch.cat(rows))
        del model
    return torch.stack(out)


def winners(losses: torch.Tensor, inputs: tuple[int, ...], candidates: tuple[int, ...]) -> torch.Tensor:
    """Per position, the input among `candidates` with the lowest loss (ties: the earlier input) [positions]."""
    rows = [inputs.index(i) for i in candidates]  # candidates sorted: argmin's first minimum is the earlier input
    return torch.tensor(candidates)[losses[rows].argmin(0)]


@torch.no_grad()
def warm_start(plan: Plan, calib: Calibration, log: Log | None = None) -> Plan:
    """The plan with every expert_embedding router's embeddings computed from data (op calibrated)."""
    log = log or (lambda msg: None)
    mode = plan.options.warm_start
    if mode not in ("domain-mean", "profile"):
        raise BamSurgeryError(f"--router-init: warm start {mode!r} is not domain-mean or profile")
    domains = parse_data_spec(calib.spec, "--calibration")
    names = [dom.name for dom in domains]
    routers = _calibrated_routers(plan.config)
    # the group of each token position: a domain index (domain-mean) or an input index (profile)
    if mode == "domain-mean":  # expert <-> domain, checked before any data is read
        group_of_input = _domain_of_input(plan, routers, names)
    windows = calibration_windows(plan, calib, domains, log)
    model = model_from_reader(PlanReader(plan, hash_inputs=False), dtype=torch.float32)
    if mode == "domain-mean":
        labels_of = dict.fromkeys(routers, torch.cat([torch.full((len(w.tokens) - 1,), w.domain, dtype=torch.long)
                                                      for w in windows]))  # positions in window order
        n_groups = len(names)
    else:  # each router: argmin over the inputs of its own experts
        labels_of, group_of_input = _profile_labels(plan, windows, routers, log)
        n_groups = len(plan.inputs)

    calibrated: dict[str, torch.Tensor] = {}
    modules = model.routers()
    for name in routers:
        router = modules[name]
        sums, counts = group_means(model, router, windows, labels_of[name], n_groups, plan.config.d_model)
        slots = expert_inputs(plan, name)
        empty = [plan.inputs[i].name for i in slots if counts[group_of_input[i]] == 0]
        if empty:
            raise BamSurgeryError(f"--router-init {mode}: input {empty[0]} has no calibration token to average "
                                  f"for {name} (its dense model is the lowest-loss one on none); give more "
                                  "calibration data or use --router-init domain-mean")
        groups = torch.tensor([group_of_input[i] for i in slots])
        emb = (sums[groups] / counts[groups, None]).float()  # [E, D]
        router.embeddings.weight.copy_(emb)
        calibrated[f"{name}.embeddings.weight"] = emb
    tensors = [dataclasses.replace(t, op="calibrated", sources=(), std=0.0, rng_seed=0)
               if t.name in calibrated else t for t in plan.tensors]
    record = {"init": mode, "calibration": calib.spec, "tokens": sum(len(w.tokens) - 1 for w in windows)}
    return dataclasses.replace(plan, tensors=tensors, calibrated=calibrated, warm_start=record)


def _calibrated_routers(cfg) -> list[str]:
    """The expert_embedding routers of a mixture, in execution order."""
    return [f"layers.{i}.{group}_router" for i in range(cfg.n_layers)
            for group, kind, E in (("attn", cfg.attn_router_kind, cfg.layer_attn_experts(i)),
                                   ("ffn", cfg.ffn_router_kind, cfg.ffn_experts))
            if E and kind == ExpertEmbeddingRouter.kind]


def _domain_of_input(plan: Plan, routers: list[str], names: list[str]) -> dict[int, int]:
    """domain-mean: input index -> the index of its calibration domain (the one named like it)."""
    seed_dom = seed_domain(plan, names)
    group_of_input = {}
    for name in routers:
        for i in expert_inputs(plan, name):
            dom = seed_dom if i == 0 else plan.inputs[i].name
            if dom not in names:
                raise BamSurgeryError(
                    f"--calibration: no domain named {dom!r} for input {plan.inputs[i].name}="
                    f"{plan.inputs[i].label}; the domains are {', '.join(names)} (each expert calibrates on "
                    f"the domain named like its input; the seed's: its name or {SEED_DOMAIN})")
            group_of_input[i] = names.index(dom)
    return group_of_input


def _profile_labels(plan: Plan, windows, routers: list[str], log: Log
                    ) -> tuple[dict[str, torch.Tensor], dict[int, int]]:
    """profile: (router -> the input whose dense model has the lowest loss at each position, among the inputs
    of its own experts; input index -> group)."""
    inputs = tuple(sorted({i for name in routers for i in expert_inputs(plan, name)}))
    losses = token_losses(plan, windows, inputs)
    won = {c: winners(losses, inputs, c) for c in {tuple(sorted(set(expert_inputs(plan, n)))) for n in routers}}
    for c, w in sorted(won.items()):
        counts = w.bincount(minlength=len(plan.inputs))
        log("profile: lowest-loss positions per input: " + ", ".join(
            f"{plan.inputs[i].name} {int(counts[i]):,}" for i in c))
    labels_of = {n: won[tuple(sorted(set(expert_inputs(plan, n))))] for n in routers}
    return labels_of, {i: i for i in inputs}


def group_means(model, router, windows, labels: torch.Tensor, n_groups: int, D: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum [G, D] float64, count [G]) of the router's input states per group (labels: one per position, in
    window order); each forward stops at the router (_Captured)."""
    sums = torch.zeros(n_groups, D, dtype=torch.float64)
    counts = torch.zeros(n_groups, dtype=torch.float64)
    current: list[torch.Tensor] = []

    def capture(module, args):
        x = args[0].double()  # [N, D], N = B*T in batch order
        lab = current[0]
        sums.index_add_(0, lab, x)
        counts.index_add_(0, lab, torch.ones_like(lab, dtype=torch.float64))
        raise _Captured

    hook = router.register_forward_pre_hook(capture)
    try:
        start = 0
        for run in batches(windows):
            n = sum(len(w.tokens) - 1 for w in run)
            current[:] = [labels[start: start + n]]
            start += n
            try:
                model(torch.stack([w.tokens[:-1] for w in run]))
            except _Captured:
                pass
    finally:
        hook.remove()
    return sums, counts

