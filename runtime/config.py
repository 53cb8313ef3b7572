"""One typed, JSON-serializable config for dense and mixture models.

A dense model is a config with ``ffn_experts == 0`` and ``attn_experts == 0``.
A mixture turns on FFN experts (MoE, top-k routed), attention experts
(Mixture-of-Attention, soft or top-k routed), or both.

Naming of sizes (shapes in comments use these letters):
    V vocab_size, D d_model, L n_layers, H n_heads, G n_kv_heads, Dh head_dim,
    F ffn_hidden (per-branch width: for SwiGLU the gate and the up projection are each [F, D]),
    E number of experts.

Note on the paper's Table 4: its "FFN dimension" is the fused gate+up width, i.e. 2F.
The 590M preset has "FFN dimension 4096", so ffn_hidden = 2048 (Table 5 confirms:
ffn_exp/Block = 1024*4096, ffn_red/Block = 2048*1024).
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import math
import types
from dataclasses import dataclass
from typing import Any, Callable, Literal, Union, get_args, get_origin, get_type_hints

from .config_rules import ConfigRules
from .errors import UserError
from .jsonfile import parse_json

# Fields with a fixed set of values; the tuples are the same sets, for messages and checks.
Activation = Literal["swiglu", "gelu", "gelu_tanh", "relu", "silu", "geglu_tanh"]  # geglu_tanh: gated (Gemma)
GATED_ACTIVATIONS = ("swiglu", "geglu_tanh")  # act(gate x) * up x
Norm = Literal["layernorm", "rmsnorm"]
Position = Literal["rope", "learned", "none"]
Block = Literal["sequential", "parallel", "parallel_two_norms"]
# pre: norm, sublayer, add (Llama); post: sublayer, norm, add (OLMo 2); sandwich: norm, sublayer, norm, add (Gemma)
NormPosition = Literal["pre", "post", "sandwich"]
QKNorm = Literal["none", "head", "full"]  # RMS/layer norm of queries and keys: per head (Qwen3) or full width (OLMo 2)
# scaled RoPE, as transformers computes it (scaled_rope holds its rope_parameters; docs/runtime.md)
# proportional (Gemma 4's global layers): the first partial_rotary_factor of each head's half-split pairs rotate at
# theta^(-2i/head_dim), the others not at all
RopeType = Literal["linear", "dynamic", "yarn", "longrope", "llama3", "proportional"]
GateNorm = Literal["softmax", "topk_softmax"]
KVMode = Literal["expert", "shared"]
# The router kinds: runtime/routers.py defines each (a new kind is a class there and its name here;
# tests/runtime/test_routers.py holds the two lists together).
Router = Literal["linear", "mlp", "attention", "expert_embedding", "key_store"]
ACTIVATIONS, NORMS, POSITIONS, BLOCKS = get_args(Activation), get_args(Norm), get_args(Position), get_args(Block)
NORM_POSITIONS, QK_NORMS, ROPE_TYPES = get_args(NormPosition), get_args(QKNorm), get_args(RopeType)
GATE_NORMS, KV_MODES, ROUTERS = get_args(GateNorm), get_args(KVMode), get_args(Router)


def later(default: Any, *, never: tuple[Any, ...] = ()) -> Any:
    """A field added after checkpoints existed: to_dict writes it only when it differs from its default, so every
    config that does not use it serializes to the same bytes as before it was added (declare every new field so).
    `never`: values of its type the field never takes (validate refuses them; the HF BAM schema leaves them out)."""
    return dataclasses.field(default=default, metadata={"written_when_set": True, "never": tuple(never)})


class ConfigError(UserError, ValueError):
    """A config field is missing, unknown or inconsistent; the message names the field."""


# Sanity limits, far above any real model and low enough that a corrupt or hostile config
# (n_layers 3,000,000, 10^8 experts) is refused before a layout or a plan of millions of entries
# is built: the canonical layout has ~16 tensors per layer, a merge plan one source per expert slot.
MAX_LAYERS = 4096
MAX_EXPERTS = 1024
MAX_DIM = 2**31 - 1  # vocab, widths, heads, positions: one tensor dimension


def _type_check(hint: Any) -> tuple[Callable[[Any], bool], str]:
    """(does a JSON value fit the annotation, how to name the annotation). A Literal only needs a
    string here: validate() names the allowed values."""
    if get_origin(hint) is Literal:
        return (lambda v: isinstance(v, str)), "str"
    if get_origin(hint) is list:
        (item,) = get_args(hint)
        check_item, item_name = _type_check(item)
        return (lambda v: isinstance(v, list) and all(check_item(x) for x in v)), f"list of {item_name}"
    if get_origin(hint) in (Union, types.UnionType):
        parts = [_type_check(a) for a in get_args(hint)]
        return (lambda v: any(check(v) for check, _ in parts)), " | ".join(name for _, name in parts)
    checks = {
        int: lambda v: isinstance(v, int) and not isinstance(v, bool),
        float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        bool: lambda v: isinstance(v, bool),
        str: lambda v: isinstance(v, str),
        dict: lambda v: isinstance(v, dict),
        type(None): lambda v: v is None,
    }
    return checks[hint], "None" if hint is type(None) else hint.__name__


def _need(cond: bool, fld: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{fld}: {msg}")


@dataclass
class ModelConfig(ConfigRules):
    # ---- dense architecture -------------------------------------------------------------
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    ffn_hidden: int
    n_kv_heads: int | None = None  # None -> n_heads (MHA); < n_heads -> GQA; 1 -> MQA
    head_dim: int | None = None  # None -> d_model // n_heads
    activation: Activation = "swiglu"
    norm: Norm = "rmsnorm"
    norm_bias: bool = False  # layernorm only: learnable bias
    norm_eps: float = 1e-5
    qkv_bias: bool = False
    o_bias: bool = False
    ffn_bias: bool = False
    lm_head_bias: bool = False
    position: Position = "rope"  # learned: an absolute position table
    rope_theta: float = 10000.0
    rotary_fraction: float = 1.0  # fraction of head_dim that is rotated (NeoX/Phi partial rotary)
    rope_interleaved: bool = False  # False: rotate halves (Llama/NeoX); True: rotate pairs (GPT-J/Cohere)
    max_positions: int = 2048
    block: Block = "sequential"  # parallel: one shared norm; parallel_two_norms: NeoX
    tie_embeddings: bool = False
    logit_scale: float = 1.0  # multiplies the logits (Cohere)
    final_norm: bool = later(True)  # False: the last block's output goes to the head without a norm
    # scaled RoPE: transformers' rope_parameters less rope_theta and partial_rotary_factor ({"rope_type": "llama3",
    # "factor": 32.0, ...}; ROPE_KEYS lists each type's keys); None: plain RoPE
    scaled_rope: dict | None = later(None)
    nope_layers: list[int] | None = later(None)  # layers that apply no RoPE (SmolLM3's every fourth layer); None: none
    qk_norm: QKNorm = later("none")  # a norm on queries and keys before RoPE: per head [Dh] or over the full width [H*Dh]
    norm_position: NormPosition = later("pre")  # post: each sublayer's output is normed before the residual add
    norm_unit_offset: bool = later(False)  # RMSNorm scales by (1 + weight) (Gemma), not by weight
    scale_embeddings: bool = later(False)  # the input embeddings times sqrt(d_model) (Gemma)
    # sliding-window attention: a query sees the last attn_window keys (itself included) in the layers
    # attn_window_layers (None: every layer); None: every layer attends to the whole causal prefix. (Not named
    # sliding_window: transformers' caches read that attribute of a config and would keep only a window of keys.)
    attn_window: int | None = later(None)
    attn_window_layers: list[int] | None = later(None)
    window_rope_theta: float | None = later(None)  # plain RoPE of this base in the sliding layers (Gemma 3's local base)
    attn_scale_dim: int | None = later(None)  # attention logits scaled by 1/sqrt(this) (Gemma's query_pre_attn_scalar)
    attn_softcap: float | None = later(None)  # attention logits soft-capped: c * tanh(s / c) (Gemma 2)
    final_softcap: float | None = later(None)  # output logits soft-capped likewise (Gemma 2)
    # the residual stream's multipliers (Granite): the input embeddings times embedding_multiplier, each sublayer's
    # output times residual_multiplier before it is added; attn_scale: the attention logits' scale itself (None:
    # 1/sqrt(attn_scale_dim or head_dim))
    embedding_multiplier: float = later(1.0)
    residual_multiplier: float = later(1.0)
    attn_scale: float | None = later(None)
    # queries scaled by position (Llama 4's attention temperature, Ministral 3): times
    # 1 + attn_temperature * ln(1 + floor(position / attn_temperature_length)); None: unscaled
    attn_temperature: float | None = later(None)
    attn_temperature_length: int | None = later(None)
    # ---- hybrid layers (Qwen3.5, Gemma 4; docs/runtime.md) ---------------------------------
    # Gated DeltaNet token mixers in place of softmax attention in the layers linear_layers (Qwen3.5's linear
    # attention): q and k of linear_key_heads heads of linear_key_dim, v of linear_value_heads heads of
    # linear_value_dim, a causal depthwise convolution of width linear_conv over them, a recurrent state per head
    linear_layers: list[int] | None = later(None)
    linear_key_heads: int = later(0)
    linear_value_heads: int = later(0)
    linear_key_dim: int = later(0)
    linear_value_dim: int = later(0)
    linear_conv: int = later(0)
    attn_output_gate: bool = later(False)  # the attention's output times sigmoid(x . W_gate), elementwise (Qwen3.5)
    # the global (non-window) layers' own geometry (Gemma 4): head size and kv heads (None: head_dim, n_kv_heads),
    # and values that are their keys' projection (no attn.v of their own)
    global_head_dim: int | None = later(None)
    global_kv_heads: int | None = later(None)
    global_k_eq_v: bool = later(False)
    v_norm: bool = later(False)  # values RMS-normed per head, without a scale (Gemma 4)
    # the last kv_shared_layers layers attend over the keys and values of the last earlier layer of their kind
    # (window or global) and have no K/V of their own; their FFN is kv_shared_ffn_hidden wide (None: ffn_hidden)
    kv_shared_layers: int = later(0)
    kv_shared_ffn_hidden: int | None = later(None)
    # per-layer input embeddings (Gemma 4's PLE): a [per_layer_vocab, n_layers * per_layer_dim] table plus a
    # projection of the input embeddings feed each block a per_layer_dim vector; 0: none
    per_layer_dim: int = later(0)
    per_layer_vocab: int | None = later(None)  # None: vocab_size
    layer_scale: bool = later(False)  # each block's output times a learned scalar (Gemma 4's layer_scalar)
    # ---- mixture ------------------------------------------------------------------------
    ffn_experts: int = 0  # 0 = dense FFN
    ffn_top_k: int = 1
    gate_norm: GateNorm = "softmax"  # softmax: p_i from the full softmax (paper); topk_softmax: renormalized over top-k (Mixtral/BTX)
    # an always-on shared FFN expert of this width beside the routed ones (Qwen2-MoE, DeepSeek-MoE), its output
    # scaled by sigmoid(x . w) with w = ffn_shared_gate.weight [1, D]; 0: none. Needs ffn_experts > 0.
    ffn_shared_hidden: int = later(0)
    attn_experts: int = 0  # 0 = dense attention (BTX)
    attn_top_k: int | None = None  # None = soft routing (every token to every attention expert)
    kv_mode: KVMode = "expert"  # expert: Q,K,V,O per expert; shared: Q,O per expert, one K,V
    # Gated DeltaNet experts in each linear layer (each its own projections, convolution and recurrent state),
    # mixed by the layer's attention router as attention experts are; 0: one DeltaNet per linear layer
    linear_experts: int = later(0)
    router: Router = "linear"  # kind of the FFN routers, and of the attention routers unless attn_router says
    attn_router: Router | None = later(None, never=("key_store",))  # kind of the attention routers; None: the same as router
    router_hidden: int | None = later(None)  # mlp: hidden width (None: 2*d_model); attention: query/key width (None: head_dim)
    # expert_embedding: initial temperature tau (the learned one is a tensor); key_store: the fixed temperature
    # of its cosine logits
    router_temperature: float = later(0.1)
    # key_store update rules, once per optimizer step (docs/routers.md, "key store"): attraction, peer pull,
    # dispersion, the share of experts that may be re-seeded per step, the usage EMA's decay
    key_store_alpha: float = later(0.01)
    key_store_beta: float = later(0.005)
    key_store_delta: float = later(0.001)
    key_store_theta_percentile: float = later(0.05)
    key_store_ema_decay: float = later(0.99)
    lb_coef: float = 0.01  # alpha, load-balancing loss weight
    z_coef: float = 0.001  # beta, router z-loss weight
    name: str = ""  # free-form label (preset name, source architecture)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # JSON configs can carry "32" or null where 32 belongs
            v = getattr(self, f.name)
            check, expected = _field_types(type(self))[f.name]
            if not check(v):
                raise ConfigError(f"{f.name}: expected {expected}, got {v!r}")
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.n_heads <= 0:
            raise ConfigError(f"n_heads: must be a positive integer, got {self.n_heads!r}")
        if self.head_dim is None:
            if self.d_model % self.n_heads:
                raise ConfigError(
                    f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; "
                    "set head_dim explicitly or change n_heads"
                )
            self.head_dim = self.d_model // self.n_heads
        self.validate()

    # -- invariants ------------------------------------------------------------------------
    def validate(self) -> None:
        """Every field's value and their agreement; ConfigError naming the field."""
        self._validate_trunk()
        self._validate_positions()
        self._validate_hybrid()
        self._validate_mixture()

    def _validate_trunk(self) -> None:
        """Sizes, norms, positions and the block style."""
        for fld in ("vocab_size", "d_model", "n_layers", "n_heads", "ffn_hidden", "n_kv_heads",
                    "head_dim", "max_positions"):
            v = getattr(self, fld)
            _need(isinstance(v, int) and not isinstance(v, bool) and v > 0, fld,
                  f"must be a positive integer, got {v!r}")
            _need(v <= MAX_DIM, fld, f"{v} is past the limit of {MAX_DIM} (a corrupt config?)")
        _need(self.n_layers <= MAX_LAYERS, "n_layers",
              f"{self.n_layers} layers is past the limit of {MAX_LAYERS} (a corrupt config?)")
        for fld in ("ffn_experts", "attn_experts", "linear_experts"):
            _need(getattr(self, fld) <= MAX_EXPERTS, fld,
                  f"{getattr(self, fld)} experts is past the limit of {MAX_EXPERTS} (a corrupt config?)")
        for fld in ("norm_eps", "rope_theta", "rotary_fraction", "logit_scale", "lb_coef", "z_coef"):
            _need(math.isfinite(getattr(self, fld)), fld, f"must be a finite number, got {getattr(self, fld)!r}")
        _need(self.rope_theta > 0, "rope_theta", f"must be > 0, got {self.rope_theta!r}")
        _need(self.n_heads % self.n_kv_heads == 0, "n_kv_heads",
              f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}")
        _need(self.activation in ACTIVATIONS, "activation",
              f"unknown activation {self.activation!r}; choose one of {', '.join(ACTIVATIONS)}")
        _need(self.norm in NORMS, "norm", f"unknown norm {self.norm!r}; choose one of {', '.join(NORMS)}")
        _need(not (self.norm == "rmsnorm" and self.norm_bias), "norm_bias", "rmsnorm has no bias")
        _need(self.norm_eps > 0, "norm_eps", "must be > 0")
        _need(self.position in POSITIONS, "position",
              f"unknown position scheme {self.position!r}; choose one of {', '.join(POSITIONS)}")
        _need(0.0 < self.rotary_fraction <= 1.0, "rotary_fraction", "must be in (0, 1]")
        if self.position == "rope":
            rot = self.rotary_dim
            _need(rot % 2 == 0 and rot > 0, "rotary_fraction",
                  f"rotary dims head_dim*rotary_fraction={self.head_dim * self.rotary_fraction} must be a positive even integer")
        _need(self.block in BLOCKS, "block", f"unknown block style {self.block!r}; choose one of {', '.join(BLOCKS)}")

    def _validate_positions(self) -> None:
        """Scaled RoPE, layers without RoPE, the QK-norm and where the norms sit."""
        _need(self.qk_norm in QK_NORMS, "qk_norm", f"unknown QK-norm {self.qk_norm!r}; choose one of {', '.join(QK_NORMS)}")
        _need(self.norm_position in NORM_POSITIONS, "norm_position",
              f"unknown norm position {self.norm_position!r}; choose one of {', '.join(NORM_POSITIONS)}")
        _need(self.norm_position == "pre" or self.block == "sequential", "norm_position",
              f"post-norms need sequential blocks, the config has block={self.block!r}")
        _need(not self.norm_unit_offset or self.norm == "rmsnorm", "norm_unit_offset", "applies to rmsnorm only")
        if self.attn_window is not None:
            _need(0 < self.attn_window <= MAX_DIM, "attn_window", f"must be a positive integer, got "
                  f"{self.attn_window!r}")
        if self.attn_window_layers is not None:
            _need(self.attn_window is not None, "attn_window_layers", "window layers need an attn_window")
            self._check_layer_list("attn_window_layers")
        if self.window_rope_theta is not None:
            _need(self.attn_window is not None and self.position == "rope", "window_rope_theta",
                  "a RoPE base of the window layers needs attn_window and position: rope")
            _need(math.isfinite(self.window_rope_theta) and self.window_rope_theta > 0, "window_rope_theta",
                  f"must be a finite number > 0, got {self.window_rope_theta!r}")
        if self.attn_scale_dim is not None:
            _need(0 < self.attn_scale_dim <= MAX_DIM, "attn_scale_dim", f"must be a positive integer, got "
                  f"{self.attn_scale_dim!r}")
        for fld in ("attn_softcap", "final_softcap", "attn_scale", "embedding_multiplier", "residual_multiplier"):
            v = getattr(self, fld)
            _need(v is None or (math.isfinite(v) and v > 0), fld, f"must be a finite number > 0, got {v!r}")
        _need(self.attn_scale is None or self.attn_scale_dim is None, "attn_scale",
              "an attention scale of its own and attn_scale_dim are one setting: give one")
        self._validate_temperature()
        if self.nope_layers is not None:
            _need(self.position == "rope", "nope_layers", "layers without RoPE need position: rope")
            self._check_layer_list("nope_layers")
        if self.scaled_rope is not None:
            _need(self.position == "rope", "scaled_rope", "scaled RoPE needs position: rope")
            _validate_scaled_rope(self.scaled_rope, self.global_rotary_dim // 2)

    def _validate_hybrid(self) -> None:
        """Gated DeltaNet layers, the global layers' geometry, K/V shared across layers, per-layer inputs."""
        if self.linear_layers is not None:
            self._check_layer_list("linear_layers")
            for fld in ("linear_key_heads", "linear_value_heads", "linear_key_dim", "linear_value_dim", "linear_conv"):
                v = getattr(self, fld)
                _need(0 < v <= MAX_DIM, fld, f"Gated DeltaNet layers need a positive integer, got {v!r}")
            _need(self.linear_value_heads % self.linear_key_heads == 0, "linear_value_heads",
                  f"{self.linear_value_heads} value heads are not a multiple of linear_key_heads="
                  f"{self.linear_key_heads}")
            _need(self.linear_conv >= 2, "linear_conv", f"the convolution needs a width >= 2, got {self.linear_conv}")
        else:
            for fld in ("linear_key_heads", "linear_value_heads", "linear_key_dim", "linear_value_dim", "linear_conv"):
                _need(getattr(self, fld) == 0, fld, "applies to Gated DeltaNet layers: set linear_layers too")
        for fld in ("global_head_dim", "global_kv_heads", "kv_shared_ffn_hidden", "per_layer_vocab"):
            v = getattr(self, fld)
            _need(v is None or 0 < v <= MAX_DIM, fld, f"must be a positive integer, got {v!r}")
        if self.global_kv_heads is not None:
            _need(self.n_heads % self.global_kv_heads == 0, "global_kv_heads",
                  f"n_heads={self.n_heads} is not divisible by global_kv_heads={self.global_kv_heads}")
        if self.global_head_dim is not None and self.attn_window is not None and self.position == "rope":
            _need(self.window_rope_theta is not None, "global_head_dim",
                  "window layers of another head size than the global ones need their own RoPE (window_rope_theta)")
        if self.global_head_dim is not None:
            rot = self.global_rotary_dim
            _need(self.position != "rope" or (rot % 2 == 0 and rot > 0), "global_head_dim",
                  f"rotary dims global_head_dim*rotary_fraction={self.global_head_dim * self.rotary_fraction} must "
                  "be a positive even integer")
        _need(0 <= self.kv_shared_layers < self.n_layers, "kv_shared_layers",
              f"must be from 0 to n_layers - 1 = {self.n_layers - 1}, got {self.kv_shared_layers!r}")
        if self.kv_shared_layers:
            first = self.n_layers - self.kv_shared_layers
            for i in range(first, self.n_layers):
                _need(not self.is_linear_layer(i), "kv_shared_layers",
                      f"layer {i} reads another layer's K/V but is a Gated DeltaNet layer")
                _need(self.kv_source(i) is not None, "kv_shared_layers",
                      f"layer {i} ({'window' if self.is_window_layer(i) else 'global'}) has no earlier attention layer "
                      f"of its kind before layer {first} to read K/V from")
        else:
            _need(self.kv_shared_ffn_hidden is None, "kv_shared_ffn_hidden", "applies to K/V-sharing layers: set "
                  "kv_shared_layers too")
        _need(0 <= self.per_layer_dim <= MAX_DIM, "per_layer_dim",
              f"must be an integer from 0 (none) to {MAX_DIM}, got {self.per_layer_dim!r}")
        _need(self.per_layer_vocab is None or self.per_layer_dim > 0, "per_layer_vocab",
              "applies to per-layer input embeddings: set per_layer_dim too")
        _need(not (self.per_layer_dim or self.v_norm or self.layer_scale) or self.norm == "rmsnorm",
              "per_layer_dim/v_norm/layer_scale", "per-layer inputs, the value norm and the layer scale come with "
              "rmsnorm")

    def _validate_temperature(self) -> None:
        """The queries' scale by position: a finite temperature >= 0 and its positive period, together."""
        beta, length = self.attn_temperature, self.attn_temperature_length
        _need((beta is None) == (length is None), "attn_temperature",
              "attn_temperature and attn_temperature_length go together")
        if beta is not None:
            _need(math.isfinite(beta) and beta >= 0, "attn_temperature", f"must be a finite number >= 0, got {beta!r}")
            _need(0 < length <= MAX_DIM, "attn_temperature_length", f"must be a positive integer, got {length!r}")

    def _check_layer_list(self, fld: str) -> None:
        """A field listing layers (nope_layers, attn_window_layers): indices in [0, n_layers), increasing."""
        layers = getattr(self, fld)
        _need(all(0 <= i < self.n_layers for i in layers), fld,
              f"layer indices must be in [0, {self.n_layers}), got {layers[:8]}")
        _need(layers == sorted(set(layers)), fld, "layer indices must be increasing, without repeats")

    def _validate_mixture(self) -> None:
        """Experts, routing, router kinds and the router losses."""
        _need(self.ffn_experts >= 0, "ffn_experts", "must be >= 0")
        _need(self.attn_experts >= 0, "attn_experts", "must be >= 0")
        _need(self.linear_experts >= 0, "linear_experts", "must be >= 0")
        _need(self.ffn_experts != 1 and self.attn_experts != 1 and self.linear_experts != 1,
              "ffn_experts/attn_experts/linear_experts", "a mixture needs at least 2 experts (0 = dense)")
        _need(not self.linear_experts or self.linear_layers, "linear_experts",
              "Gated DeltaNet experts need Gated DeltaNet layers (linear_layers)")
        if self.ffn_experts:
            _need(1 <= self.ffn_top_k <= self.ffn_experts, "ffn_top_k",
                  f"top-k={self.ffn_top_k} must be between 1 and ffn_experts={self.ffn_experts}")
        _need(0 <= self.ffn_shared_hidden <= MAX_DIM, "ffn_shared_hidden",
              f"must be an integer from 0 (no shared expert) to {MAX_DIM}, got {self.ffn_shared_hidden!r}")
        _need(not self.ffn_shared_hidden or self.ffn_experts > 0, "ffn_shared_hidden",
              "a shared FFN expert sits beside routed FFN experts: needs ffn_experts > 0")
        _need(self.gate_norm in GATE_NORMS, "gate_norm",
              f"unknown gate normalization {self.gate_norm!r}; choose one of {', '.join(GATE_NORMS)}")
        if self.attn_top_k is not None:
            routed = [E for E in (self.attn_experts, self.linear_experts) if E]
            _need(bool(routed), "attn_top_k", "top-k attention routing needs attn_experts > 0")
            _need(1 <= self.attn_top_k <= min(routed or [0]), "attn_top_k",
                  f"top-k={self.attn_top_k} must be between 1 and the attention experts ({min(routed or [0])})")
        _need(self.kv_mode in KV_MODES, "kv_mode", f"unknown kv_mode {self.kv_mode!r}; choose one of {', '.join(KV_MODES)}")
        _need(self.router in ROUTERS, "router",
              f"unknown router kind {self.router!r}; choose one of {', '.join(ROUTERS)}")
        if self.attn_router is not None:
            _need(self.attn_router in ROUTERS, "attn_router",
                  f"unknown router kind {self.attn_router!r}; choose one of {', '.join(ROUTERS)}")
            _need(self.attn_experts > 0 or self.linear_experts > 0, "attn_router",
                  "a router kind for attention experts needs attn_experts > 0")
        if self.router_hidden is not None:
            _need(0 < self.router_hidden <= MAX_DIM, "router_hidden",
                  f"must be a positive integer up to {MAX_DIM}, got {self.router_hidden!r}")
        _need(math.isfinite(self.router_temperature) and self.router_temperature > 0, "router_temperature",
              f"must be a finite number > 0, got {self.router_temperature!r}")
        # the key store routes FFN experts (its rules read top-k FFN routing); attention routers take another kind
        if self.router == "key_store":
            _need(self.ffn_experts > 0, "router", "key_store routes FFN experts: needs ffn_experts > 0")
        _need(self.attn_router_kind != "key_store" or not (self.attn_experts or self.linear_experts), "attn_router",
              "key_store routes FFN experts only; give attention experts another kind (e.g. attn_router: linear)")
        for fld in ("key_store_alpha", "key_store_beta", "key_store_delta", "key_store_theta_percentile"):
            v = getattr(self, fld)
            _need(math.isfinite(v) and 0.0 <= v <= 1.0, fld, f"must be in [0, 1], got {v!r}")
        _need(math.isfinite(self.key_store_ema_decay) and 0.0 <= self.key_store_ema_decay < 1.0,
              "key_store_ema_decay", f"must be in [0, 1), got {self.key_store_ema_decay!r}")
        _need(self.lb_coef >= 0, "lb_coef", "must be >= 0")
        _need(self.z_coef >= 0, "z_coef", "must be >= 0")
        _need(self.logit_scale != 0, "logit_scale", "must be non-zero")

    # -- derived ---------------------------------------------------------------------------
    @property
    def is_mixture(self) -> bool:
        return self.ffn_experts > 0 or self.attn_experts > 0 or self.linear_experts > 0

    @property
    def q_dim(self) -> int:  # H * Dh
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:  # G * Dh
        return self.n_kv_heads * self.head_dim

    @property
    def gated_ffn(self) -> bool:
        return self.activation in GATED_ACTIVATIONS

    @property
    def has_ffn_norm(self) -> bool:
        """Sequential blocks and NeoX-style parallel blocks have a second norm before the FFN."""
        return self.block != "parallel"

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def dense(self) -> "ModelConfig":
        """The dense config with the same shapes (mixture fields reset)."""
        return self.replace(ffn_experts=0, ffn_top_k=1, ffn_shared_hidden=0, attn_experts=0, attn_top_k=None,
                            kv_mode="expert", attn_router=None, linear_experts=0)

    # -- serialization ---------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Every field, except those declared with later() that hold their default."""
        d = dataclasses.asdict(self)
        for f in dataclasses.fields(self):
            if f.metadata.get("written_when_set") and d[f.name] == f.default:
                del d[f.name]
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        if not isinstance(d, dict):
            raise ConfigError(f"expected a JSON object of config fields, got {type(d).__name__} {str(d)[:40]!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            # the nearest known names, not all of them: the list has grown past what one error line should carry
            near = difflib.get_close_matches(str(unknown[0]), sorted(known), n=3, cutoff=0.5)
            hint = f"did you mean {', '.join(near)}?" if near else "runtime/config.py ModelConfig lists the fields"
            raise ConfigError(f"{unknown[0]}: unknown config field ({hint})")
        missing = [f.name for f in dataclasses.fields(cls)
                   if f.default is dataclasses.MISSING and f.name not in d]
        if missing:
            raise ConfigError(f"{missing[0]}: required config field is missing")
        return cls(**d)

    @classmethod
    def from_json(cls, s: str) -> "ModelConfig":
        return cls.from_dict(parse_json(s, "config JSON", error=ConfigError))


# Each scaled RoPE type's keys in scaled_rope (transformers' rope_parameters names): (required, optional).
# yarn and longrope derive a missing factor as max_positions / original_max_position_embeddings.
ROPE_KEYS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "linear": (("factor",), ()),
    "dynamic": (("factor",), ()),
    "yarn": (("original_max_position_embeddings",),
             ("factor", "attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate")),
    "longrope": (("short_factor", "long_factor", "original_max_position_embeddings"), ("factor", "attention_factor")),
    "llama3": (("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"), ()),
    "proportional": ((), ("factor", "partial_rotary_factor")),
}


def _validate_scaled_rope(d: dict, half_dim: int) -> None:
    """scaled_rope: a known rope_type, its required keys, no unknown ones, finite positive numbers, factor
    lists of one entry per rotated pair (half_dim)."""
    kind = d.get("rope_type")
    _need(kind in ROPE_TYPES, "scaled_rope.rope_type",
          f"unknown scaled RoPE {str(kind)[:40]!r}; choose one of {', '.join(ROPE_TYPES)}")
    required, optional = ROPE_KEYS[kind]
    for key in required:
        _need(key in d, f"scaled_rope.{key}", f"required by rope_type {kind!r}")
    for key, v in d.items():
        if key == "rope_type":
            continue
        _need(key in required + optional, f"scaled_rope.{str(key)[:40]}",
              f"not a key of rope_type {kind!r} (its keys: {', '.join(required + optional)})")
        if key == "truncate":
            _need(isinstance(v, bool), f"scaled_rope.{key}", f"expected true or false, got {str(v)[:40]}")
        elif key in ("short_factor", "long_factor"):
            _need(isinstance(v, list) and len(v) == half_dim and all(_positive(x) for x in v), f"scaled_rope.{key}",
                  f"expected {half_dim} positive numbers (one per rotated pair), got {str(v)[:60]}")
        elif key == "original_max_position_embeddings":
            _need(isinstance(v, int) and not isinstance(v, bool) and 0 < v <= MAX_DIM, f"scaled_rope.{key}",
                  f"expected a positive integer, got {str(v)[:40]}")
        elif key == "partial_rotary_factor":
            _need(_positive(v) and v <= 1, f"scaled_rope.{key}", f"expected a number in (0, 1], got {str(v)[:40]}")
        elif key in ("mscale", "mscale_all_dim"):  # 0 turns the mscale ratio off, as in transformers
            _need(_positive(v) or v == 0, f"scaled_rope.{key}", f"expected a finite number >= 0, got {str(v)[:40]}")
        else:
            _need(_positive(v), f"scaled_rope.{key}", f"expected a finite number > 0, got {str(v)[:40]}")


def _positive(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


_FIELD_TYPES: dict[type, dict[str, tuple[Callable[[Any], bool], str]]] = {}


def _field_types(cls: type) -> dict[str, tuple[Callable[[Any], bool], str]]:
    """Per field of a config class: its type check and name (resolved from the annotations once)."""
    if cls not in _FIELD_TYPES:
        _FIELD_TYPES[cls] = {name: _type_check(hint) for name, hint in get_type_hints(cls).items()}
    return _FIELD_TYPES[cls]


def dense_fields() -> tuple[str, ...]:
    """The fields of a model's dense architecture: those above ModelConfig's mixture section (ffn_experts on)."""
    names = [f.name for f in dataclasses.fields(ModelConfig)]
    return tuple(names[:names.index("ffn_experts")])


# ---- presets: data, with their source ------------------------------------------------------
# Paper (BAM, Table 4). Parallel attention block with one shared norm (Table 5 lists one
# 1024-parameter "layernorm / Block", i.e. no bias). "FFN dimension" in Table 4 is the fused
# gate+up width (see module docstring), hence ffn_hidden = FFN dimension / 2.
PRESETS: dict[str, dict[str, Any]] = {
    "paper-small": dict(
        source="BAM paper, Table 4 (small scale, 590M seed); Table 5 counts",
        vocab_size=256000, d_model=1024, n_layers=6, n_heads=8, n_kv_heads=8, ffn_hidden=2048,
        activation="swiglu", norm="layernorm", norm_bias=False, position="rope",
        block="parallel", tie_embeddings=False, max_positions=2048,
    ),
    "paper-large": dict(
        source="BAM paper, Table 4 (large scale, 2B seed)",
        vocab_size=256000, d_model=2304, n_layers=18, n_heads=18, n_kv_heads=6, ffn_hidden=9216,
        activation="swiglu", norm="layernorm", norm_bias=False, position="rope",
        block="parallel", tie_embeddings=True, max_positions=2048,
    ),
    # A tiny model used by `make demo` and tests; shaped like paper-small, scaled down.
    # The self-organizing mixture (SoME) of the ablation logs (seeds/004): 10 sequential blocks, LayerNorm with
    # bias, biases in every projection and the untied head, RoPE (the logs count no position table), a non-gated
    # GELU FFN expert of width 1024 in every layer, top-4 of E through a key-store router. Its counts (trainable
    # 29.42M, totals 701.50M / 1373.57M / 2717.71M / 5406.00M) hold for a model without a final norm; see
    # docs/param-counting.md. "trainable": the experts are frozen (count-params' default --trainable).
    **{f"some-{E}": dict(
        source=f"SoME ablation logs (seeds/004), {E} frozen experts",
        trainable=["*", "!ffn_experts"],
        vocab_size=8192, d_model=512, n_layers=10, n_heads=8, ffn_hidden=1024, activation="gelu",
        norm="layernorm", norm_bias=True, qkv_bias=True, o_bias=True, ffn_bias=True, lm_head_bias=True,
        position="rope", block="sequential", tie_embeddings=False, max_positions=768, final_norm=False,
        ffn_experts=E, ffn_top_k=4, gate_norm="topk_softmax", router="key_store", router_temperature=0.8,
        key_store_alpha=0.01, key_store_beta=0.005, key_store_delta=0.001, key_store_theta_percentile=0.05,
        key_store_ema_decay=0.99, lb_coef=0.0, z_coef=0.0,
    ) for E in (64, 128, 256, 512)},
    "tiny": dict(
        source="bam-surgery demo: paper-small's architecture at toy size",
        vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=4, ffn_hidden=128,
        activation="swiglu", norm="layernorm", norm_bias=False, position="rope",
        block="parallel", tie_embeddings=False, max_positions=128,
    ),
}


PRESET_NOTES = ("source", "trainable")  # preset entries that are not config fields


def preset_trainable(name: str) -> list[str]:
    """The trainable patterns a preset's model is meant to train with (train --trainable syntax); ['*'] unless
    it says otherwise (the SoME presets freeze their experts)."""
    if name not in PRESETS:
        raise ConfigError(f"preset: unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    return list(PRESETS[name].get("trainable", ["*"]))


def preset(name: str, /, **overrides: Any) -> ModelConfig:
    """A preset's config with fields overridden; `name` is positional-only so that the config's own
    `name` field can be overridden too: preset("tiny", name="seed")."""
    if name not in PRESETS:
        raise ConfigError(f"preset: unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    fields = {k: v for k, v in PRESETS[name].items() if k not in PRESET_NOTES}
    fields["name"] = name
    fields.update(overrides)
    return ModelConfig(**fields)
