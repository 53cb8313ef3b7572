"""The key store's update rules (SoME): how the expert keys of a key-store router move, once per optimizer step,
from the routing of that step. No gradient is involved; the forward (query network, cosine logits) is
runtime/blocks.py's KeyStoreRouter. Formulas, with the reasons for each choice: docs/routers.md, "key store".

Shapes: E experts, D d_model, N tokens of the step (every micro-batch, every process), K top-k.

Per step and router, the routing gives (accumulated by KeyStoreStats, all-reduced across processes):
    c_e      number of tokens that selected expert e                          counts       [E]
    s_e      sum of the unit queries of those tokens                          query_sums   [E, D]
    C_ef     number of tokens that selected both e and f (e != f; C_ee = 0)   co_counts    [E, E]
    qbar     mean unit query of all N tokens                                  mean_query   [D]

The rules, from the keys k_e before the step (unit rows of `keys`) and the usage EMA u_e:
    usage       u'_e = gamma * u_e + (1 - gamma) * c_e / sum_f c_f           (gamma = ema_decay; unchanged if no
                                                                              token was routed)
    inactive    the floor(theta * E) experts of lowest u'_e (ties: lower index first) whose u'_e is below the
                fair share 1/E                                               (theta = theta_percentile)
    attraction  A_e = s_e / c_e - k_e                    if c_e > 0, else 0
    peer pull   P_e = sum_f C_ef k_f / sum_f C_ef - k_e   if sum_f C_ef > 0, else 0
    reactivate  R_e = qbar - k_e                          if e is inactive, else 0
    keys        k'_e = normalize(k_e + alpha * A_e + beta * P_e + delta * R_e)   (k_e kept if that is zero)
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor, nn

from .blocks import KeyStoreRouter, Routing


# ---- the rules: pure functions ----------------------------------------------------------------------------
def usage_ema(usage: Tensor, counts: Tensor, ema_decay: float) -> Tensor:
    """u' = gamma * u + (1 - gamma) * c / sum(c): usage [E], counts [E] -> [E]. No routed token: u unchanged."""
    total = counts.sum()
    if float(total) <= 0:
        return usage.clone()
    return ema_decay * usage + (1.0 - ema_decay) * counts.to(usage.dtype) / total.to(usage.dtype)


def inactive_experts(usage: Tensor, theta_percentile: float) -> Tensor:
    """Bool [E]: the floor(theta * E) experts of lowest usage (ties: lower index first) that are used less than
    their fair share 1/E. Uniform usage has none."""
    E = usage.numel()
    m = math.floor(theta_percentile * E + 1e-9)  # 0.05 * 64 -> 3; the epsilon guards 0.07 * 100 = 7.000000000000001
    out = torch.zeros(E, dtype=torch.bool, device=usage.device)
    if m == 0:
        return out
    order = torch.argsort(usage, stable=True)[:m]  # stable: equal usage keeps index order
    out[order] = True
    return out & (usage < 1.0 / E)


def attraction(keys: Tensor, query_sums: Tensor, counts: Tensor) -> Tensor:
    """A_e = s_e / c_e - k_e for experts selected this step, 0 otherwise: [E, D]."""
    chosen = counts > 0
    mean = query_sums / counts.clamp_min(1).to(query_sums.dtype)[:, None]
    return torch.where(chosen[:, None], mean - keys, torch.zeros_like(keys))


def peer_pull(keys: Tensor, co_counts: Tensor) -> Tensor:
    """P_e = sum_f C_ef k_f / sum_f C_ef - k_e for experts co-selected with another this step, 0 otherwise."""
    co = co_counts.to(keys.dtype)
    weight = co.sum(1)
    peers = (co @ keys) / weight.clamp_min(1)[:, None]
    return torch.where((weight > 0)[:, None], peers - keys, torch.zeros_like(keys))


def reactivation(keys: Tensor, mean_query: Tensor, inactive: Tensor) -> Tensor:
    """R_e = qbar - k_e for inactive experts, 0 otherwise: [E, D]."""
    return torch.where(inactive[:, None], mean_query[None, :] - keys, torch.zeros_like(keys))


def move_keys(keys: Tensor, alpha: float, attract: Tensor, beta: float, pull: Tensor, delta: float,
              reactivate: Tensor) -> Tensor:
    """k' = normalize(k + alpha A + beta P + delta R), row by row; a row that would be zero keeps k."""
    moved = keys + alpha * attract + beta * pull + delta * reactivate
    norm = moved.norm(dim=-1, keepdim=True)
    return torch.where(norm > 0, moved / norm.clamp_min(1e-30), keys)


# ---- one step's statistics ---------------------------------------------------------------------------------
@dataclass
class StepStatistics:
    """What the rules read of one step's routing of one router (sums, so micro-batches and processes add)."""

    counts: Tensor  # [E]
    query_sums: Tensor  # [E, D]
    co_counts: Tensor  # [E, E], zero diagonal
    query_total: Tensor  # [D]
    tokens: Tensor  # [] (a float, to travel in the same all-reduce)

    @property
    def mean_query(self) -> Tensor:
        return self.query_total / self.tokens.clamp_min(1)

    def flat(self) -> Tensor:
        return torch.cat([self.counts, self.query_sums.reshape(-1), self.co_counts.reshape(-1), self.query_total,
                          self.tokens.reshape(1)])

    @classmethod
    def unflat(cls, v: Tensor, n_experts: int, d_model: int) -> "StepStatistics":
        E, D = n_experts, d_model
        sizes = [E, E * D, E * E, D, 1]
        parts = torch.split(v, sizes)
        return cls(parts[0], parts[1].view(E, D), parts[2].view(E, E), parts[3], parts[4][0])


def step_statistics(topk: Tensor, queries: Tensor, n_experts: int) -> StepStatistics:
    """Sums of one forward's routing: topk [N, K] selected experts, queries [N, D] unit queries (float32)."""
    N, K = topk.shape
    E, D = n_experts, queries.shape[-1]
    q = queries.float()
    flat = topk.reshape(-1)  # assignment a = n*K + j
    counts = torch.zeros(E, device=q.device).index_add_(0, flat, torch.ones(flat.numel(), device=q.device))
    query_sums = torch.zeros(E, D, device=q.device).index_add_(0, flat, q.repeat_interleave(K, dim=0))
    # co-selection: every ordered pair (j, l), j != l, of one token's K choices; N*K*(K-1) pairs, no [N, E] one-hot
    j, l = torch.meshgrid(torch.arange(K, device=q.device), torch.arange(K, device=q.device), indexing="ij")
    off = j != l
    pairs = topk[:, j[off]] * E + topk[:, l[off]]  # [N, K*(K-1)] flat index e*E + f
    co = torch.zeros(E * E, device=q.device).index_add_(0, pairs.reshape(-1),
                                                         torch.ones(pairs.numel(), device=q.device))
    return StepStatistics(counts, query_sums, co.view(E, E), q.sum(0), torch.tensor(float(N), device=q.device))


# ---- applying the rules to a model -------------------------------------------------------------------------
def update_router(router: KeyStoreRouter, stats: StepStatistics, cfg) -> Tensor:
    """Apply the rules to one router's buffers in place (cfg: the model config's key_store_* knobs); returns the
    inactive mask it used."""
    with torch.no_grad():
        keys = router.keys.float()
        usage = usage_ema(router.usage.float(), stats.counts, cfg.key_store_ema_decay)
        inactive = inactive_experts(usage, cfg.key_store_theta_percentile)
        new = move_keys(keys, cfg.key_store_alpha, attraction(keys, stats.query_sums, stats.counts),
                        cfg.key_store_beta, peer_pull(keys, stats.co_counts),
                        cfg.key_store_delta, reactivation(keys, stats.mean_query, inactive))
        router.keys.copy_(new.to(router.keys.dtype))
        router.usage.copy_(usage.to(router.usage.dtype))
    return inactive


class KeyStoreStats:
    """The statistics of one optimizer step for every key-store router of a model: `add(out.routing)` after each
    forward of the step, `reduce(all_sum)` across processes, then `Model.after_step(stats)`."""

    def __init__(self):
        self.sums: dict[str, Tensor] = {}  # router name -> StepStatistics.flat()
        self.shapes: dict[str, tuple[int, int]] = {}

    def add(self, routing: dict[str, Routing]) -> None:
        for name, r in routing.items():
            if r.queries is None or r.topk is None:
                continue
            E, D = r.probs.shape[-1], r.queries.shape[-1]
            v = step_statistics(r.topk, r.queries, E).flat()
            self.shapes[name] = (E, D)
            self.sums[name] = v if name not in self.sums else self.sums[name] + v

    def reduce(self, all_sum: Callable[[Tensor], Tensor]) -> None:
        """Sum every process's statistics (all_sum: an all-reduce of one tensor). Every process runs the same
        model on its own micro-batches, so every process holds the same routers in the same order."""
        if self.sums:
            names = sorted(self.sums)
            joined = all_sum(torch.cat([self.sums[n] for n in names]))
            for n, part in zip(names, torch.split(joined, [self.sums[n].numel() for n in names])):
                self.sums[n] = part

    def statistics(self, name: str) -> StepStatistics:
        return StepStatistics.unflat(self.sums[name], *self.shapes[name])

    def apply(self, model: nn.Module) -> dict[str, Tensor]:
        """Update every router with statistics; returns router name -> inactive mask."""
        cfg = model.config
        out = {}
        for name in self.sums:
            router = model.get_submodule(name)
            if not isinstance(router, KeyStoreRouter):
                raise TypeError(f"{name} is not a key-store router")
            out[name] = update_router(router, self.statistics(name), cfg)
        return out


def key_store_routers(model: nn.Module) -> dict[str, KeyStoreRouter]:
    return {n: m for n, m in model.named_modules() if isinstance(m, KeyStoreRouter)}


def has_key_store(model: nn.Module, config: Optional[object] = None) -> bool:
    cfg = config if config is not None else getattr(model, "config", None)
    return getattr(cfg, "router", None) == "key_store"


__all__ = ["KeyStoreStats", "StepStatistics", "attraction", "has_key_store", "inactive_experts", "key_store_routers",
           "move_keys", "peer_pull", "reactivation", "step_statistics", "update_router", "usage_ema"]
