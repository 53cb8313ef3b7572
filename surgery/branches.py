"""Are the experts branches of the seed? A distance heuristic on a few sampled matrices.

Relative distance ||W_e - W_s|| / ||W_s|| above FAR_FROM_SEED reports an expert as evidently not
branched from the seed. Continued pre-training moves weights by a few percent to a few tens of
percent; two independently initialized models of the same scale sit near sqrt(2) ~ 1.41.
"""
from __future__ import annotations

import hashlib
import math
from typing import Callable

import torch

from bam_surgery.runtime.config import ModelConfig

from .plan import Plan, Source
from .plan_reader import read_source

FAR_FROM_SEED = 0.5
_SAMPLED_ROWS = 256  # rows per sampled matrix that enter the distance (evenly spaced)


def sampled_names(cfg: ModelConfig) -> list[str]:
    """A few matrices spread over depth and over attention/FFN: enough to tell a branch from a stranger (the
    token mixer's of each layer: its attention's, or a Gated DeltaNet layer's)."""
    L = cfg.n_layers

    def mixer(i: int, proj: str) -> str:
        return f"layers.{i}.linear.{'qkv' if proj == 'q' else 'out'}.weight" if cfg.is_linear_layer(i) else \
            f"layers.{i}.attn.{proj}.weight"

    return list(dict.fromkeys([mixer(0, "q"), mixer(L // 2, "o"), f"layers.{L // 2}.ffn.down.weight",
                               f"layers.{L - 1}.ffn.up.weight"]))


def _rows(x: torch.Tensor) -> torch.Tensor:
    step = max(1, x.shape[0] // _SAMPLED_ROWS)
    return x[::step].to(torch.float32)


def distances_to_seed(plan: Plan) -> dict[int, float]:
    """Relative distance sqrt(sum ||W_e - W_s||^2 / sum ||W_s||^2) of each expert input to the seed,
    over evenly spaced rows of sampled_names (reads those few tensors of each input; the merge reads
    them again from the page cache)."""
    return _sample(plan)[0]


def _sample(plan: Plan) -> tuple[dict[int, float], dict[int, str]]:
    """(distance of each expert input to the seed, digest of each input's sampled rows)."""
    if len(plan.inputs) < 2:
        return {}, {}
    allow = plan.options.allow_nonfinite
    seed_sq = 0.0
    diff_sq = {inp.index: 0.0 for inp in plan.inputs[1:]}
    digests = {inp.index: hashlib.sha256() for inp in plan.inputs}
    for name in sampled_names(plan.dense_config):
        s = _rows(read_source(plan, Source(0, name), allow))
        seed_sq += float(s.square().sum())
        digests[0].update(s.numpy().tobytes())
        for inp in plan.inputs[1:]:
            x = _rows(read_source(plan, Source(inp.index, name), allow))
            diff_sq[inp.index] += float((x - s).square().sum())
            digests[inp.index].update(x.numpy().tobytes())
            del x
        del s
    dist = {i: math.sqrt(d / seed_sq) if seed_sq > 0 else math.inf for i, d in diff_sq.items()}
    return dist, {i: h.hexdigest() for i, h in digests.items()}


def check_branches(plan: Plan, warn: Callable[[str], None], threshold: float = FAR_FROM_SEED) -> dict[int, float]:
    """Warn about experts far from the seed, equal to it, or equal to another expert (the same
    checkpoint given twice); return every expert's distance to the seed."""
    dist, digests = _sample(plan)
    seed = plan.inputs[0].label
    first_with: dict[str, int] = {}
    for i, d in dist.items():
        label = plan.inputs[i].label
        if d > threshold:
            warn(f"{label}: relative distance to the seed {seed} is {d:.3g} (> {threshold} on "
                 f"{len(sampled_names(plan.dense_config))} sampled matrices); it does not look branched "
                 "from this seed, and its experts will not fit the averaged norms and embeddings")
        elif d == 0.0:
            warn(f"{label}: identical to the seed {seed} on the sampled matrices; is it the seed again?")
            continue
        if digests[i] in first_with:
            other = plan.inputs[first_with[digests[i]]]
            warn(f"{label} (expert {plan.inputs[i].name}): identical to {other.label} (expert {other.name}) on the "
                 "sampled matrices; is the same expert given twice?")
        else:
            first_with[digests[i]] = i
    return dist
