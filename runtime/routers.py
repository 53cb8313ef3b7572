"""Router kinds: one definition per kind of what maps token states x [N, D] to logits over E experts [N, E].

Each kind is one nn.Module subclass of Router, listed in ROUTER_KINDS, and gives
    tensors(cfg, E)   its tensors: names under the router's prefix (layers.{i}.ffn_router. / attn_router.),
                      shapes, how a fresh merge initializes each (INITS), and which are buffers (state that
                      gradients do not train; counted apart from parameters). runtime/layout.py builds the
                      canonical layout from it, so the merge plan, the audit, check_layout and every export
                      follow.
    forward(x)        x [N, D] (the router's input: the block's normed state) -> logits [N, E]
    after_step()      called once after every optimizer step (train/loop.py through Transformer.after_step):
                      the hook for kinds whose state moves by rules rather than gradients; no-op by default.
Routing itself (softmax, top-k, gates, losses) is the same for every kind: runtime/blocks.py `route`.

Kinds (D d_model, E experts, Dh head_dim; docs/routers.md has the formulas and the warm starts):
    linear            logits = W x                          weight [E, D]
    mlp               logits = W2 gelu(W1 x + b1)           hidden.weight [R, D], hidden.bias [R], out.weight [E, R];
                                                            R = router_hidden or 2D; exact (erf) GELU
    attention         q = Wq x, k_e = Wk m_e,               query.weight [R, D], key.weight [R, D],
                      logits_e = q.k_e / sqrt(R)            embeddings.weight [E, D] (m_e); R = router_hidden or Dh
    expert_embedding  logits_e = cos(x, m_e) / tau,         embeddings.weight [E, D], log_temperature [1] = log tau
                      tau = exp(log_temperature)            (initialized to log(router_temperature))
    key_store         q = W_out gelu(W_in x + b_in) + b_out, query_in.weight [2D, D], .bias [2D],
                      logits_e = cos(q, k_e) / T            query_out.weight [D, 2D], .bias [D]; buffers keys [E, D],
                      (T = router_temperature, fixed)       usage [E], moved by runtime/key_store.py's rules

This file is shipped next to blocks.py into every HF BAM export (as routers.py, byte for byte): it imports
only torch and the standard library. Configs are duck-typed (router_hidden, router_temperature, d_model,
head_dim).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

Shape = tuple[int, ...]

# How a fresh merge (surgery/plan.py) and a fresh Model (runtime/model.py reset_parameters) set a router tensor:
INITS = (
    "logits",  # the tensor the logits are read from: normal(0, std) (merge --router-std), or zeros when the
               # recipe says routers.init: zeros (all experts equal at the start)
    "normal",  # normal(0, std)
    "unit",  # normal(0, 1): expert embeddings live in model space, where the normed states are O(1) per coordinate
    "zeros",
    "log_temperature",  # log(cfg.router_temperature)
    "unit_rows",  # normal(0, 1) rows scaled to unit norm: random directions (a key store's keys)
    "fair_share",  # 1/E everywhere (a key store's usage EMA: uniform)
)


@dataclass(frozen=True)
class RouterTensor:
    name: str  # under the router's prefix: "weight", "hidden.weight", ...
    shape: Shape
    init: str  # one of INITS
    buffer: bool = False  # not trained by gradient (moved by after_step); counted apart from parameters


class Router(nn.Module):
    """Base of every kind: token states [N, D] -> logits [N, E]."""

    kind: ClassVar[str]
    routes_attention: ClassVar[bool] = True  # False: FFN routers only (the config refuses it for attention)

    def __init__(self, cfg, n_experts: int):
        super().__init__()
        self.n_experts = n_experts

    @classmethod
    def tensors(cls, cfg, n_experts: int) -> list[RouterTensor]:
        raise NotImplementedError

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the router computes in (its first tensor's): logits are not computed under autocast."""
        return next(self.parameters()).dtype

    def after_step(self) -> None:
        """Rule-based (non-gradient) updates after an optimizer step; nothing for gradient-trained kinds."""


def init_tensor(spec: RouterTensor, cfg, std: float, generator: torch.Generator | None = None) -> Tensor:
    """A fresh value of one router tensor (float32, CPU): what a new Model holds before any checkpoint is
    loaded. Merges make the same values through their plan ops (surgery/plan.py), seeded per tensor."""
    if spec.init in ("logits", "normal"):
        return torch.randn(spec.shape, generator=generator) * std
    if spec.init == "unit":
        return torch.randn(spec.shape, generator=generator)
    if spec.init == "zeros":
        return torch.zeros(spec.shape)
    if spec.init == "log_temperature":
        return torch.full(spec.shape, math.log(cfg.router_temperature))
    if spec.init == "unit_rows":
        return F.normalize(torch.randn(spec.shape, generator=generator), dim=-1)
    if spec.init == "fair_share":
        return torch.full(spec.shape, 1.0 / spec.shape[0])
    raise ValueError(f"{spec.name}: unknown router init {spec.init!r}; the inits are {', '.join(INITS)}")


class LinearRouter(Router):
    kind = "linear"

    def __init__(self, cfg, n_experts: int):
        super().__init__(cfg, n_experts)
        self.weight = nn.Parameter(torch.empty(n_experts, cfg.d_model))  # [E, D]

    @classmethod
    def tensors(cls, cfg, n_experts: int) -> list[RouterTensor]:
        return [RouterTensor("weight", (n_experts, cfg.d_model), "logits")]

    def forward(self, x: Tensor) -> Tensor:  # [N, D] -> [N, E]
        return F.linear(x, self.weight)


def mlp_hidden(cfg) -> int:
    return cfg.router_hidden or 2 * cfg.d_model


class MLPRouter(Router):
    kind = "mlp"

    def __init__(self, cfg, n_experts: int):
        super().__init__(cfg, n_experts)
        R = mlp_hidden(cfg)
        self.hidden = nn.Linear(cfg.d_model, R)  # [R, D], bias [R]
        self.out = nn.Linear(R, n_experts, bias=False)  # [E, R]

    @classmethod
    def tensors(cls, cfg, n_experts: int) -> list[RouterTensor]:
        R, D = mlp_hidden(cfg), cfg.d_model
        return [RouterTensor("hidden.weight", (R, D), "normal"), RouterTensor("hidden.bias", (R,), "zeros"),
                RouterTensor("out.weight", (n_experts, R), "logits")]

    def forward(self, x: Tensor) -> Tensor:  # [N, D] -> [N, R] -> [N, E]
        return self.out(F.gelu(self.hidden(x)))


def attention_dim(cfg) -> int:
    return cfg.router_hidden or cfg.head_dim


class AttentionRouter(Router):
    """One attention head from tokens to experts: a token's query scored against E keys made from learnable
    expert embeddings in model space."""

    kind = "attention"

    def __init__(self, cfg, n_experts: int):
        super().__init__(cfg, n_experts)
        R, D = attention_dim(cfg), cfg.d_model
        self.query = nn.Linear(D, R, bias=False)  # [R, D]
        self.key = nn.Linear(D, R, bias=False)  # [R, D]
        self.embeddings = nn.Embedding(n_experts, D)  # [E, D]

    @classmethod
    def tensors(cls, cfg, n_experts: int) -> list[RouterTensor]:
        R, D = attention_dim(cfg), cfg.d_model
        return [RouterTensor("query.weight", (R, D), "normal"), RouterTensor("key.weight", (R, D), "logits"),
                RouterTensor("embeddings.weight", (n_experts, D), "unit")]

    def forward(self, x: Tensor) -> Tensor:  # [N, D] -> [N, E]
        q = self.query(x)  # [N, R]
        k = self.key(self.embeddings.weight)  # [E, R]
        return (q @ k.t()) * (1.0 / math.sqrt(k.shape[-1]))


class ExpertEmbeddingRouter(Router):
    """"Cue cards": E learnable expert embeddings m_e in model space; logits are cosine similarities over a
    learnable temperature, stored as its logarithm (always positive, and a scale-free step size)."""

    kind = "expert_embedding"

    def __init__(self, cfg, n_experts: int):
        super().__init__(cfg, n_experts)
        self.embeddings = nn.Embedding(n_experts, cfg.d_model)  # [E, D]
        self.log_temperature = nn.Parameter(torch.full((1,), math.log(cfg.router_temperature)))  # [1]

    @classmethod
    def tensors(cls, cfg, n_experts: int) -> list[RouterTensor]:
        # state_dict order: a module's own parameters before its submodules'
        return [RouterTensor("log_temperature", (1,), "log_temperature"),
                RouterTensor("embeddings.weight", (n_experts, cfg.d_model), "unit")]

    def forward(self, x: Tensor) -> Tensor:  # [N, D] -> [N, E]
        cos = F.normalize(x, dim=-1) @ F.normalize(self.embeddings.weight, dim=-1).t()
        return cos * torch.exp(-self.log_temperature)


class KeyStoreRouter(Router):
    """The self-organizing key store (SoME): a trained query network into a store of E expert keys that no
    gradient reaches; the keys move by rules once per optimizer step (runtime/key_store.py, docs/routers.md).

        q        = W_out gelu(W_in x + b_in) + b_out      query network D -> 2D -> D (trained)
        logits_e = cos(q, k_e) / T                        k_e: unit rows of `keys`; T = router_temperature (fixed)

    Cosine, not a dot product: the rules move keys by averages (toward queries, toward each other), which are
    shorter than their parts; with unit keys (renormalized after every move) and unit queries the logits stay in
    [-1/T, 1/T] and T keeps one meaning all run.
    Buffers: keys [E, D], usage [E] (the EMA of each expert's share of the assignments; only the rules read it).

    `collector` (set by the runtime's Model, runtime/key_store.py): while training, each forward hands it the
    step's logits and unit queries, and after_step applies the rules. Without one (an HF export) the router
    only routes."""

    kind = "key_store"
    routes_attention = False  # its statistics and rules read the FFN top-k

    def __init__(self, cfg, n_experts: int):
        super().__init__(cfg, n_experts)
        D = cfg.d_model
        self.temperature = cfg.router_temperature
        self.query_in = nn.Linear(D, 2 * D)  # [2D, D], bias [2D]
        self.query_out = nn.Linear(2 * D, D)  # [D, 2D], bias [D]
        self.register_buffer("keys", F.normalize(torch.randn(n_experts, D), dim=-1))  # [E, D]
        self.register_buffer("usage", torch.full((n_experts,), 1.0 / n_experts))  # [E]
        self.collector = None

    @classmethod
    def tensors(cls, cfg, n_experts: int) -> list[RouterTensor]:
        D = cfg.d_model
        # state_dict order: the module's own buffers before its submodules' parameters
        return [RouterTensor("keys", (n_experts, D), "unit_rows", buffer=True),
                RouterTensor("usage", (n_experts,), "fair_share", buffer=True),
                RouterTensor("query_in.weight", (2 * D, D), "normal"), RouterTensor("query_in.bias", (2 * D,), "zeros"),
                RouterTensor("query_out.weight", (D, 2 * D), "normal"), RouterTensor("query_out.bias", (D,), "zeros")]

    def forward(self, x: Tensor) -> Tensor:  # [N, D] -> [N, E]
        q = F.normalize(self.query_out(F.gelu(self.query_in(x))), dim=-1)  # [N, D], unit
        keys = F.normalize(self.keys.to(q.dtype), dim=-1)  # unit already; normalized again for edited stores
        logits = (q @ keys.t()) * (1.0 / self.temperature)
        if self.training and self.collector is not None:
            self.collector.add(logits.detach(), q.detach())
        return logits

    def after_step(self) -> None:
        if self.collector is not None:
            self.collector.apply(self)


ROUTER_KINDS: dict[str, type[Router]] = {cls.kind: cls for cls in
                                         (LinearRouter, MLPRouter, AttentionRouter, ExpertEmbeddingRouter,
                                          KeyStoreRouter)}


def router_class(kind: str) -> type[Router]:
    if kind not in ROUTER_KINDS:
        raise ValueError(f"unknown router kind {kind!r}; choose one of {', '.join(ROUTER_KINDS)}")
    return ROUTER_KINDS[kind]


def make_router(kind: str, cfg, n_experts: int) -> Router:
    return router_class(kind)(cfg, n_experts)
