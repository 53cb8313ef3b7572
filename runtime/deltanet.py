"""The Gated DeltaNet's math (Qwen3.5's linear attention), as pure torch functions: the short causal convolution,
the gated delta rule (chunked for many tokens, recurrent for one) and the gated RMSNorm. runtime/blocks.py holds
the module (its parameters, experts and cache); this file holds what it computes, written from the method's
definition and checked against transformers' Qwen3.5 (modeling_qwen3_5.py) to 1e-4 in fp32.

Shipped into every HF BAM export next to blocks_bam.py (as deltanet.py, byte for byte), so it imports only torch.

Shapes: B batch, T tokens, C channels, K convolution width, H value heads (query and key heads already repeated to
H), Dk key size, Dv value size.

The recurrence, per head, over tokens t with a state S [Dk, Dv] (zeros at the start of a sequence):
    S <- exp(g_t) S                              decay (g_t <= 0)
    S <- S + k_t (beta_t (v_t - S^T k_t))^T       the delta rule: write the part of v_t that S does not yet predict
    o_t = S^T q_t
with q_t, k_t L2-normalized and q_t scaled by 1/sqrt(Dk). The chunked form computes the same over chunks of tokens
with matrix products: inside a chunk the writes form a unit lower-triangular system (solved once per chunk), and
the state is carried from chunk to chunk.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

CHUNK = 64  # tokens per chunk of the chunked rule (transformers' and flash-linear-attention's)


def causal_conv(x: Tensor, weight: Tensor, previous: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """A depthwise causal convolution of width K over time, then SiLU: x [B, C, T], weight [C, K], previous [B, C,
    K-1] (the K-1 inputs before x; None: zeros) -> (y [B, C, T] in x's dtype, the last K-1 inputs [B, C, K-1])."""
    B, C, T = x.shape
    K = weight.shape[-1]
    if previous is None:
        previous = x.new_zeros(B, C, K - 1)
    full = torch.cat((previous.to(x.dtype), x), dim=-1)  # [B, C, K-1+T]
    y = F.conv1d(full.to(weight.dtype), weight[:, None, :], groups=C)  # [B, C, T]: no padding, every window full
    return F.silu(y).to(x.dtype), full[:, :, -(K - 1):]


def l2_normalized(x: Tensor, eps: float = 1e-6) -> Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim (flash-linear-attention's and transformers' epsilon)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _prepared(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> tuple[Tensor, ...]:
    """[B, T, H, *] inputs -> float32 (float64 for float64 inputs) [B, H, T, *], q and k L2-normalized, q scaled
    by 1/sqrt(Dk)."""
    dtype = torch.promote_types(v.dtype, torch.float32)
    q, k, v = (t.transpose(1, 2).to(dtype) for t in (q, k, v))
    g, beta = g.transpose(1, 2).to(dtype), beta.transpose(1, 2).to(dtype)
    q, k = l2_normalized(q), l2_normalized(k)
    return q * q.shape[-1] ** -0.5, k, v, g, beta


def gated_delta_recurrent(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                          state: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """The rule token by token: q, k [B, T, H, Dk], v [B, T, H, Dv], g, beta [B, T, H], state [B, H, Dk, Dv]
    float32 or None (zeros) -> (o [B, T, H, Dv] in v's dtype, the final state [B, H, Dk, Dv] float32)."""
    dtype = v.dtype
    q, k, v, g, beta = _prepared(q, k, v, g, beta)
    B, H, T, Dk = k.shape
    S = v.new_zeros(B, H, Dk, v.shape[-1]) if state is None else state.to(v.dtype)
    out = []
    for t in range(T):
        S = S * g[:, :, t].exp()[..., None, None]
        predicted = (S * k[:, :, t, :, None]).sum(-2)  # S^T k_t [B, H, Dv]
        S = S + k[:, :, t, :, None] * ((v[:, :, t] - predicted) * beta[:, :, t, None])[:, :, None, :]
        out.append((S * q[:, :, t, :, None]).sum(-2))
    return torch.stack(out, dim=2).transpose(1, 2).to(dtype), S


def _unit_lower_inverse_apply(A: Tensor, rhs: Tensor) -> Tensor:
    """(I + strictly_lower(A))^-1 rhs for A [..., n, n], rhs [..., n, m]: a triangular solve, or for graph exporters
    (which lack one) forward substitution row by row."""
    if not torch.onnx.is_in_onnx_export():
        return torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)
    L = A.tril(-1)
    rows = [rhs[..., 0, :]]
    for i in range(1, A.shape[-1]):
        rows.append(rhs[..., i, :] - (L[..., i, :i, None] * torch.stack(rows, dim=-2)).sum(-2))
    return torch.stack(rows, dim=-2)


def gated_delta_chunked(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Optional[Tensor],
                        chunk: int = CHUNK) -> tuple[Tensor, Tensor]:
    """The rule over chunks of `chunk` tokens, the same arguments and results as gated_delta_recurrent.

    Inside a chunk, with c_i the cumulative log-decay up to token i and D_ij = exp(c_i - c_j) (i >= j, else 0), the
    values actually written are u = (I + L)^-1 (beta v - W S0) where L_ij = beta_i k_i.k_j D_ij (i > j) and the
    rows of W are beta_i exp(c_i) k_i: one triangular solve per chunk for u0 = (I + L)^-1 beta v and
    w = (I + L)^-1 W, then u = u0 - w S0. Outputs o_i = exp(c_i) q_i S0 + sum_{j<=i} q_i.k_j D_ij u_j, and the state
    after the chunk exp(c_last) S0 + sum_j exp(c_last - c_j) k_j u_j^T."""
    dtype = v.dtype
    q, k, v, g, beta = _prepared(q, k, v, g, beta)
    B, H, T, Dk = k.shape
    Dv = v.shape[-1]
    pad = (-T) % chunk  # zero tokens at the end: k = 0, beta = 0, g = 0 leave the state as it is
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    n = (T + pad) // chunk
    q, k, v = (t.reshape(B, H, n, chunk, t.shape[-1]) for t in (q, k, v))
    g, beta = g.reshape(B, H, n, chunk), beta.reshape(B, H, n, chunk)
    c = g.cumsum(-1)  # [B, H, n, chunk]
    future = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (c[..., :, None] - c[..., None, :]).masked_fill(future, float("-inf")).exp()  # D_ij, 0 above
    k_beta = k * beta[..., None]
    A = (k_beta @ k.transpose(-1, -2)) * decay
    u0 = _unit_lower_inverse_apply(A, v * beta[..., None])
    w = _unit_lower_inverse_apply(A, k_beta * c.exp()[..., None])
    scores = (q @ k.transpose(-1, -2)) * decay  # q_i.k_j D_ij, j <= i
    q_decayed = q * c.exp()[..., None]
    k_to_end = k * (c[..., -1:] - c).exp()[..., None]
    chunk_decay = c[..., -1].exp()[..., None, None]  # [B, H, n, 1, 1]
    S = q.new_zeros(B, H, Dk, Dv) if state is None else state.to(q.dtype)
    out = []
    for i in range(n):
        u = u0[:, :, i] - w[:, :, i] @ S
        out.append(q_decayed[:, :, i] @ S + scores[:, :, i] @ u)
        S = S * chunk_decay[:, :, i] + k_to_end[:, :, i].transpose(-1, -2) @ u
    o = torch.stack(out, dim=2).reshape(B, H, n * chunk, Dv)[:, :, :T]
    return o.transpose(1, 2).to(dtype), S


def gated_rms_norm(x: Tensor, weight: Tensor, z: Tensor, eps: float) -> Tensor:
    """RMSNorm of each head x [..., H, Dv] by weight [H, Dv] (or [Dv]), then times SiLU(z) [..., H, Dv]: normed in
    float32, scaled in x's dtype, gated in float32 (Qwen3.5's RMSNormGated)."""
    xf = x.float()
    y = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (y * F.silu(z.float())).to(x.dtype)
