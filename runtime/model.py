"""One model class for dense and mixture (BAM / BTX / upcycled) transformers.

Readable reference path: every expert is computed in a plain loop. It is the oracle that the fused
inference path is tested against. Shapes: B batch, T time, D d_model, H heads, G kv heads,
Dh head dim, E experts, K top-k, V vocab.

Routing and auxiliary losses (paper, Appendix B.1), per router with N experts over B tokens:
    L_LB = N * sum_i f_i * P_i     f_i: fraction of the B*K top-k assignments that went to expert i
                                   P_i: mean over tokens of the full-softmax gate p_i(x)
    L_z  = (1/B) * sum_b (logsumexp_j x_j^b)^2
    L    = L_NLL + alpha * sum(L_LB) + beta * sum(L_z)
What each router contributes:
    FFN routers (top-k): L_LB and L_z.
    Attention routers, soft routing: L_z only. Every token goes to every attention expert, so there is
        no load to balance; the z-loss still keeps router logits small (the MoA works the paper cites
        find it important).
    Attention routers, top-k routing (ablation): L_LB and L_z, exactly like FFN routers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import ModelConfig


# ---- forced routing -------------------------------------------------------------------------
@dataclass
class ForcedRouting:
    """Override every router's gates (used by identity tests and debugging commands).

    expert=i       every router (attention and FFN) sends every token to expert i with gate 1.
    ffn_gates      Tensor [E]: the FFN gate values for every token (experts with gate 0 are skipped).
    attn_gates     Tensor [E]: the attention gate values for every token.
    Unset parts keep the learned routers.
    """

    expert: int | None = None
    ffn_gates: Tensor | None = None
    attn_gates: Tensor | None = None

    def gates(self, kind: str, n_experts: int) -> Tensor | None:
        if self.expert is not None:
            if not 0 <= self.expert < n_experts:
                raise ValueError(f"ForcedRouting.expert={self.expert} out of range for {n_experts} {kind} experts")
            return F.one_hot(torch.tensor(self.expert), n_experts).float()
        g = self.ffn_gates if kind == "ffn" else self.attn_gates
        if g is not None and g.shape != (n_experts,):
            raise ValueError(f"ForcedRouting.{kind}_gates has shape {tuple(g.shape)}, expected ({n_experts},)")
        return g


@dataclass
class ModelOutput:
    logits: Tensor  # [B, T, V]
    loss: Tensor | None = None  # nll + alpha * lb_loss + beta * z_loss
    nll: Tensor | None = None
    lb_loss: Tensor | None = None  # summed over routers that balance load
    z_loss: Tensor | None = None  # summed over all routers
    # every router of the forward pass by name ("layers.3.ffn_router"), in execution order: the gates
    # actually applied [B*T, E], and (unless forced) the logits, full softmax and top-k choices
    routing: dict[str, "Routing"] = field(default_factory=dict)


# ---- building blocks ------------------------------------------------------------------------
class Norm(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.kind, self.eps = cfg.norm, cfg.norm_eps
        self.weight = nn.Parameter(torch.ones(cfg.d_model))
        self.bias = nn.Parameter(torch.zeros(cfg.d_model)) if cfg.norm_bias else None

    def forward(self, x: Tensor) -> Tensor:
        if self.kind == "layernorm":
            return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


class StackedLinear(nn.Module):
    """E independent linear maps stored as one tensor: weight [E, out, in], bias [E, out]."""

    def __init__(self, n_experts: int, n_in: int, n_out: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_experts, n_out, n_in))
        self.bias = nn.Parameter(torch.zeros(n_experts, n_out)) if bias else None

    def forward(self, x: Tensor, e: int) -> Tensor:
        return F.linear(x, self.weight[e], None if self.bias is None else self.bias[e])


class Projections(nn.Module):
    """Holds one attention's or FFN's projections, dense (nn.Linear) or stacked per expert."""

    def __init__(self, specs: dict[str, tuple[int, int, bool]], n_experts: int = 0):
        super().__init__()
        for name, (n_in, n_out, bias) in specs.items():
            mod = StackedLinear(n_experts, n_in, n_out, bias) if n_experts else nn.Linear(n_in, n_out, bias=bias)
            self.add_module(name, mod)

    def proj(self, name: str, x: Tensor, e: int | None) -> Tensor:
        mod = getattr(self, name)
        return mod(x) if e is None or isinstance(mod, nn.Linear) else mod(x, e)


class Rotary(nn.Module):
    """RoPE on the first `rotary_dim` dims of each head; half-split or interleaved pairs."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.dim, self.interleaved, self.theta = cfg.rotary_dim, cfg.rope_interleaved, cfg.rope_theta

    def inv_freq(self, device: torch.device) -> Tensor:
        # Computed per call in float32 (not a buffer) so casting the model to bf16 never rounds it.
        exponent = torch.arange(0, self.dim, 2, dtype=torch.float64, device=device) / self.dim
        return (1.0 / self.theta ** exponent).float()

    def forward(self, x: Tensor, pos: Tensor) -> Tensor:  # x [B, T, heads, Dh], pos [T]
        ang = pos.float()[:, None] * self.inv_freq(x.device)[None, :]  # [T, rot/2]
        cos, sin = ang.cos()[None, :, None, :], ang.sin()[None, :, None, :]
        rot, rest = x[..., : self.dim].float(), x[..., self.dim:]
        if self.interleaved:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        else:
            x1, x2 = rot.chunk(2, dim=-1)
            out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return torch.cat((out.to(x.dtype), rest), dim=-1)


# ---- routing --------------------------------------------------------------------------------
@dataclass
class Routing:
    """Gates for one router over N = B*T tokens: dense [N, E] (zeros for unselected experts)."""

    gates: Tensor
    logits: Tensor | None = None  # [N, E] router logits (None when forced)
    probs: Tensor | None = None  # [N, E] full softmax
    topk: Tensor | None = None  # [N, K] selected experts


def route(router: nn.Linear, x: Tensor, n_experts: int, top_k: int | None, gate_norm: str,
          forced: Tensor | None) -> Routing:
    n_tok = x.shape[0] * x.shape[1]
    if forced is not None:
        return Routing(gates=forced.to(x.device, torch.float32).expand(n_tok, n_experts))
    logits = router(x).reshape(n_tok, n_experts).float()  # [N, E]
    probs = logits.softmax(-1)
    if top_k is None:  # soft routing: every expert, full softmax gates
        return Routing(gates=probs, logits=logits, probs=probs)
    top_p, top_i = probs.topk(top_k, dim=-1)  # [N, K]
    if gate_norm == "topk_softmax":
        top_p = top_p / top_p.sum(-1, keepdim=True)
    gates = torch.zeros_like(probs).scatter(-1, top_i, top_p)
    return Routing(gates=gates, logits=logits, probs=probs, topk=top_i)


def load_balancing_loss(probs: Tensor, topk: Tensor, n_experts: int) -> Tensor:
    """N * sum_i f_i * P_i; f from the top-k assignments (each token counts 1/K per slot)."""
    counts = torch.zeros(n_experts, device=probs.device).scatter_add(
        0, topk.reshape(-1), torch.ones(topk.numel(), device=probs.device))
    f = counts / topk.numel()
    P = probs.mean(0)
    return n_experts * (f * P).sum()


def z_loss(logits: Tensor) -> Tensor:
    return logits.logsumexp(-1).pow(2).mean()


# ---- the block ------------------------------------------------------------------------------
def _activation(name: str):
    return {"gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
            "relu": F.relu, "silu": F.silu, "swiglu": F.silu}[name]


class Block(nn.Module):
    """One transformer block; dense or mixture attention, dense or mixture FFN.

    Parameters (canonical names, see runtime/layout.py):
      attn          dense Q, K, V, O; or, in a shared-KV mixture, the one shared K and V
      attn_experts  stacked [E, ...] Q, O and (expert KV) K, V
      attn_router   [E, D]
      ffn           dense gate/up/down;  ffn_experts: stacked [E, ...];  ffn_router [E, D]
    """

    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        self.cfg, self.index = cfg, index
        D = cfg.d_model
        self.attn_norm = Norm(cfg)
        if cfg.has_ffn_norm:
            self.ffn_norm = Norm(cfg)
        q = {"q": (D, cfg.q_dim, cfg.qkv_bias)}
        kv = {"k": (D, cfg.kv_dim, cfg.qkv_bias), "v": (D, cfg.kv_dim, cfg.qkv_bias)}
        o = {"o": (cfg.q_dim, D, cfg.o_bias)}
        Ea = cfg.attn_experts
        if Ea == 0:
            self.attn = Projections({**q, **kv, **o})
        elif cfg.kv_mode == "expert":
            self.attn_router = nn.Linear(D, Ea, bias=False)
            self.attn_experts = Projections({**q, **kv, **o}, Ea)
        else:
            self.attn_router = nn.Linear(D, Ea, bias=False)
            self.attn = Projections(kv)
            self.attn_experts = Projections({**q, **o}, Ea)
        ffn = {"gate": (D, cfg.ffn_hidden, cfg.ffn_bias)} if cfg.gated_ffn else {}
        ffn.update(up=(D, cfg.ffn_hidden, cfg.ffn_bias), down=(cfg.ffn_hidden, D, cfg.ffn_bias))
        if cfg.ffn_experts:
            self.ffn_router = nn.Linear(D, cfg.ffn_experts, bias=False)
            self.ffn_experts = Projections(ffn, cfg.ffn_experts)
        else:
            self.ffn = Projections(ffn)
        self.act = _activation(cfg.activation)
        self.rotary = Rotary(cfg) if cfg.position == "rope" else None

    # -- one expert ------------------------------------------------------------------------
    def _attn_proj(self, name: str, x: Tensor, e: int | None) -> Tensor:
        expert_owned = self.cfg.attn_experts and (name in ("q", "o") or self.cfg.kv_mode == "expert")
        return (self.attn_experts if expert_owned else self.attn).proj(name, x, e)

    def attention_expert(self, x: Tensor, pos: Tensor, e: int | None) -> Tensor:
        """MHA_e(x): x [B, T, D] -> [B, T, D] (e=None: dense attention)."""
        cfg = self.cfg
        B, T, _ = x.shape
        q = self._attn_proj("q", x, e).view(B, T, cfg.n_heads, cfg.head_dim)
        k = self._attn_proj("k", x, e).view(B, T, cfg.n_kv_heads, cfg.head_dim)
        v = self._attn_proj("v", x, e).view(B, T, cfg.n_kv_heads, cfg.head_dim)
        if self.rotary is not None:
            q, k = self.rotary(q, pos), self.rotary(k, pos)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads, T, Dh]
        rep = cfg.n_heads // cfg.n_kv_heads
        if rep > 1:  # GQA: query head h reads kv head h // rep
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0 / math.sqrt(cfg.head_dim))
        return self._attn_proj("o", y.transpose(1, 2).reshape(B, T, cfg.q_dim), e)

    def ffn_expert(self, x: Tensor, e: int | None) -> Tensor:
        """FFN_e(x): [..., D] -> [..., D] (e=None: dense FFN)."""
        p = self.ffn_experts if self.cfg.ffn_experts else self.ffn
        h = p.proj("up", x, e)
        h = self.act(p.proj("gate", x, e)) * h if self.cfg.gated_ffn else self.act(h)
        return p.proj("down", h, e)

    # -- mixtures --------------------------------------------------------------------------
    def attention(self, x: Tensor, pos: Tensor, forced: ForcedRouting | None, aux: list) -> Tensor:
        cfg, E = self.cfg, self.cfg.attn_experts
        if not E:
            return self.attention_expert(x, pos, None)
        r = route(self.attn_router, x, E, cfg.attn_top_k, cfg.gate_norm, forced.gates("attn", E) if forced else None)
        aux.append((f"layers.{self.index}.attn_router", r, cfg.attn_top_k is not None))
        # Attention needs whole sequences, so each expert runs on every token; its output is
        # weighted by the gate (zero for tokens that top-k routing did not send to it).
        B, T, D = x.shape
        gates = r.gates.view(B, T, E)
        out = torch.zeros_like(x)
        for e in range(E):
            if bool((gates[..., e] != 0).any()):
                out = out + gates[..., e, None].to(x.dtype) * self.attention_expert(x, pos, e)
        return out

    def feed_forward(self, x: Tensor, forced: ForcedRouting | None, aux: list) -> Tensor:
        cfg, E = self.cfg, self.cfg.ffn_experts
        if not E:
            return self.ffn_expert(x, None)
        r = route(self.ffn_router, x, E, cfg.ffn_top_k, cfg.gate_norm, forced.gates("ffn", E) if forced else None)
        aux.append((f"layers.{self.index}.ffn_router", r, True))
        # Sparse dispatch: each expert sees only the tokens routed to it.
        B, T, D = x.shape
        flat = x.reshape(B * T, D)
        out = torch.zeros_like(flat)
        for e in range(E):
            idx = r.gates[:, e].nonzero(as_tuple=True)[0]
            if idx.numel():
                y = self.ffn_expert(flat[idx], e)
                out = out.index_add(0, idx, r.gates[idx, e, None].to(y.dtype) * y)
        return out.view(B, T, D)

    def forward(self, x: Tensor, pos: Tensor, forced: ForcedRouting | None, aux: list) -> Tensor:
        style = self.cfg.block
        if style == "sequential":
            h = x + self.attention(self.attn_norm(x), pos, forced, aux)
            return h + self.feed_forward(self.ffn_norm(h), forced, aux)
        if style == "parallel":  # one shared norm (PaLM, GPT-J, Cohere, the paper)
            n = self.attn_norm(x)
            return x + self.attention(n, pos, forced, aux) + self.feed_forward(n, forced, aux)
        # parallel_two_norms (GPT-NeoX)
        return x + self.attention(self.attn_norm(x), pos, forced, aux) + self.feed_forward(self.ffn_norm(x), forced, aux)


class Model(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        if cfg.position == "learned":
            self.pos_embed = nn.Embedding(cfg.max_positions, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.final_norm = Norm(cfg)
        if not cfg.tie_embeddings:
            self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.lm_head_bias:
            self.lm_head_bias = nn.Parameter(torch.zeros(cfg.vocab_size))
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02, seed: int | None = None) -> None:
        """Random init (normal(0, std) for matrices, ones/zeros for norms and biases)."""
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        for name, p in self.named_parameters():
            if p.is_meta:
                continue
            with torch.no_grad():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif p.dim() == 1 or name.endswith(".bias"):
                    p.zero_()
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * std)

    # lm_head.bias is a canonical name but nn.Linear(bias=False) has no slot when tied; keep one place.
    def state_dict(self, *args, **kwargs):
        sd = super().state_dict(*args, **kwargs)
        if "lm_head_bias" in sd:
            sd["lm_head.bias"] = sd.pop("lm_head_bias")
        return sd

    def load_state_dict(self, state, strict: bool = True, assign: bool = False):
        state = dict(state)
        if "lm_head.bias" in state:
            state["lm_head_bias"] = state.pop("lm_head.bias")
        return super().load_state_dict(state, strict=strict, assign=assign)

    def forward(self, tokens: Tensor, targets: Tensor | None = None,
                routing: ForcedRouting | None = None) -> ModelOutput:
        cfg = self.config
        B, T = tokens.shape
        pos = torch.arange(T, device=tokens.device)
        x = self.embed(tokens)
        if cfg.position == "learned":
            if T > cfg.max_positions:
                raise ValueError(f"sequence length {T} exceeds max_positions={cfg.max_positions}")
            x = x + self.pos_embed(pos)[None]
        aux: list = []
        for blk in self.layers:
            x = blk(x, pos, routing, aux)
        x = self.final_norm(x)
        head = self.embed.weight if cfg.tie_embeddings else self.lm_head.weight
        logits = F.linear(x, head, getattr(self, "lm_head_bias", None))
        if cfg.logit_scale != 1.0:
            logits = logits * cfg.logit_scale
        out = ModelOutput(logits=logits)
        zero = logits.new_zeros((), dtype=torch.float32)
        lb, z = zero, zero
        for name, r, balances in aux:
            out.routing[name] = r
            if r.logits is None:  # forced routing: nothing learned to regularize
                continue
            z = z + z_loss(r.logits)
            if balances:
                lb = lb + load_balancing_loss(r.probs, r.topk, r.probs.shape[-1])
        out.lb_loss, out.z_loss = lb, z
        if targets is not None:
            out.nll = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                      ignore_index=-100)
            out.loss = out.nll + cfg.lb_coef * lb + cfg.z_coef * z
        return out
