"""The key store's update rules (SoME): how the expert keys of a key-store router move, once per optimizer step,
from the routing of that step. No gradient is involved; the forward (query network, cosine logits) is
runtime/routers.py's KeyStoreRouter. Formulas, with the reasons for each choice: docs/routers.md, "key store".

Shapes: E experts, D d_model, N tokens of the step (every micro-batch, every process), K top-k, m = floor(theta E).

Per step and router, the routing gives (KeyStoreCollector: summed over micro-batches and processes):
    c_e      number of tokens that selected expert e                          counts       [E]
    s_e      sum of the unit queries of those tokens                          query_sums   [E, D]
    C_ef     number of tokens that selected both e and f (e != f; C_ee = 0)   co_counts    [E, E]
    W        the m worst-served tokens: lowest best logit max_e logit_ne      worst        [m, 1 + D]
             (ties: the token seen first), each with its unit query           (score, query)

The rules, from the keys k_e before the step (unit rows of `keys`) and the usage EMA u_e:
    usage       u'_e = gamma * u_e + (1 - gamma) * c_e / sum_f c_f           (gamma = ema_decay; unchanged if no
                                                                              token was routed)
    inactive    the m experts of lowest u'_e (ties: lower index first) whose u'_e is below the fair share 1/E
                                                                             (theta = theta_percentile)
    attraction  A_e = s_e / c_e - k_e                    if c_e > 0, else 0
    peer pull   P_e = sum_f C_ef k_f / sum_f C_ef - k_e   if sum_f C_ef > 0, else 0
    dispersion  S_e = k_e - kbar,  kbar = (1/E) sum_f k_f (pushes every key away from the keys' centroid)
    keys        k'_e = normalize(k_e + alpha * A_e + beta * P_e + delta * S_e)   (k_e kept if that is zero)
    re-seed     the i-th inactive expert (by rising u'_e) takes the unit query of the i-th worst-served token:
                k'_e = q_{W_i}, u'_e = 1/E (a fresh start); without a token for it, it keeps k'_e and u'_e
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor, nn

from .routers import KeyStoreRouter


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
    m = n_inactive(E, theta_percentile)  # 0.05 * 64 -> 3
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


def dispersion(keys: Tensor) -> Tensor:
    """S_e = k_e - kbar, kbar the mean of all keys: [E, D]."""
    return keys - keys.mean(0, keepdim=True)


def reseed(keys: Tensor, usage: Tensor, inactive: Tensor, worst_queries: Tensor) -> tuple[Tensor, Tensor]:
    """The i-th inactive expert (rising usage, ties lower index) takes worst_queries[i] [m, D] as its key and the
    fair share 1/E as its usage; returns (keys, usage), new tensors."""
    keys, usage = keys.clone(), usage.clone()
    order = torch.argsort(usage, stable=True)
    chosen = order[inactive[order]][:worst_queries.shape[0]]
    keys[chosen] = worst_queries[:chosen.numel()].to(keys.dtype)
    usage[chosen] = 1.0 / usage.numel()
    return keys, usage


def move_keys(keys: Tensor, alpha: float, attract: Tensor, beta: float, pull: Tensor, delta: float,
              disperse: Tensor) -> Tensor:
    """k' = normalize(k + alpha A + beta P + delta S), row by row; a row that would be zero keeps k."""
    moved = keys + alpha * attract + beta * pull + delta * disperse
    norm = moved.norm(dim=-1, keepdim=True)
    return torch.where(norm > 0, moved / norm.clamp_min(1e-30), keys)


# ---- one step's statistics ---------------------------------------------------------------------------------
@dataclass
class StepStatistics:
    """What the rules read of one step's routing of one router: sums (micro-batches and processes add them) and
    the worst-served tokens (merged: the m lowest scores)."""

    counts: Tensor  # [E]
    query_sums: Tensor  # [E, D]
    co_counts: Tensor  # [E, E], zero diagonal
    tokens: Tensor  # [] (a float, to travel in the same all-reduce)
    worst: Tensor  # [<= m, 1 + D]: (best logit, unit query) of the worst-served tokens, worst first

    def flat_sums(self) -> Tensor:
        return torch.cat([self.counts, self.query_sums.reshape(-1), self.co_counts.reshape(-1), self.tokens.reshape(1)])

    @staticmethod
    def split_sums(v: Tensor, n_experts: int, d_model: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        E, D = n_experts, d_model
        counts, sums, co, tokens = torch.split(v, [E, E * D, E * E, 1])
        return counts, sums.view(E, D), co.view(E, E), tokens[0]


def worst_served(candidates: Tensor, m: int) -> Tensor:
    """The m rows of candidates [n, 1 + D] with the lowest score (column 0), lowest first; ties keep row order."""
    order = torch.argsort(candidates[:, 0], stable=True)[:m]
    return candidates[order]


def step_statistics(topk: Tensor, queries: Tensor, best: Tensor, n_experts: int, m: int) -> StepStatistics:
    """One forward's routing: topk [N, K] selected experts, queries [N, D] unit queries, best [N] each token's
    highest logit; m worst-served tokens kept."""
    N, K = topk.shape
    E = n_experts
    q = queries.float()
    flat = topk.reshape(-1)  # assignment a = n*K + j
    counts = torch.zeros(E, device=q.device).index_add_(0, flat, torch.ones(flat.numel(), device=q.device))
    query_sums = torch.zeros(E, q.shape[-1], device=q.device).index_add_(0, flat, q.repeat_interleave(K, dim=0))
    # co-selection: every ordered pair (j, l), j != l, of one token's K choices; N*K*(K-1) pairs, no [N, E] one-hot
    j, l = torch.meshgrid(torch.arange(K, device=q.device), torch.arange(K, device=q.device), indexing="ij")
    off = j != l
    pairs = topk[:, j[off]] * E + topk[:, l[off]]  # [N, K*(K-1)] flat index e*E + f
    co = torch.zeros(E * E, device=q.device).index_add_(0, pairs.reshape(-1),
                                                         torch.ones(pairs.numel(), device=q.device))
    worst = worst_served(torch.cat([best.float()[:, None], q], dim=1), m)
    return StepStatistics(counts, query_sums, co.view(E, E), torch.tensor(float(N), device=q.device), worst)


# ---- applying the rules to a model -------------------------------------------------------------------------
def n_inactive(n_experts: int, theta_percentile: float) -> int:
    """m = floor(theta E); the epsilon guards products such as 0.07 * 100 = 7.000000000000001."""
    return math.floor(theta_percentile * n_experts + 1e-9)


def update_router(router: KeyStoreRouter, stats: StepStatistics, cfg) -> Tensor:
    """Apply the rules to one router's buffers in place (cfg: the model config's key_store_* knobs); returns the
    inactive mask it used."""
    with torch.no_grad():
        keys = router.keys.float()
        usage = usage_ema(router.usage.float(), stats.counts, cfg.key_store_ema_decay)
        inactive = inactive_experts(usage, cfg.key_store_theta_percentile)
        moved = move_keys(keys, cfg.key_store_alpha, attraction(keys, stats.query_sums, stats.counts),
                          cfg.key_store_beta, peer_pull(keys, stats.co_counts),
                          cfg.key_store_delta, dispersion(keys))
        moved, usage = reseed(moved, usage, inactive, stats.worst[:, 1:])
        router.keys.copy_(moved.to(router.keys.dtype))
        router.usage.copy_(usage.to(router.usage.dtype))
    return inactive


def _all_sum(t: Tensor) -> Tensor:
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.SUM)
    return t


class KeyStoreCollector:
    """One key-store router's statistics of the current optimizer step. The router hands it every training
    forward's logits [N, E] and unit queries [N, D] (`add`); its after_step calls `apply`, which combines every
    process's statistics (torch.distributed, when a process group is up), runs the rules and starts the next
    step from zero. The top-k is recomputed from the logits exactly as runtime.blocks.route selects it."""

    def __init__(self, cfg, n_experts: int):
        self.cfg, self.n_experts = cfg, n_experts
        self.top_k = cfg.ffn_top_k
        self.m = n_inactive(n_experts, cfg.key_store_theta_percentile)
        self.d_model = cfg.d_model
        self.sums: Optional[Tensor] = None  # StepStatistics.flat_sums()
        self.worst: Optional[Tensor] = None  # [<= m, 1 + D]

    def add(self, logits: Tensor, queries: Tensor) -> None:
        logits = logits.float()
        topk = logits.softmax(-1).topk(self.top_k, dim=-1).indices  # [N, K], as route() picks
        st = step_statistics(topk, queries, logits.max(-1).values, self.n_experts, self.m)
        if self.sums is None:
            self.sums, self.worst = st.flat_sums(), st.worst
        else:  # earlier micro-batches first: ties go to the token seen first
            self.sums = self.sums + st.flat_sums()
            self.worst = worst_served(torch.cat([self.worst, st.worst]), self.m)

    def reduce(self, all_sum: Callable[[Tensor], Tensor], rank: int, world: int) -> None:
        """Combine every process's statistics with all_sum (an all-reduce of one tensor): the sums are summed;
        the worst-served candidates are gathered (each process fills its own slot of a zero tensor) and merged
        in rank order. A process that routed nothing this step takes part with zeros."""
        D, E = self.d_model, self.n_experts
        if self.sums is None:  # every process joins the collective, with zeros if it routed nothing
            self.sums, self.worst = torch.zeros(E + E * D + E * E + 1), torch.zeros(0, 1 + D)
        sums = self.sums
        slot = torch.zeros(world, self.m, 2 + D, device=sums.device)  # (valid, best logit, query)
        n = self.worst.shape[0]
        slot[rank, :n, 0] = 1.0
        slot[rank, :n, 1:] = self.worst
        joined = all_sum(torch.cat([sums, slot.reshape(-1)]))
        self.sums = joined[:sums.numel()]
        gathered = joined[sums.numel():].view(-1, 2 + D)  # rank-major rows
        self.worst = worst_served(gathered[gathered[:, 0] > 0.5, 1:], self.m)

    def statistics(self) -> StepStatistics:
        counts, sums, co, tokens = StepStatistics.split_sums(self.sums, self.n_experts, self.d_model)
        return StepStatistics(counts, sums, co, tokens, self.worst)

    def apply(self, router: KeyStoreRouter) -> Optional[Tensor]:
        """The rules on the router's buffers from this step's statistics, then a fresh step; returns the inactive
        mask (None if no token was routed since the last step)."""
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            device = router.keys.device
            if self.sums is not None:
                self.sums, self.worst = self.sums.to(device), self.worst.to(device)
            self.reduce(lambda t: _all_sum(t.to(device)), dist.get_rank(), dist.get_world_size())
        if self.sums is None or float(self.statistics().tokens) == 0:
            self.sums, self.worst = None, None
            return None
        inactive = update_router(router, self.statistics(), self.cfg)
        self.sums, self.worst = None, None
        return inactive


__all__ = ["KeyStoreCollector", "StepStatistics", "attraction", "dispersion", "inactive_experts", "move_keys",
           "n_inactive", "peer_pull", "reseed", "step_statistics", "update_router", "usage_ema", "worst_served"]
