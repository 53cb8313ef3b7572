"""bam-surgery's mixtures as a vLLM model: the HF BAM export (`BamForCausalLM`, converters/hf_bam/) written with
vLLM's own layers, so vLLM's paged KV cache, continuous batching and tensor parallelism serve it. Imported by
vLLM only (the plugin, __init__.py, names this module as a string).

The math is runtime/blocks.py's fused path (tests/compat/test_vllm.py holds the tokens and logprobs to
runtime.generate's, for every model kind and every family the tool reads):
  attention     one QKVParallelLinear and one vLLM Attention per block, over
                  dense            H query heads, G kv heads;
                  expert K/V       E*H query heads and E*G kv heads, expert-major (head e*H + h reads kv head
                                   e*G + h // rep: vLLM's GQA rule, so every expert attends to its own K/V);
                  shared K/V       E*H query heads over the G shared kv heads, ordered (g, e, r) with h = g*rep + r,
                                   so that GQA's j // (E*rep) picks kv head g (blocks.py `_attention_fused`).
                The attention takes the layer's sliding window (`per_layer_sliding_window`), the attention scale
                (attn_scale, or 1/sqrt(attn_scale_dim)) and the logits' soft-cap. Queries and keys go through their
                QK-norm (QKNorm: per head or over each owner's full width, one weight per expert), then the layer's
                RoPE (vLLM's get_rope with the scaled-RoPE dictionary; the sliding layers' own base; none in NoPE
                layers), then the queries through Ministral 3's scale by position (blocks.py `query_scale`).
                Each query head's output is scaled by its expert's gate (the router's: soft, or top-k with zero for
                unselected experts; every expert still attends and caches its keys), and ONE RowParallelLinear over
                the E output projections side by side sums them: sum_e g_e O_e y_e (+ sum_e g_e b_e).
  FFN           dense: MergedColumnParallelLinear (gate, up) + SiluAndMul or GeluAndMul (Gemma's tanh GeGLU), or
                ColumnParallelLinear + activation, then RowParallelLinear. Experts: vLLM's fused-MoE layer
                (FusedMoEFactory) over the router's logits, softmax then top-k, renormalized for gate_norm
                topk_softmax. The shared expert is a dense FFN beside it, times sigmoid(w . x). Ungated experts (GELU,
                tanh-GELU, SiLU) run in the same layer with a constant gate (MOE_ACTIVATION); ReLU experts are refused.
  routers       the runtime's own router modules (runtime/routers.py: every kind, replicated on every rank),
                gates from runtime/blocks.py `route`.
  norms         vLLM's RMSNorm or LayerNorm, or UnitOffsetRMSNorm ((1 + w), norm_unit_offset), before each sublayer (pre),
                after it (post: OLMo 2) or both (sandwich: Gemma), and the final norm.
  rest          VocabParallelEmbedding (tokens, times sqrt(d_model) with scale_embeddings and Granite's
                embedding_multiplier; a learned position table), each sublayer's output times Granite's
                residual_multiplier, ParallelLMHead (bias, tying) and vLLM's LogitsProcessor (logit_scale, the final
                soft-cap).
Backends: on vLLM's CPU backend the fused-MoE layer runs its CPU kernel (gated silu/gelu/gelu_tanh), attention
runs CPU attention (head sizes support.CPU_HEAD_SIZES); on GPUs both are vLLM's own (not measured here).
Weights are read by name from the export's safetensors; every tensor is consumed and every parameter loaded, or
loading stops with one line naming the tensor.
"""
from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.distributed import (get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size,
                              tensor_model_parallel_all_reduce)
from vllm.model_executor.layers.activation import GeluAndMul, SiluAndMul
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.fused_moe import FusedMoEFactory
from vllm.model_executor.layers.layernorm import LayerNorm, RMSNorm
from vllm.model_executor.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
                                               ReplicatedLinear, RowParallelLinear)
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.sequence import IntermediateTensors

from bam_surgery.runtime.blocks import ACTIVATIONS, GATED, block_norms, layer_window, query_scale, route
from bam_surgery.runtime.routers import make_router

from ..hf_bam.export import canonical_weight_name
from .support import check_vllm


# the fused-MoE layer computes act(w1 x + b1) * (w3 x + b3): gated experts (SwiGLU, Gemma's tanh GeGLU) as they are; an
# ungated expert act(up x + b) runs as w1 = up, b1 = b, w3 = 0, b3 = 1 (exact, at twice the up projection's work).
# ReLU has no gated form there (support.py refuses it).
MOE_ACTIVATION = {"swiglu": "silu", "geglu_tanh": "gelu_tanh", "silu": "silu", "gelu": "gelu", "gelu_tanh": "gelu_tanh"}
GATED_ACT = {"swiglu": SiluAndMul, "geglu_tanh": lambda: GeluAndMul(approximate="tanh")}  # act(gate x) * up x
EXPERT_SHARDS = {"gate": ("w13", "w1"), "up": ("w13", "w3"), "down": ("w2", "w2")}  # gated; ungated: up -> w1


def _load(param: nn.Parameter, tensor: torch.Tensor, *shard) -> None:
    getattr(param, "weight_loader", default_weight_loader)(param, tensor, *shard)


class UnitOffsetRMSNorm(nn.Module):
    """RMSNorm scaling by 1 + weight (norm_unit_offset), in float32 and cast back, as runtime/blocks.py Norm (and
    vLLM's own layer for that norm, op for op)."""

    def __init__(self, width: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


def norm_layer(cfg, width: int | None = None) -> nn.Module:
    """A block's or the final norm: vLLM's LayerNorm (bias with norm_bias) or RMSNorm, or UnitOffsetRMSNorm (scaling
    by 1 + weight: norm_unit_offset)."""
    width = width or cfg.d_model
    if cfg.norm == "layernorm":
        return LayerNorm(width, eps=cfg.norm_eps, bias=cfg.norm_bias)
    return (UnitOffsetRMSNorm if cfg.norm_unit_offset else RMSNorm)(width, eps=cfg.norm_eps)


def rope_parameters(cfg, local: bool) -> dict:
    """vLLM's get_rope dictionary for the config's RoPE, as the runtime computes it (blocks.py rope_frequencies): plain,
    or scaled_rope's type with the values the runtime derives when they are left out; local: the sliding layers'
    plain RoPE of base window_rope_theta."""
    if local:
        return {"rope_type": "default", "rope_theta": cfg.window_rope_theta}
    s = cfg.scaled_rope
    kind = "default" if s is None else s["rope_type"]
    out = {"rope_type": kind, "rope_theta": cfg.rope_theta}
    if kind in ("linear", "llama3"):
        out |= {k: v for k, v in s.items() if k != "rope_type"}
    elif kind == "dynamic":  # plain RoPE within max_positions (support.LENGTHS keeps the engine there)
        out |= {"factor": s["factor"], "max_trained_positions": cfg.max_positions}
    elif kind in ("yarn", "longrope"):
        original = s["original_max_position_embeddings"]
        factor = s.get("factor") or cfg.max_positions / original
        out |= {k: v for k, v in s.items() if k not in ("rope_type", "factor", "attention_factor")}
        if kind == "yarn":
            out |= {"factor": factor} | ({"attention_factor": s["attention_factor"]} if "attention_factor" in s else {})
        else:  # both tables scaled by attention_factor, else sqrt(1 + ln(factor) / ln(original))
            scale = s.get("attention_factor")
            if scale is None:
                scale = 1.0 if factor <= 1.0 else (1 + math.log(factor) / math.log(original)) ** 0.5
            out |= {"short_mscale": scale, "long_mscale": scale}
    return out


def layer_rope(cfg, layer: int, sliding: bool) -> nn.Module | None:
    """The RoPE of one layer (vLLM's get_rope), or None: no RoPE (learned or no positions; a NoPE layer)."""
    if cfg.position != "rope" or layer in (cfg.nope_layers or ()):
        return None
    params = rope_parameters(cfg, local=sliding and cfg.window_rope_theta is not None)
    return get_rope(cfg.head_dim, max_position=cfg.max_positions, is_neox_style=not cfg.rope_interleaved,
                    rope_parameters=params | {"rope_dim": cfg.rotary_dim})


class BamMLP(nn.Module):
    """One dense FFN of width `hidden` (the block's FFN, or the shared expert): gate/up/down, tensor parallel."""

    def __init__(self, cfg, hidden: int, prefix: str):
        super().__init__()
        D, bias = cfg.d_model, cfg.ffn_bias
        self.gated = cfg.activation in GATED
        if self.gated:
            self.gate_up = MergedColumnParallelLinear(D, [hidden, hidden], bias=bias, prefix=f"{prefix}.gate_up")
            self.act = GATED_ACT[cfg.activation]()
        else:
            self.up = ColumnParallelLinear(D, hidden, bias=bias, prefix=f"{prefix}.up")
            self.act = ACTIVATIONS[cfg.activation]
        self.down = RowParallelLinear(hidden, D, bias=bias, prefix=f"{prefix}.down")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = (self.gate_up if self.gated else self.up)(x)
        y, _ = self.down(self.act(h))
        return y

    def weight_targets(self) -> dict[str, tuple]:
        """canonical name under the FFN's prefix -> (parameter, shard id or None)."""
        out = {"down.weight": (self.down.weight, None)}
        if self.gated:
            out |= {"gate.weight": (self.gate_up.weight, 0), "up.weight": (self.gate_up.weight, 1)}
        else:
            out["up.weight"] = (self.up.weight, None)
        if self.down.bias is not None:
            out["down.bias"] = (self.down.bias, None)
            if self.gated:
                out |= {"gate.bias": (self.gate_up.bias, 0), "up.bias": (self.gate_up.bias, 1)}
            else:
                out["up.bias"] = (self.up.bias, None)
        return out


class QKNorm(nn.Module):
    """The QK-norm of one projection (q or k) over this rank's heads [N, heads*Dh], before RoPE: each head normed
    over its Dh (qk_norm head: Qwen3, Gemma 3) or over the full width of its owner (qk_norm full: OLMo 2), where the
    owner is the attention expert the head belongs to (each expert has its own norm: weight [E, width]) or the one
    dense or shared projection (weight [width]). vLLM's RMSNorm holds one weight vector over contiguous features; here
    the heads of several experts interleave (shared K/V's (g, e, r) order) and split across ranks, so the weight is
    kept per local head ([heads, Dh], gathered from the stored tensor at load) and a full-width norm sums each
    owner's statistics over its heads, across ranks (an all-reduce) when tensor parallel. Math as runtime/blocks.py
    Norm: RMSNorm in float32 (times 1 + weight with norm_unit_offset), or LayerNorm (bias with norm_bias)."""

    def __init__(self, cfg, owner: torch.Tensor, position: torch.Tensor, owners: int, per_owner: int, replicas: int):
        """owner, position: per head on this rank, its owner (expert, or 0) and its index among the owner's heads;
        owners: how many (E, or 1); per_owner: heads per owner; replicas: ranks holding each head (kv heads
        replicated when the tensor-parallel size passes their count)."""
        super().__init__()
        Dh = cfg.head_dim
        self.full, self.layernorm = cfg.qk_norm == "full", cfg.norm == "layernorm"
        self.eps, self.unit_offset, self.head_dim = cfg.norm_eps, cfg.norm_unit_offset, Dh
        self.owners, self.per_owner_width, self.replicas = owners, per_owner * Dh, replicas
        self.tp = get_tensor_model_parallel_world_size()
        self.register_buffer("owner", owner, persistent=False)
        self.register_buffer("position", position if self.full else torch.zeros_like(position), persistent=False)
        self.weight = nn.Parameter(torch.ones(owner.numel(), Dh))
        self.bias = nn.Parameter(torch.zeros(owner.numel(), Dh)) if cfg.norm_bias else None

    def local(self, stored: torch.Tensor) -> torch.Tensor:
        """The stored weight or bias ([width] or [E, width]) -> this rank's [heads, Dh], in head order."""
        return stored.reshape(self.owners, -1, self.head_dim)[self.owner, self.position]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float().reshape(x.shape[0], -1, self.head_dim)  # [N, heads, Dh] (x: a column slice of qkv)
        if self.layernorm:
            xf = xf - self._mean(xf)
        xf = xf * torch.rsqrt(self._mean(xf.pow(2)) + self.eps)
        weight = self.weight.float()
        xf = xf * (1.0 + weight if self.unit_offset else weight)
        if self.bias is not None:
            xf = xf + self.bias.float()
        return xf.to(x.dtype).view(x.shape)

    def _mean(self, v: torch.Tensor) -> torch.Tensor:
        """The mean of v [N, heads, Dh] over each head (per-head norm) or over each owner's heads on every rank
        (full width): [N, heads, 1]."""
        if not self.full:
            return v.mean(-1, keepdim=True)
        sums = v.new_zeros(v.shape[0], self.owners).index_add_(1, self.owner, v.sum(-1))
        if self.tp > 1:
            sums = tensor_model_parallel_all_reduce(sums)
        return (sums / (self.per_owner_width * self.replicas))[:, self.owner, None]


class BamAttention(nn.Module):
    """Dense attention, or soft/top-k Mixture-of-Attention with expert or shared K/V, as one vLLM attention."""

    def __init__(self, cfg, layer: int, cache_config, quant_config, prefix: str):
        super().__init__()
        self.cfg = cfg
        D, H, G, Dh, E = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.attn_experts
        self.E, self.expert_kv = E, bool(E) and cfg.kv_mode == "expert"
        n_q, n_kv = max(E, 1) * H, (E if self.expert_kv else 1) * G
        tp, rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
        if n_q % tp or (n_kv % tp and tp % n_kv):
            raise ValueError(f"tensor parallel size {tp} does not divide the {n_q} query heads and {n_kv} kv heads "
                             "of this model's attention")
        local_q, local_kv, replicas = n_q // tp, max(1, n_kv // tp), max(1, tp // n_kv)
        self.q_size, self.kv_size = local_q * Dh, local_kv * Dh
        self.qkv = QKVParallelLinear(D, Dh, n_q, n_kv, bias=cfg.qkv_bias, quant_config=quant_config,
                                     prefix=f"{prefix}.qkv")
        # a mixture's output biases are summed under the gates (sum_e g_e b_e), not added once
        self.o = RowParallelLinear(n_q * Dh, D, bias=cfg.o_bias and not E, quant_config=quant_config,
                                   prefix=f"{prefix}.o")
        window = layer_window(cfg, layer)
        self.rotary = layer_rope(cfg, layer, window is not None)
        # the owner (expert) of each query and kv head, and its index among the owner's heads (module docstring)
        q, kv = torch.arange(n_q), torch.arange(n_kv)
        if not E:
            q_owner, q_pos = torch.zeros_like(q), q
        elif self.expert_kv:
            q_owner, q_pos = q // H, q % H
        else:
            rep = H // G
            q_owner, q_pos = (q // rep) % E, (q // (E * rep)) * rep + q % rep
        kv_owner, kv_pos = (kv // G, kv % G) if self.expert_kv else (torch.zeros_like(kv), kv)
        q_local = slice(rank * local_q, (rank + 1) * local_q)
        kv_local = slice(rank // replicas * local_kv, (rank // replicas + 1) * local_kv)
        if cfg.qk_norm != "none":
            self.q_norm = QKNorm(cfg, q_owner[q_local], q_pos[q_local], max(E, 1), H, 1)
            self.k_norm = QKNorm(cfg, kv_owner[kv_local], kv_pos[kv_local], E if self.expert_kv else 1, G, replicas)
        scale = cfg.attn_scale if cfg.attn_scale is not None else (cfg.attn_scale_dim or Dh) ** -0.5
        self.attn = Attention(local_q, Dh, scale, num_kv_heads=local_kv, cache_config=cache_config,
                              quant_config=quant_config, logits_soft_cap=cfg.attn_softcap,
                              per_layer_sliding_window=window, prefix=f"{prefix}.attn")
        if E:
            self.router = make_router(cfg.attn_router_kind, cfg, E)
            self.o_bias = nn.Parameter(torch.empty(E, D)) if cfg.o_bias else None
            self.register_buffer("head_expert", q_owner[q_local], persistent=False)  # each local query head's expert

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.qkv(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.cfg.qk_norm != "none":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary is not None:
            q, k = self.rotary(positions, q, k)
        if self.cfg.attn_temperature is not None:  # Ministral 3: the queries scaled by position, after RoPE
            q = q * query_scale(self.cfg, positions[None])[0, :, :, 0].to(q.dtype)  # [N, 1]
        y = self.attn(q, k, v)  # [N, local heads * Dh]
        if not self.E:
            return self.o(y)[0]
        cfg = self.cfg
        gates = route(self.router, x[None], self.E, cfg.attn_top_k, cfg.gate_norm, None).gates  # [N, E] float32
        heads = self.head_expert.numel()
        y = (y.view(-1, heads, cfg.head_dim) * gates[:, self.head_expert, None].to(y.dtype)).view(y.shape)
        out, _ = self.o(y)
        if self.o_bias is not None:
            out = out + (gates @ self.o_bias.float()).to(out.dtype)
        return out

    def weight_targets(self) -> dict[str, tuple]:
        """canonical name under the block's prefix -> (parameter, shard id, reorder of the stored tensor)."""
        cfg, E = self.cfg, self.E
        H, G, Dh = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        if not E:
            out = {f"attn.{p}.weight": (self.qkv.weight, p, None) for p in "qkv"}
            out["attn.o.weight"] = (self.o.weight, None, None)
            if cfg.o_bias:
                out["attn.o.bias"] = (self.o.bias, None, None)
        else:
            rep = H // G

            def q_rows(t: torch.Tensor) -> torch.Tensor:  # [E, H*Dh, ...] -> [E*H*Dh, ...] in head order
                if self.expert_kv:
                    return t.reshape(E * H * Dh, *t.shape[2:])
                t = t.reshape(E, G, rep * Dh, *t.shape[2:]).transpose(0, 1)  # (g, e, r)
                return t.reshape(E * H * Dh, *t.shape[3:])

            def o_columns(t: torch.Tensor) -> torch.Tensor:  # [E, D, H*Dh] -> [D, E*H*Dh] in head order
                if self.expert_kv:
                    return t.permute(1, 0, 2).reshape(t.shape[1], E * H * Dh)
                return t.reshape(E, -1, G, rep * Dh).permute(1, 2, 0, 3).reshape(t.shape[1], E * H * Dh)

            kv = "attn_experts" if self.expert_kv else "attn"
            stacked = (lambda t: t.reshape(-1, *t.shape[2:])) if self.expert_kv else None
            out = {"attn_experts.q.weight": (self.qkv.weight, "q", q_rows),
                   f"{kv}.k.weight": (self.qkv.weight, "k", stacked), f"{kv}.v.weight": (self.qkv.weight, "v", stacked),
                   "attn_experts.o.weight": (self.o.weight, None, o_columns)}
            if cfg.o_bias:
                out["attn_experts.o.bias"] = (self.o_bias, None, None)
            out |= {f"attn_router.{n}": (p, None, None) for n, p in self.router.named_parameters()}
            out |= {f"attn_router.{n}": (b, None, None) for n, b in self.router.named_buffers()}
        if cfg.qkv_bias:
            for name, (param, shard, reorder) in list(out.items()):
                if name.endswith((".q.weight", ".k.weight", ".v.weight")):
                    out[name.replace(".weight", ".bias")] = (self.qkv.bias, shard, reorder)
        if cfg.qk_norm != "none":
            owners = {"q": "attn_experts" if E else "attn", "k": "attn_experts" if self.expert_kv else "attn"}
            for p, owner in owners.items():
                norm = getattr(self, f"{p}_norm")
                out |= {f"{owner}.{p}_norm.{n}": (t, None, norm.local) for n, t in norm.named_parameters()}
        return out


class BamFFN(nn.Module):
    """A dense FFN, or routed FFN experts (vLLM's fused-MoE layer) with an optional shared expert."""

    def __init__(self, cfg, quant_config, prefix: str):
        super().__init__()
        self.cfg = cfg
        if not cfg.ffn_experts:
            self.dense = BamMLP(cfg, cfg.ffn_hidden, f"{prefix}.ffn")
            return
        self.router = make_router(cfg.ffn_router_kind, cfg, cfg.ffn_experts)
        self.gated = cfg.activation in GATED
        self.experts = FusedMoEFactory(num_experts=cfg.ffn_experts, top_k=cfg.ffn_top_k, hidden_size=cfg.d_model,
                                       intermediate_size=cfg.ffn_hidden, renormalize=cfg.gate_norm == "topk_softmax",
                                       quant_config=quant_config, prefix=f"{prefix}.experts",
                                       activation=MOE_ACTIVATION[cfg.activation],
                                       has_bias=cfg.ffn_bias or not self.gated)
        if cfg.ffn_shared_hidden:
            self.shared = BamMLP(cfg, cfg.ffn_shared_hidden, f"{prefix}.ffn_shared")
            self.shared_gate = ReplicatedLinear(cfg.d_model, 1, bias=False, prefix=f"{prefix}.ffn_shared_gate")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.cfg.ffn_experts:
            return self.dense(x)
        out = self.experts(x, self.router(x).float())
        if self.cfg.ffn_shared_hidden:
            out = out + torch.sigmoid(self.shared_gate(x)[0]) * self.shared(x)
        return out

    def weight_targets(self) -> dict[str, tuple]:
        """canonical name under the block's prefix -> (parameter, shard id, None); expert tensors -> (parameter,
        fused-MoE shard id, "experts")."""
        if not self.cfg.ffn_experts:
            return {f"ffn.{n}": (p, s, None) for n, (p, s) in self.dense.weight_targets().items()}
        shards = EXPERT_SHARDS if self.gated else {"up": ("w13", "w1"), "down": ("w2", "w2")}
        kinds = ("weight", "bias") if self.cfg.ffn_bias else ("weight",)
        out = {f"ffn_experts.{proj}.{kind}": (self._expert_param(f"{stem}_{kind}"), shard, "experts")
               for proj, (stem, shard) in shards.items() for kind in kinds}
        out |= {f"ffn_router.{n}": (p, None, None) for n, p in self.router.named_parameters()}
        out |= {f"ffn_router.{n}": (b, None, None) for n, b in self.router.named_buffers()}
        if self.cfg.ffn_shared_hidden:
            out |= {f"ffn_shared.{n}": (p, s, None) for n, (p, s) in self.shared.weight_targets().items()}
            out["ffn_shared_gate.weight"] = (self.shared_gate.weight, None, None)
        return out

    def _expert_param(self, stem: str) -> nn.Parameter:
        return next(p for n, p in self.experts.named_parameters() if n.endswith(stem))

    def load_constants(self) -> list[nn.Parameter]:
        """An ungated expert's constant parts (w3 = 0, b3 = 1; b1 = b2 = 0 without FFN biases): the parameters set."""
        if not self.cfg.ffn_experts or self.gated:
            return []
        E, F, D = self.cfg.ffn_experts, self.cfg.ffn_hidden, self.cfg.d_model
        constants = [("w13_weight", "w3", torch.zeros(F, D)), ("w13_bias", "w3", torch.ones(F))]
        if not self.cfg.ffn_bias:
            constants += [("w13_bias", "w1", torch.zeros(F)), ("w2_bias", "w2", torch.zeros(D))]
        for stem, shard, value in constants:
            param = self._expert_param(stem)
            for e in range(E):
                param.weight_loader(param, value.to(param.dtype), stem, shard_id=shard, expert_id=e)
        return [self._expert_param(stem) for stem, _, _ in constants]


class BamBlock(nn.Module):
    def __init__(self, cfg, layer: int, cache_config, quant_config, prefix: str):
        super().__init__()
        self.style, self.where, self.norms = cfg.block, cfg.norm_position, block_norms(cfg)
        self.residual = cfg.residual_multiplier
        for name in self.norms:
            self.add_module(name, norm_layer(cfg))
        self.attention = BamAttention(cfg, layer, cache_config, quant_config, prefix)
        self.ffn = BamFFN(cfg, quant_config, prefix)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        r = self._residual
        if self.where == "post":
            h = x + r(self.attn_post_norm(self.attention(positions, x)))
            return h + r(self.ffn_post_norm(self.ffn(h)))
        if self.where == "sandwich":
            h = x + r(self.attn_post_norm(self.attention(positions, self.attn_norm(x))))
            return h + r(self.ffn_post_norm(self.ffn(self.ffn_norm(h))))
        if self.style == "sequential":
            h = x + r(self.attention(positions, self.attn_norm(x)))
            return h + r(self.ffn(self.ffn_norm(h)))
        if self.style == "parallel":
            n = self.attn_norm(x)
            return x + r(self.attention(positions, n)) + r(self.ffn(n))
        return x + r(self.attention(positions, self.attn_norm(x))) + r(self.ffn(self.ffn_norm(x)))

    def _residual(self, y: torch.Tensor) -> torch.Tensor:
        """A sublayer's output as it joins the residual stream: times residual_multiplier (Granite's), if not 1."""
        return y if self.residual == 1.0 else y * self.residual

    def weight_targets(self) -> dict[str, tuple]:
        out = {f"{name}.{n}": (p, None, None) for name in self.norms
               for n, p in getattr(self, name).named_parameters()}
        return out | self.attention.weight_targets() | self.ffn.weight_targets()


class BamForCausalLM(nn.Module):
    """The HF BAM export's architecture in vLLM (one pipeline stage)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        cfg = vllm_config.model_config.hf_config
        check_vllm(cfg, vllm_config.model_config.max_model_len)
        self.config = cfg
        cache_config, quant_config = vllm_config.cache_config, vllm_config.quant_config
        self.embed = VocabParallelEmbedding(cfg.vocab_size, cfg.d_model, prefix=f"{prefix}embed")
        self.pos_embed = (VocabParallelEmbedding(cfg.max_positions, cfg.d_model, prefix=f"{prefix}pos_embed")
                          if cfg.position == "learned" else None)
        self.layers = nn.ModuleList(BamBlock(cfg, i, cache_config, quant_config, f"{prefix}layers.{i}")
                                    for i in range(cfg.n_layers))
        self.final_norm = norm_layer(cfg) if cfg.final_norm else nn.Identity()
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.d_model, bias=cfg.lm_head_bias, quant_config=quant_config,
                                      prefix=f"{prefix}lm_head")
        if cfg.tie_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.embed)
        # the runtime scales the logits by s, then soft-caps them by c: c tanh(s l / c); vLLM's LogitsProcessor
        # soft-caps first, then scales, and s (c/s) tanh(l / (c/s)) is the same
        softcap = None if cfg.final_softcap is None else cfg.final_softcap / cfg.logit_scale
        self.logits_processor = LogitsProcessor(cfg.vocab_size, scale=cfg.logit_scale, soft_cap=softcap)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """As runtime/blocks.py embed_tokens: times sqrt(d_model) rounded to the embeddings' dtype first (Gemma's
        scale_embeddings), then times embedding_multiplier (Granite's)."""
        x = self.embed(input_ids)
        if self.config.scale_embeddings:
            x = x * torch.tensor(self.config.d_model ** 0.5, dtype=x.dtype, device=x.device)
        if self.config.embedding_multiplier != 1.0:
            x = x * self.config.embedding_multiplier
        return x

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        if self.pos_embed is not None:
            x = x + self.pos_embed(positions)
        for block in self.layers:
            x = block(positions, x)
        return self.final_norm(x)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states,
                                     self.lm_head.bias if self.config.lm_head_bias else None)

    def weight_targets(self) -> dict[str, tuple]:
        """Every canonical tensor name of the export -> (parameter, shard id, reorder)."""
        out = {"embed.weight": (self.embed.weight, None, None)}
        if self.pos_embed is not None:
            out["pos_embed.weight"] = (self.pos_embed.weight, None, None)
        for i, block in enumerate(self.layers):
            out |= {f"layers.{i}.{n}": t for n, t in block.weight_targets().items()}
        out |= {f"final_norm.{n}": (p, None, None) for n, p in self.final_norm.named_parameters()}
        if not self.config.tie_embeddings:
            out["lm_head.weight"] = (self.lm_head.weight, None, None)
        if self.config.lm_head_bias:
            out["lm_head.bias"] = (self.lm_head.bias, None, None)
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Every tensor of the export into its parameter (by canonical name); one line for a tensor the model
        has no place for or a tensor missing from the export."""
        targets = self.weight_targets()
        seen: set[str] = set()
        for hf_name, tensor in weights:
            try:
                name = canonical_weight_name(hf_name)
            except KeyError:
                name = hf_name
            if name not in targets:
                raise ValueError(f"{hf_name}: a tensor bam-surgery's vLLM model has no place for (not an HF BAM "
                                 "export of this config?)")
            param, shard, reorder = targets[name]
            if reorder == "experts":  # one expert at a time, through the fused-MoE layer's own loader
                for e in range(tensor.shape[0]):
                    param.weight_loader(param, tensor[e], name, shard_id=shard, expert_id=e)
            elif isinstance(param, nn.Parameter):
                _load(param, reorder(tensor) if reorder else tensor, *(() if shard is None else (shard,)))
            else:  # a router's buffer (key store)
                param.copy_(tensor)
            seen.add(name)
        missing = sorted(set(targets) - seen)
        if missing:
            raise ValueError(f"the export has no tensor {missing[0]} (and {len(missing) - 1} more missing): not an "
                             "HF BAM export of this config?")
        constants = [p for block in self.layers for p in block.ffn.load_constants()]
        loaded = {id(param) for param, _, _ in targets.values()} | {id(p) for p in constants}
        return {n for n, p in self.named_parameters() if id(p) in loaded}
