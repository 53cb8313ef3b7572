"""Canonical tensor names and shapes for a config: the contract between runtime, converters and surgery.

Every checkpoint this project writes uses exactly these names; `Model.state_dict()` has exactly
these keys (tests check it). Expert tensors are stacked with a leading expert dimension E.

    embed.weight                              [V, D]
    pos_embed.weight                          [P, D]        position == "learned"
    layers.{i}.attn_norm.weight / .bias       [D]           bias iff norm_bias
    layers.{i}.ffn_norm.weight / .bias        [D]           block != "parallel"; both absent iff norm_position post
    layers.{i}.attn_post_norm.weight / .bias  [D]           norm_position post (OLMo 2) or sandwich (Gemma): the attention's
    layers.{i}.ffn_post_norm.weight / .bias   [D]           and the FFN's output normed before the residual add
    dense attention (attn_experts == 0):
    layers.{i}.attn.q.weight                  [H*Dh, D]     .bias [H*Dh] iff qkv_bias
    layers.{i}.attn.k.weight / attn.v.weight  [G*Dh, D]     .bias iff qkv_bias
    layers.{i}.attn.o.weight                  [D, H*Dh]     .bias [D] iff o_bias
    layers.{i}.attn.q_norm.weight             [Dh] or [H*Dh]  qk_norm head / full (norm_bias: .bias)
    layers.{i}.attn.k_norm.weight             [Dh] or [G*Dh]  qk_norm head / full
    attention experts (attn_experts == E > 0):
    layers.{i}.attn_router.*                  the router's tensors (runtime/routers.py; linear: weight [E, D])
    layers.{i}.attn_experts.q.weight          [E, H*Dh, D]  (and o: [E, D, H*Dh]; biases [E, *])
    layers.{i}.attn_experts.k.weight / .v     [E, G*Dh, D]  kv_mode == "expert"
    layers.{i}.attn.k.weight / attn.v.weight  [G*Dh, D]     kv_mode == "shared" (one K, V)
    layers.{i}.attn_experts.q_norm.weight     [E, Dh or H*Dh]  each expert's own QK-norm; k_norm [E, ...] with
                                                            expert KV, attn.k_norm (shared like K) with shared KV
    dense FFN (ffn_experts == 0):
    layers.{i}.ffn.gate.weight                [F, D]        swiglu only
    layers.{i}.ffn.up.weight                  [F, D]        .bias [F] iff ffn_bias
    layers.{i}.ffn.down.weight                [D, F]        .bias [D] iff ffn_bias
    FFN experts (ffn_experts == E > 0):
    layers.{i}.ffn_router.*                   the router's tensors (runtime/routers.py; linear: weight [E, D])
    layers.{i}.ffn_experts.{gate,up,down}.weight   [E, F, D] / [E, D, F]; biases [E, *]
    shared FFN expert (ffn_shared_hidden == Fs > 0, beside the FFN experts):
    layers.{i}.ffn_shared.{gate,up,down}.weight    [Fs, D] / [Fs, D] / [D, Fs]; biases iff ffn_bias
    layers.{i}.ffn_shared_gate.weight         [1, D]        its output scaled by sigmoid(x . w)
    Gated DeltaNet layers (linear_layers) have, instead of attention (linear_shapes; [E, ...] as linear_experts.*
    with linear_experts, routed by layers.{i}.attn_router):
    layers.{i}.linear.qkv.weight              [2*Hk*Dk + Hv*Dv, D]   .conv.weight [2*Hk*Dk + Hv*Dv, K]
    layers.{i}.linear.{z,b,a}.weight          [Hv*Dv, D], [Hv, D], [Hv, D];  .dt.bias, .a_log.weight [Hv]
    layers.{i}.linear.norm.weight             [Dv];  .out.weight [D, Hv*Dv]
    attn.gate.weight (attn_experts.gate)      [H*Dh, D]     attn_output_gate: the output times sigmoid(x W_gate)
    global layers (Gemma 4) use global_head_dim / global_kv_heads for Dh / G; no attn.v where global_k_eq_v; no
    attn.k / attn.v / k_norm in the last kv_shared_layers layers (they read another layer's K/V)
    ple_embed.weight [V', L*Dp], ple_proj.weight [L*Dp, D], ple_proj_norm.weight [Dp]   per_layer_dim Dp > 0
    layers.{i}.ple.gate.weight [Dp, D], .ple.out.weight [D, Dp], layers.{i}.ple_norm.weight [D]
    layers.{i}.layer_scale.weight             [1]           layer_scale
    final_norm.weight / .bias                 [D]           iff final_norm
    lm_head.weight                            [V, D]        absent iff tie_embeddings
    lm_head.bias                              [V]           iff lm_head_bias
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable, Literal, get_args

from .config import ModelConfig
from .errors import printable
from .routers import RouterTensor, router_class

Shape = tuple[int, ...]


def _linear(out: dict[str, Shape], prefix: str, n_out: int, n_in: int, bias: bool, experts: int = 0) -> None:
    lead: Shape = (experts,) if experts else ()
    out[f"{prefix}.weight"] = lead + (n_out, n_in)
    if bias:
        out[f"{prefix}.bias"] = lead + (n_out,)


def _norm(out: dict[str, Shape], prefix: str, cfg: ModelConfig, width: int | None = None, experts: int = 0) -> None:
    lead: Shape = (experts,) if experts else ()
    out[f"{prefix}.weight"] = lead + (width or cfg.d_model,)
    if cfg.norm_bias:
        out[f"{prefix}.bias"] = lead + (width or cfg.d_model,)


def qk_norm_widths(cfg: ModelConfig) -> tuple[int, int]:
    """The widths of the query and key norms: one head (Qwen3) or every head at once (OLMo 2)."""
    if cfg.qk_norm == "head":
        return cfg.head_dim, cfg.head_dim
    return cfg.q_dim, cfg.kv_dim


def router_tensors(cfg: ModelConfig) -> dict[str, RouterTensor]:
    """Every router tensor of a model by canonical name (layers.{i}.{ffn,attn}_router.{tensor}), in file order."""
    out: dict[str, RouterTensor] = {}
    for i in range(cfg.n_layers):
        for group, kind, E in (("attn", cfg.attn_router_kind, cfg.layer_attn_experts(i)),
                               ("ffn", cfg.ffn_router_kind, cfg.ffn_experts)):
            if E:
                out.update((f"layers.{i}.{group}_router.{t.name}", t) for t in router_class(kind).tensors(cfg, E))
    return out


def _router(out: dict[str, Shape], prefix: str, kind: str, cfg: ModelConfig, n_experts: int) -> None:
    for t in router_class(kind).tensors(cfg, n_experts):
        out[f"{prefix}.{t.name}"] = t.shape


def buffer_names(cfg: ModelConfig) -> set[str]:
    """Canonical tensors that are buffers (not trained by gradient), e.g. a key store's keys."""
    return {name for name, t in router_tensors(cfg).items() if t.buffer}


def linear_shapes(cfg: ModelConfig, experts: int = 0) -> dict[str, Shape]:
    """A Gated DeltaNet's tensors by name under layers.{i}.linear (or linear_experts, [E, ...] each): the fused
    q/k/v projection and its depthwise convolution, the output gate z, the write strength b (beta = sigmoid(x b)),
    the decay input a with its bias dt and per-head rate a_log (g = -exp(a_log) softplus(x a + dt)), the gated
    RMSNorm of each value head and the output projection."""
    D = cfg.d_model
    Hk, Hv, Dk, Dv = cfg.linear_key_heads, cfg.linear_value_heads, cfg.linear_key_dim, cfg.linear_value_dim
    C = 2 * Hk * Dk + Hv * Dv
    lead: Shape = (experts,) if experts else ()
    return {"qkv.weight": lead + (C, D), "conv.weight": lead + (C, cfg.linear_conv), "z.weight": lead + (Hv * Dv, D),
            "b.weight": lead + (Hv, D), "a.weight": lead + (Hv, D), "dt.bias": lead + (Hv,),
            "a_log.weight": lead + (Hv,), "norm.weight": lead + (Dv,), "out.weight": lead + (D, Hv * Dv)}


def _attention_shapes(out: dict[str, Shape], cfg: ModelConfig, i: int) -> None:
    """Layer i's softmax attention: its own head size and kv heads (global layers may differ), no K/V of its own
    where it reads another layer's (kv_source), no V where its values are its keys' projection, an output gate
    beside q (attn_output_gate)."""
    D, Dh, G, H = cfg.d_model, cfg.layer_head_dim(i), cfg.layer_kv_heads(i), cfg.n_heads
    p, E = f"layers.{i}", cfg.attn_experts
    owns_kv, has_v = cfg.kv_source(i) == i, not cfg.layer_k_eq_v(i)
    q_dim, kv_dim = H * Dh, G * Dh
    qn, kn = (Dh, Dh) if cfg.qk_norm == "head" else (q_dim, kv_dim)
    qk = cfg.qk_norm != "none"

    def q(prefix: str, experts: int = 0) -> None:
        _linear(out, f"{prefix}.q", q_dim, D, cfg.qkv_bias, experts)
        if cfg.attn_output_gate:
            _linear(out, f"{prefix}.gate", q_dim, D, cfg.qkv_bias, experts)

    def kv(prefix: str, experts: int = 0) -> None:
        if owns_kv:
            _linear(out, f"{prefix}.k", kv_dim, D, cfg.qkv_bias, experts)
            if has_v:
                _linear(out, f"{prefix}.v", kv_dim, D, cfg.qkv_bias, experts)

    if E:
        _router(out, f"{p}.attn_router", cfg.attn_router_kind, cfg, E)
        if cfg.kv_mode == "expert":
            q(f"{p}.attn_experts", E)
            kv(f"{p}.attn_experts", E)
            if qk:
                _norm(out, f"{p}.attn_experts.q_norm", cfg, qn, E)
                if owns_kv:
                    _norm(out, f"{p}.attn_experts.k_norm", cfg, kn, E)
        else:  # shared KV: one K and V for all experts
            kv(f"{p}.attn")
            q(f"{p}.attn_experts", E)
            if qk:
                if owns_kv:
                    _norm(out, f"{p}.attn.k_norm", cfg, kn)
                _norm(out, f"{p}.attn_experts.q_norm", cfg, qn, E)
        _linear(out, f"{p}.attn_experts.o", D, q_dim, cfg.o_bias, E)
    else:
        q(f"{p}.attn")
        kv(f"{p}.attn")
        _linear(out, f"{p}.attn.o", D, q_dim, cfg.o_bias)
        if qk:
            _norm(out, f"{p}.attn.q_norm", cfg, qn)
            if owns_kv:
                _norm(out, f"{p}.attn.k_norm", cfg, kn)


def layer_shapes(cfg: ModelConfig, i: int) -> dict[str, Shape]:
    D, F = cfg.d_model, cfg.layer_ffn_hidden(i)
    out: dict[str, Shape] = {}
    p = f"layers.{i}"
    if cfg.norm_position != "post":  # pre and sandwich
        _norm(out, f"{p}.attn_norm", cfg)
        if cfg.has_ffn_norm:
            _norm(out, f"{p}.ffn_norm", cfg)
    if cfg.is_linear_layer(i):
        E = cfg.linear_experts
        if E:
            _router(out, f"{p}.attn_router", cfg.attn_router_kind, cfg, E)
        group = f"{p}.linear_experts" if E else f"{p}.linear"
        out.update((f"{group}.{name}", shape) for name, shape in linear_shapes(cfg, E).items())
    else:
        _attention_shapes(out, cfg, i)
    if cfg.norm_position != "pre":  # post and sandwich
        _norm(out, f"{p}.attn_post_norm", cfg)
    E = cfg.ffn_experts
    fp = f"{p}.ffn_experts" if E else f"{p}.ffn"
    if E:
        _router(out, f"{p}.ffn_router", cfg.ffn_router_kind, cfg, E)
    if cfg.gated_ffn:
        _linear(out, f"{fp}.gate", F, D, cfg.ffn_bias, E)
    _linear(out, f"{fp}.up", F, D, cfg.ffn_bias, E)
    _linear(out, f"{fp}.down", D, F, cfg.ffn_bias, E)
    if cfg.ffn_shared_hidden:
        Fs = cfg.layer_shared_hidden(i)
        if cfg.gated_ffn:
            _linear(out, f"{p}.ffn_shared.gate", Fs, D, cfg.ffn_bias)
        _linear(out, f"{p}.ffn_shared.up", Fs, D, cfg.ffn_bias)
        _linear(out, f"{p}.ffn_shared.down", D, Fs, cfg.ffn_bias)
        _linear(out, f"{p}.ffn_shared_gate", 1, D, False)
    if cfg.norm_position != "pre":
        _norm(out, f"{p}.ffn_post_norm", cfg)
    if cfg.per_layer_dim:  # Gemma 4: gate [Dp, D], output projection [D, Dp], the norm of its output
        _linear(out, f"{p}.ple.gate", cfg.per_layer_dim, D, False)
        _linear(out, f"{p}.ple.out", D, cfg.per_layer_dim, False)
        _norm(out, f"{p}.ple_norm", cfg)
    if cfg.layer_scale:
        out[f"{p}.layer_scale.weight"] = (1,)
    return out


def tensor_shapes(cfg: ModelConfig) -> dict[str, Shape]:
    """All canonical tensors of a model, in file order."""
    out: dict[str, Shape] = {"embed.weight": (cfg.vocab_size, cfg.d_model)}
    if cfg.per_layer_dim:  # Gemma 4's per-layer inputs: every layer's vectors in one row per token, packed
        L, Dp = cfg.n_layers, cfg.per_layer_dim
        out["ple_embed.weight"] = (cfg.per_layer_vocab or cfg.vocab_size, L * Dp)
        out["ple_proj.weight"] = (L * Dp, cfg.d_model)
        _norm(out, "ple_proj_norm", cfg, Dp)
    if cfg.position == "learned":
        out["pos_embed.weight"] = (cfg.max_positions, cfg.d_model)
    for i in range(cfg.n_layers):
        out.update(layer_shapes(cfg, i))
    if cfg.final_norm:
        _norm(out, "final_norm", cfg)
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, cfg.d_model)
    if cfg.lm_head_bias:
        out["lm_head.bias"] = (cfg.vocab_size,)
    return out


# ---- groups, for audits --------------------------------------------------------------------
GROUPS = ("embeddings", "attention", "attention_experts", "ffn", "ffn_experts", "routers", "norms")

_GROUP_RULES = [
    (re.compile(r"^(embed|pos_embed|lm_head|ple_embed|ple_proj|ple_proj_norm)\.|\.ple\."), "embeddings"),
    (re.compile(r"(^|\.)(attn_norm|ffn_norm|final_norm|attn_post_norm|ffn_post_norm|q_norm|k_norm|ple_norm|"
                r"layer_scale)\."), "norms"),
    (re.compile(r"\.(attn_router|ffn_router|ffn_shared_gate)\."), "routers"),
    (re.compile(r"\.(attn_experts|linear_experts)\."), "attention_experts"),
    (re.compile(r"\.(attn|linear)\."), "attention"),
    (re.compile(r"\.ffn_experts\."), "ffn_experts"),
    (re.compile(r"\.(ffn|ffn_shared)\."), "ffn"),  # the shared expert runs on every token: dense FFN
]


def tensor_group(name: str) -> str:
    for rx, group in _GROUP_RULES:
        if rx.search(name):
            return group
    raise KeyError(f"{name}: not a canonical tensor name")


# ---- layout check: a checkpoint's names and shapes against its config ----------------------
MismatchKind = Literal["missing", "unexpected", "shape", "missing_layers"]
MISMATCH_KINDS = get_args(MismatchKind)


@dataclass(frozen=True)
class Mismatch:
    """A checkpoint tensor that disagrees with the layout its own config implies; or (kind
    missing_layers) whole layers the config declares and the checkpoint has no tensor of."""

    name: str
    kind: MismatchKind
    expected: Shape | None
    found: Shape | None
    detail: str = ""  # missing_layers: the sentence saying which layers

    def message(self) -> str:
        name = printable(self.name)  # read from a file: escaped, so it cannot forge an output line
        if self.kind == "missing_layers":
            return self.detail
        if self.kind == "missing":
            return f"tensor {name} is missing (config expects shape {list(self.expected)})"
        if self.kind == "unexpected":
            return f"tensor {name} {list(self.found)} is not part of the config's layout"
        return f"tensor {name} has shape {list(self.found)}, config expects {list(self.expected)}"

    def to_dict(self) -> dict[str, Any]:
        return dict(name=self.name, kind=self.kind, message=self.message(),
                    expected=list(self.expected) if self.expected is not None else None,
                    found=list(self.found) if self.found is not None else None)


_LAYER = re.compile(r"^layers\.(\d+)\.")


def ranges(xs: Iterable[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    xs = sorted(xs)
    if not xs:
        return ""
    out, start = [], xs[0]
    for a, b in zip(xs, xs[1:] + [None]):
        if b != a + 1:
            out.append(str(start) if start == a else f"{start}-{a}")
            start = b
    return ",".join(out)


def layout_mismatches(expected: dict[str, Shape], found: Iterable[tuple[str, Shape]]) -> list[Mismatch]:
    """Every difference between the expected layout and (name, shape) pairs found: unexpected and
    wrongly shaped tensors in the order found, then the missing ones in layout order. Layers the
    layout has and the checkpoint holds no tensor of are one `missing_layers` entry (a config
    claiming 4096 layers over a file of 2 gives one line, not 60,000)."""
    out: list[Mismatch] = []
    seen = set()
    for name, shape in found:
        seen.add(name)
        if name not in expected:
            out.append(Mismatch(name, "unexpected", None, tuple(shape)))
        elif tuple(expected[name]) != tuple(shape):
            out.append(Mismatch(name, "shape", tuple(expected[name]), tuple(shape)))
    missing = [n for n in expected if n not in seen]
    layer_of = {n: int(m.group(1)) for n in expected if (m := _LAYER.match(n))}
    held = {layer_of[n] for n in seen if n in layer_of}
    gone = sorted({i for i in layer_of.values()} - held)
    if gone:
        n_layers = max(layer_of.values()) + 1
        detail = (f"layers {ranges(gone)} are missing: the config declares {n_layers} layers, the checkpoint "
                  f"holds tensors of {len(held)} ({ranges(held) or 'none'})")
        entry = Mismatch(f"layers.{ranges(gone)}", "missing_layers", None, None, detail)
        gone_set, placed = set(gone), False
        for n in missing:
            if layer_of.get(n) in gone_set:
                if not placed:
                    out.append(entry)
                    placed = True
                continue
            out.append(Mismatch(n, "missing", tuple(expected[n]), None))
        return out
    out.extend(Mismatch(n, "missing", tuple(expected[n]), None) for n in missing)
    return out
