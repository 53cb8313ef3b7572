"""Named reshape operations between Hugging Face tensors and canonical tensors, each with its inverse.

An op maps a tuple of HF tensors to a tuple of canonical tensors (`forward`) and back (`inverse`);
`inverse(forward(x)) == x` exactly (no arithmetic, only views, splits and concatenations), which
the round-trip tests check. Shapes are derived by running the same code on meta tensors, so a
shape rule can never disagree with the data rule.

Sizes below: H heads, G kv heads, Dh head dim, D d_model; q_dim = H*Dh, kv_dim = G*Dh.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from bam_surgery.runtime.config import ModelConfig

Shape = tuple[int, ...]


class ReshapeOp:
    """Base class: a tuple of HF tensors <-> a tuple of canonical tensors (the table row says which)."""

    name = "op"

    def forward(self, hf: Sequence[Tensor], cfg: ModelConfig) -> list[Tensor]:
        raise NotImplementedError

    def inverse(self, canonical: Sequence[Tensor], cfg: ModelConfig) -> list[Tensor]:
        raise NotImplementedError

    # Shapes come from the data rule itself, run on meta tensors (no memory, no I/O).
    def forward_shapes(self, shapes: Sequence[Shape], cfg: ModelConfig) -> list[Shape]:
        return [tuple(t.shape) for t in self.forward(_meta(shapes), cfg)]

    def inverse_shapes(self, shapes: Sequence[Shape], cfg: ModelConfig) -> list[Shape]:
        return [tuple(t.shape) for t in self.inverse(_meta(shapes), cfg)]

    def __repr__(self) -> str:
        return self.name


def _meta(shapes: Sequence[Shape]) -> list[Tensor]:
    return [torch.empty(s, device="meta") for s in shapes]


class Identity(ReshapeOp):
    name = "identity"

    def forward(self, hf, cfg):
        return [hf[0]]

    def inverse(self, canonical, cfg):
        return [canonical[0]]


class Drop(ReshapeOp):
    """A HF tensor dropped on purpose (rotary inv_freq buffers, causal-mask buffers): nothing canonical."""

    name = "drop"

    def forward(self, hf, cfg):
        return []

    def inverse(self, canonical, cfg):
        return []  # never re-created: transformers rebuilds these buffers itself


class Transpose(ReshapeOp):
    """GPT-2's Conv1D stores weights as [in, out]; canonical Linear weights are [out, in]."""

    name = "transpose"

    def forward(self, hf, cfg):
        return [hf[0].t()]

    def inverse(self, canonical, cfg):
        return [canonical[0].t()]


class SplitQKV(ReshapeOp):
    """Fused rows [q_dim + 2*kv_dim, ...] = [q; k; v] <-> q [q_dim, ...], k, v [kv_dim, ...].

    Works for weights ([rows, D]) and biases ([rows]).
    """

    name = "split_qkv"

    def forward(self, hf, cfg):
        sizes = [cfg.q_dim, cfg.kv_dim, cfg.kv_dim]
        if hf[0].shape[0] != sum(sizes):
            raise ValueError(f"fused qkv has {hf[0].shape[0]} rows, config implies q+k+v = {sum(sizes)}")
        return list(torch.split(hf[0], sizes, dim=0))

    def inverse(self, canonical, cfg):
        return [torch.cat(list(canonical), dim=0)]


class SplitGateUp(ReshapeOp):
    """Phi-3's gate_up_proj: rows [gate; up] [2F, D] <-> gate [F, D], up [F, D] (transformers chunks it in two)."""

    name = "split_gate_up"

    def forward(self, hf, cfg):
        if hf[0].shape[0] != 2 * cfg.ffn_hidden:
            raise ValueError(f"fused gate_up has {hf[0].shape[0]} rows, config implies 2*ffn_hidden = {2 * cfg.ffn_hidden}")
        return list(torch.split(hf[0], cfg.ffn_hidden, dim=0))

    def inverse(self, canonical, cfg):
        return [torch.cat(list(canonical), dim=0)]


class SplitQKVPerHead(ReshapeOp):
    """GPT-NeoX query_key_value: rows laid out per head as (q, k, v), i.e. [H, 3, Dh, ...] flattened.

    [H*3*Dh, ...] <-> q, k, v each [H*Dh, ...]. NeoX attention is multi-head (G == H).
    """

    name = "split_qkv_per_head"

    def forward(self, hf, cfg):
        H, Dh = cfg.n_heads, cfg.head_dim
        if cfg.n_kv_heads != H:
            raise ValueError(f"per-head fused qkv needs n_kv_heads == n_heads, got {cfg.n_kv_heads} and {H}")
        x = hf[0]
        if x.shape[0] != H * 3 * Dh:
            raise ValueError(f"fused qkv has {x.shape[0]} rows, config implies n_heads*3*head_dim = {H * 3 * Dh}")
        rest = tuple(x.shape[1:])
        per_head = x.reshape((H, 3, Dh) + rest)
        return [per_head[:, j].reshape((H * Dh,) + rest) for j in range(3)]

    def inverse(self, canonical, cfg):
        H, Dh = cfg.n_heads, cfg.head_dim
        rest = tuple(canonical[0].shape[1:])
        per_head = torch.stack([t.reshape((H, Dh) + rest) for t in canonical], dim=1)  # [H, 3, Dh, ...]
        return [per_head.reshape((H * 3 * Dh,) + rest)]


class SplitQueryGate(ReshapeOp):
    """Qwen3.5's gated attention q_proj: rows per head (query, gate), [H, 2, Dh, ...] flattened <-> q [H*Dh, ...],
    gate [H*Dh, ...] (transformers views the output as [..., H, 2*Dh] and chunks each head in two). Weights and
    biases alike; the head size comes from the tensor (rows / 2H), so it holds for any layer's heads."""

    name = "split_query_gate"

    def forward(self, hf, cfg):
        x, H = hf[0], cfg.n_heads
        if x.shape[0] % (2 * H):
            raise ValueError(f"q_proj has {x.shape[0]} rows, not a multiple of 2 * n_heads = {2 * H}")
        rest = tuple(x.shape[1:])
        per_head = x.reshape((H, 2, x.shape[0] // (2 * H)) + rest)
        return [per_head[:, j].reshape((-1,) + rest) for j in range(2)]

    def inverse(self, canonical, cfg):
        H = cfg.n_heads
        rest = tuple(canonical[0].shape[1:])
        per_head = torch.stack([t.reshape((H, -1) + rest) for t in canonical], dim=1)  # [H, 2, Dh, ...]
        return [per_head.reshape((-1,) + rest)]


class DepthwiseConv(ReshapeOp):
    """A depthwise Conv1d's weight [C, 1, K] <-> canonical [C, K] (Qwen3.5's Gated DeltaNet convolution)."""

    name = "depthwise_conv"

    def forward(self, hf, cfg):
        x = hf[0]
        if x.dim() != 3 or x.shape[1] != 1:
            raise ValueError(f"a depthwise convolution's weight is [channels, 1, width], got {list(x.shape)}")
        return [x.reshape(x.shape[0], x.shape[2])]

    def inverse(self, canonical, cfg):
        return [canonical[0][:, None, :]]


class Stack(ReshapeOp):
    """E HF tensors [...] (one per expert, Mixtral's experts.{e}.w1) <-> one canonical tensor [E, ...].

    The inverse hands out views of the stacked tensor (no copy)."""

    name = "stack"

    def forward(self, hf, cfg):
        return [torch.stack(list(hf), dim=0)]

    def inverse(self, canonical, cfg):
        return list(canonical[0].unbind(0))


class Chain(ReshapeOp):
    """Apply ops in order on the HF -> canonical path (and in reverse order on the way back)."""

    def __init__(self, *ops: ReshapeOp):
        self.ops = ops
        self.name = "+".join(op.name for op in ops)

    def forward(self, hf, cfg):
        xs = list(hf)
        for op in self.ops:
            xs = op.forward(xs, cfg)
        return xs

    def inverse(self, canonical, cfg):
        xs = list(canonical)
        for op in reversed(self.ops):
            xs = op.inverse(xs, cfg)
        return xs


IDENTITY = Identity()
DROP = Drop()
TRANSPOSE = Transpose()
SPLIT_QKV = SplitQKV()
SPLIT_QKV_PER_HEAD = SplitQKVPerHead()
SPLIT_GATE_UP = SplitGateUp()
CONV1D_SPLIT_QKV = Chain(TRANSPOSE, SPLIT_QKV)  # GPT-2 c_attn.weight [D, 3D] -> q, k, v [D, D]
STACK = Stack()
SPLIT_QUERY_GATE = SplitQueryGate()
DEPTHWISE_CONV = DepthwiseConv()
