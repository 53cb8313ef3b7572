"""Packed sequences and domain sampling, reproducible from the seed and resumable from a small state.

Each domain's token stream (documents with EOS between them, see tokenize.py) is cut into chunks of
T+1 tokens starting every T tokens: chunk i is tokens[i*T : i*T+T+1], inputs its first T tokens,
targets its last T (so no token is wasted and documents run across chunk borders, separated by EOS).

Global sample g (g = 0, 1, 2, ... over the whole run) comes from domain d_g, drawn with the domain
weights by a generator seeded with (seed, g // BLOCK); the c-th sample drawn from domain d is chunk
perm_{d,e}[c mod n_d] with e = c // n_d the domain's epoch and perm_{d,e} a permutation seeded with
(seed, d, e). So the stream depends only on the seed, the weights and the data; its state is the
next global index and the per-domain counts (`state()` / `load_state()`).

Optimizer step s uses global samples [s*G, (s+1)*G), G = micro_batch * world * accumulation; micro-
batch a of rank r takes the slice starting at (a*world + r)*micro_batch. One process with
accumulation A*W and W processes with accumulation A see the same micro-batches.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

BLOCK = 4096
_DOMAIN_STREAM, _ORDER_STREAM = 0xD0, 0x0D


@dataclass
class Batch:
    inputs: torch.Tensor  # [n, T] int64
    targets: torch.Tensor  # [n, T] int64
    domains: np.ndarray  # [n] domain index of each sequence


class MixtureSampler:
    """Draws packed sequences from weighted domains. `streams[d]` is a 1-D token array (memmap)."""

    def __init__(self, streams: list[np.ndarray], weights: list[float], seq_len: int, seed: int,
                 bos_id: int | None = None):
        self.streams, self.seq_len, self.seed, self.bos_id = streams, seq_len, seed, bos_id
        self.weights = np.asarray(weights, dtype=np.float64)
        self.weights = self.weights / self.weights.sum()
        self.n_chunks = [(len(s) - 1) // seq_len for s in streams]
        self.next_index = 0
        self.counts = [0] * len(streams)
        self._block: tuple[int, np.ndarray] | None = None
        self._perms: dict[tuple[int, int], np.ndarray] = {}

    # -- state ---------------------------------------------------------------------------------
    def state(self) -> dict:
        return {"next_index": self.next_index, "counts": list(self.counts)}

    def load_state(self, state: dict) -> None:
        self.next_index, self.counts = int(state["next_index"]), [int(c) for c in state["counts"]]

    # -- drawing -------------------------------------------------------------------------------
    def _domain_of(self, g: int) -> int:
        block = g // BLOCK
        if self._block is None or self._block[0] != block:
            rng = np.random.Generator(np.random.PCG64([self.seed, _DOMAIN_STREAM, block]))
            self._block = (block, rng.choice(len(self.streams), size=BLOCK, p=self.weights))
        return int(self._block[1][g % BLOCK])

    def _chunk(self, d: int, c: int) -> int:
        epoch, i = divmod(c, self.n_chunks[d])
        key = (d, epoch)
        if key not in self._perms:
            self._perms = {k: v for k, v in self._perms.items() if k[0] != d}  # one epoch per domain kept
            rng = np.random.Generator(np.random.PCG64([self.seed, _ORDER_STREAM, d, epoch]))
            self._perms[key] = rng.permutation(self.n_chunks[d])
        return int(self._perms[key][i])

    def draw(self, n: int) -> list[tuple[int, int]]:
        """The next n samples as (domain, chunk); advances the state."""
        out = []
        for _ in range(n):
            d = self._domain_of(self.next_index)
            out.append((d, self._chunk(d, self.counts[d])))
            self.counts[d] += 1
            self.next_index += 1
        return out

    def batch(self, samples: list[tuple[int, int]]) -> Batch:
        T = self.seq_len
        rows = np.stack([np.asarray(self.streams[d][c * T: c * T + T + 1], dtype=np.int64) for d, c in samples])
        seq = torch.from_numpy(rows)
        return Batch(window_inputs(seq, self.bos_id), seq[:, 1:], np.array([d for d, _ in samples]))


def window_inputs(seq: torch.Tensor, bos_id: int | None) -> torch.Tensor:
    """The inputs of windows seq [n, T+1] (targets: seq[:, 1:]): seq[:, :-1], its first token replaced by bos_id
    where the tokenizer has one. A model trained with a beginning-of-sequence token reads every text after it
    (Gemma-3-270M on code: 4.47 nats/token on windows without it, 2.34 with); the window's first token is
    context only either way, so every target is kept."""
    inputs = seq[:, :-1]
    if bos_id is None:
        return inputs
    inputs = inputs.clone()
    inputs[:, 0] = bos_id
    return inputs


def micro_batches(samples: list[tuple[int, int]], micro_batch: int, world: int, rank: int
                  ) -> list[list[tuple[int, int]]]:
    """Rank `rank`'s micro-batches of one optimizer step's global samples, in order."""
    per_step = len(samples) // (micro_batch * world)
    return [samples[(a * world + rank) * micro_batch:(a * world + rank + 1) * micro_batch] for a in range(per_step)]


def eval_windows(tokens: np.ndarray, seq_len: int, max_tokens: int = 0) -> list[tuple[int, int]]:
    """Consecutive windows [start, end) over the first max_tokens+1 tokens (0: all): each window's
    inputs are tokens[start:end-1] (the first replaced by the tokenizer's BOS: window_inputs) and targets
    tokens[start+1:end]; every token but the first is predicted exactly once. The last window may be shorter."""
    n = len(tokens) if not max_tokens else min(len(tokens), max_tokens + 1)
    return [(s, min(s + seq_len + 1, n)) for s in range(0, n - 1, seq_len)]
