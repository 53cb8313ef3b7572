"""llama.cpp's names for canonical tensors and config fields: one table, read both ways.

The GGUF export (gguf_export.py) runs it canonical -> GGUF, the GGUF reader (gguf_reader.py) GGUF -> canonical; neither
spells a name or a key of its own.

  TENSORS   canonical prefix ("layers.{}.attn.q") <-> gguf.MODEL_TENSOR member (ATTN_Q: "blk.{bid}.attn_q"), with the
            suffixes it takes (weight, bias); a row applies to an architecture when llama.cpp lists the member for it
            (gguf.MODEL_TENSORS), so `tensor_names(arch, n_layers)` is the whole map of one architecture, and
            `tensor_layout(arch, cfg)` that map for one model with the architecture's fused tensors (Fused: phi3's
            attn_qkv holds [q; k; v], its ffn_up [gate; up], stacked along the rows).
  HPARAMS   {arch}.* metadata key (gguf.Keys) <-> ModelConfig field, in the order the export writes them; `when` says
            which configs and architectures carry a key (the experts' keys only for mixtures).
  ROPE      scaled RoPE (ModelConfig.scaled_rope) <-> the {arch}.rope.scaling.* keys and the frequency-factor tensors
            llama.cpp applies: `rope_scaling(cfg)` writes, `scaled_rope_of(...)` reads (section below).
  ARCHS     what each llama.cpp architecture computes beyond the tensors: whether it rotates pairs of dimensions
            (llama: the Q/K rows of a rotate-halves model are permuted per head, ROPE_PAIRS, exactly invertible),
            how it gates a mixture (llama and qwen3moe: top-k renormalized, Mixtral's; qwen2moe: the softmax over all
            experts), whether it loads a tied embedding as output.weight once more (qwen2moe, olmo2), its QK-norm and
            norm position, its layers without RoPE (smollm3), the biases its graph adds, the RoPE scalings it applies,
            its fused tensors, and whether its attention is as wide as the model (n_heads * head_dim = d_model).

A new architecture is a row of ARCHS (and its new tensors rows of TENSORS, its new keys rows of HPARAMS); the export
decides which architecture a config becomes (gguf_export.gguf_architecture) and checks the config against the row
(gguf_export.arch_problems), the reader takes any row.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, replace
from typing import Any, Callable

import numpy as np
import torch

from bam_surgery.runtime.config import ModelConfig
from bam_surgery.runtime.layout import tensor_shapes

from .gguf_metadata import BOOLEANS, INTEGER, INTEGERS, NUMBER, STRING, metadata_value
from .hf.families import FAMILIES
from .hf.family import Family, Fused, Gguf


def gguf_module():
    """The gguf package, imported on first use: the CLI loads the converters for --help and every format, and only
    reading or writing a GGUF needs it (a missing package is then one line: surgery/errors.py)."""
    import gguf  # lazy: see the docstring

    return gguf


@dataclass(frozen=True)
class TensorRow:
    canonical: str  # "layers.{}.attn.q": "{}" the layer
    member: str  # gguf.MODEL_TENSOR member
    suffixes: tuple[str, ...] = ("weight",)
    only: str = ""  # only the architectures whose ARCHS row has this flag take it (""): every one listing the member
    bare: bool = False  # llama.cpp's name has no suffix (qwen35's ssm_a)


_WB = ("weight", "bias")
TENSORS = (
    TensorRow("embed", "TOKEN_EMBD"),
    TensorRow("final_norm", "OUTPUT_NORM"),
    TensorRow("lm_head", "OUTPUT"),
    TensorRow("layers.{}.attn_norm", "ATTN_NORM"),
    TensorRow("layers.{}.ffn_norm", "FFN_NORM"),
    TensorRow("layers.{}.ffn_norm", "FFN_PRE_NORM"),  # gguf's member for Gemma's pre-FFN norm (the same name)
    TensorRow("layers.{}.attn_post_norm", "ATTN_POST_NORM"),
    TensorRow("layers.{}.ffn_post_norm", "FFN_POST_NORM"),
    TensorRow("layers.{}.attn.q_norm", "ATTN_Q_NORM"),
    TensorRow("layers.{}.attn.k_norm", "ATTN_K_NORM"),
    *(TensorRow(f"layers.{{}}.attn.{c}", m, _WB) for c, m in (("q", "ATTN_Q"), ("k", "ATTN_K"), ("v", "ATTN_V"),
                                                              ("o", "ATTN_OUT"))),
    *(TensorRow(f"layers.{{}}.ffn.{c}", m, _WB) for c, m in (("gate", "FFN_GATE"), ("up", "FFN_UP"),
                                                             ("down", "FFN_DOWN"))),
    TensorRow("layers.{}.ffn_router", "FFN_GATE_INP"),
    *(TensorRow(f"layers.{{}}.ffn_experts.{c}", m) for c, m in (("gate", "FFN_GATE_EXP"), ("up", "FFN_UP_EXP"),
                                                                ("down", "FFN_DOWN_EXP"))),
    *(TensorRow(f"layers.{{}}.ffn_shared.{c}", m) for c, m in (("gate", "FFN_GATE_SHEXP"), ("up", "FFN_UP_SHEXP"),
                                                               ("down", "FFN_DOWN_SHEXP"))),
    TensorRow("layers.{}.ffn_shared_gate", "FFN_GATE_INP_SHEXP"),
    # Qwen3.5 (LINEAR section below): its norm before the FFN is llama.cpp's post_attention_norm; a Gated DeltaNet
    # layer's tensors
    TensorRow("layers.{}.ffn_norm", "ATTN_POST_NORM", only="linear_attention"),
    *(TensorRow(f"layers.{{}}.linear.{c}", m, only="linear_attention") for c, m in (
        ("qkv", "ATTN_QKV"), ("z", "ATTN_GATE"), ("b", "SSM_BETA"), ("a", "SSM_ALPHA"), ("conv", "SSM_CONV1D"),
        ("norm", "SSM_NORM"), ("out", "SSM_OUT"))),
    TensorRow("layers.{}.linear.dt", "SSM_DT", ("bias",), only="linear_attention"),
    TensorRow("layers.{}.linear.a_log", "SSM_A", only="linear_attention", bare=True),
    # Gemma 4 (GEMMA4 section below): each block's output scale, the per-layer inputs
    TensorRow("layers.{}.layer_scale", "LAYER_OUT_SCALE"),
    TensorRow("ple_embed", "PER_LAYER_TOKEN_EMBD"),
    TensorRow("ple_proj", "PER_LAYER_MODEL_PROJ"),
    TensorRow("ple_proj_norm", "PER_LAYER_PROJ_NORM"),
    TensorRow("layers.{}.ple.gate", "PER_LAYER_INP_GATE"),
    TensorRow("layers.{}.ple.out", "PER_LAYER_PROJ"),
    TensorRow("layers.{}.ple_norm", "PER_LAYER_POST_NORM"),
)


def tensor_names(arch: str, n_layers: int) -> dict[str, str]:
    """canonical name -> llama.cpp's name, for every tensor the architecture has ("layers.3.attn.q.weight" ->
    "blk.3.attn_q.weight")."""
    g = gguf_module()
    arch_id = next(a for a, n in g.MODEL_ARCH_NAMES.items() if n == arch)
    known = g.MODEL_TENSORS[arch_id]
    out = {}
    for row in TENSORS:
        tensor = getattr(g.MODEL_TENSOR, row.member)
        if tensor not in known or (row.only and not getattr(ARCHS[arch], row.only)):
            continue
        layers = range(n_layers) if "{}" in row.canonical else [None]
        for i in layers:
            base, canonical = g.TENSOR_NAMES[tensor].format(bid=i), row.canonical.format(i)
            for suffix in row.suffixes:
                out[f"{canonical}.{suffix}"] = base if row.bare else f"{base}.{suffix}"
    return out


def fused_of(arch: str, canonical: str) -> Fused | None:
    """The fused tensor of `arch` a canonical tensor ("layers.3.attn.q.weight") is a part of, or None."""
    prefix, parts = canonical.rsplit(".", 1)[0], canonical.split(".")
    if parts[0] != "layers":
        return None
    return next((f for f in ARCHS[arch].fused if prefix in [p.format(parts[1]) for p in f.parts]), None)


def join_heads(parts: list[torch.Tensor], heads: int) -> torch.Tensor:
    """Per-head fusion: rows [heads, parts, rows per head] from parts each [heads * rows, ...]."""
    rest = tuple(parts[0].shape[1:])
    return torch.stack([p.reshape(heads, -1, *rest) for p in parts], dim=1).reshape(-1, *rest)


def split_heads(fused: torch.Tensor, heads: int, n_parts: int, index: int) -> torch.Tensor:
    """Part `index` of a per-head fusion (join_heads' inverse)."""
    rest = tuple(fused.shape[1:])
    return fused.reshape(heads, n_parts, -1, *rest)[:, index].reshape(-1, *rest)


def tensor_layout(arch: str, cfg: ModelConfig) -> tuple[dict[str, tuple[str, ...]], list[str]]:
    """({llama.cpp name: the canonical tensors it holds, stacked along the rows}, canonical tensors the architecture
    has no name for), for every tensor of `cfg`, in canonical order: one canonical tensor per name, except the parts
    of the architecture's fused tensors (phi3's "blk.0.attn_qkv.weight" -> q, k, v)."""
    g = gguf_module()
    names = tensor_names(arch, cfg.n_layers)
    fused_into: dict[str, str] = {}
    for f in ARCHS[arch].fused:
        base = g.TENSOR_NAMES[getattr(g.MODEL_TENSOR, f.member)]
        for i in range(cfg.n_layers):
            for part in f.parts:
                for suffix in f.suffixes:
                    fused_into[f"{part.format(i)}.{suffix}"] = f"{base.format(bid=i)}.{suffix}"
    layout: dict[str, tuple[str, ...]] = {}
    unmapped = []
    for canonical in tensor_shapes(cfg):
        name = fused_into.get(canonical) or names.get(canonical)
        if name is None:
            unmapped.append(canonical)
        else:
            layout[name] = layout.get(name, ()) + (canonical,)
    return layout, unmapped


@dataclass(frozen=True)
class HParam:
    key: str  # a gguf.Keys template ("{arch}.context_length")
    kind: str  # "u32" or "f32"
    field: str  # the ModelConfig field (or property: rotary_dim)
    when: Callable[[ModelConfig, str], bool] = lambda cfg, arch: True
    reciprocal: bool = False  # the key holds 1 / the field (granite's logit_scale divides the logits)
    carried: bool = False  # a key of the architectures whose record carries the field only (Gguf.carries)


def _carried(field: str, also: Callable[[ModelConfig], bool] = lambda cfg: True) -> Callable[[ModelConfig, str], bool]:
    """A key written for the architectures whose record says they carry `field` (Gguf.carries)."""
    return lambda cfg, arch: field in ARCHS[arch].carries and also(cfg)


def _keys():
    g = gguf_module()
    return g.Keys.LLM, g.Keys.Attention, g.Keys.Rope


def hparams() -> tuple[HParam, ...]:
    """The architecture's keys llama.cpp reads, as convert_hf_to_gguf.py writes them, in that order."""
    llm, att, rope = _keys()
    every = (("u32", llm.VOCAB_SIZE, "vocab_size"), ("u32", llm.CONTEXT_LENGTH, "max_positions"),
             ("u32", llm.EMBEDDING_LENGTH, "d_model"), ("u32", llm.BLOCK_COUNT, "n_layers"),
             ("u32", llm.FEED_FORWARD_LENGTH, "ffn_hidden"), ("u32", att.HEAD_COUNT, "n_heads"),
             ("u32", att.HEAD_COUNT_KV, "n_kv_heads"), ("u32", att.KEY_LENGTH, "head_dim"),
             ("u32", att.VALUE_LENGTH, "head_dim"), ("u32", rope.DIMENSION_COUNT, "rotary_dim"),
             ("f32", rope.FREQ_BASE, "rope_theta"), ("f32", att.LAYERNORM_RMS_EPS, "norm_eps"))
    return (
        *(HParam(key, kind, field) for kind, key, field in every),
        HParam(llm.EXPERT_COUNT, "u32", "ffn_experts", lambda cfg, arch: bool(cfg.ffn_experts)),
        HParam(llm.EXPERT_USED_COUNT, "u32", "ffn_top_k", lambda cfg, arch: bool(cfg.ffn_experts)),
        # the experts' width, where the architecture reads it (Gguf.expert_width)
        HParam(llm.EXPERT_FEED_FORWARD_LENGTH, "u32", "ffn_hidden",
               lambda cfg, arch: bool(cfg.ffn_experts) and ARCHS[arch].expert_width),
        HParam(llm.EXPERT_SHARED_FEED_FORWARD_LENGTH, "u32", "ffn_shared_hidden",
               lambda cfg, arch: bool(cfg.ffn_shared_hidden)),
        HParam(llm.ATTN_LOGIT_SOFTCAPPING, "f32", "attn_softcap", lambda cfg, arch: cfg.attn_softcap is not None),
        HParam(llm.FINAL_LOGIT_SOFTCAPPING, "f32", "final_softcap", lambda cfg, arch: cfg.final_softcap is not None),
        # the residual stream's multipliers and an attention scale of its own (granite)
        HParam(llm.EMBEDDING_SCALE, "f32", "embedding_multiplier", _carried("embedding_multiplier"), carried=True),
        HParam(llm.RESIDUAL_SCALE, "f32", "residual_multiplier", _carried("residual_multiplier"), carried=True),
        HParam(att.SCALE, "f32", "attn_scale", _carried("attn_scale", lambda cfg: cfg.attn_scale is not None), carried=True),
        HParam(llm.LOGIT_SCALE, "f32", "logit_scale", _carried("logit_scale"), reciprocal=True, carried=True),
    )


@dataclass(frozen=True)
class GGUFArch(Gguf):
    """One llama.cpp architecture: its spelling in a family record (hf/family.py Gguf: what its graph computes beyond
    the family's traits) with the record's traits, and the HF model_types it converts to."""

    hf_dense: str | None = None  # the HF model_type of a dense model of this architecture (hf/families.py)
    hf_mixture: str | None = None  # ... of a mixture
    qk_norm: str = "none"  # ModelConfig.qk_norm its graph applies: head (per head, [Dh]) or full ([H*Dh])
    norm_position: str = "pre"  # post: attn_post_norm / ffn_post_norm after each sublayer, no pre-norms (OLMo 2)
    activation: str = "swiglu"  # ModelConfig.activation of its FFN (geglu_tanh: gelu(gate x) * up x)
    scale_embeddings: bool = False  # the embeddings times sqrt(d_model)
    unit_offset_norms: bool = False  # its converter stores RMSNorm weights as 1 + w: read as (1 + w) norms
    shared_expert: bool = False  # its mixture has a shared expert
    qkv_bias_always: bool = False  # its mixture always has q/k/v biases (zeros are written for a model without)
    zero_shared_expert: bool = False  # its mixture always has a shared expert (zeros are written for a model without)

    def nope_layers(self, n_layers: int) -> list[int] | None:
        """The layers this architecture computes without RoPE, as ModelConfig.nope_layers (None: none)."""
        out = [i for i in range(n_layers) if self.nope_every and (i + 1) % self.nope_every == 0]
        return out or None


def _rows(families: tuple[Family, ...]) -> dict[str, GGUFArch]:
    """Each llama.cpp architecture of the records, in their order: a dense record gives the row, a mixture record of
    the same architecture its gating (a mixture record alone gives the whole row)."""
    rows: dict[str, GGUFArch] = {}
    for f in families:
        g = f.gguf
        if g is None:
            continue
        spelling = {k.name: getattr(g, k.name) for k in dataclasses.fields(Gguf)}
        traits = dict(qk_norm=f.all_traits["qk_norm"], norm_position=f.all_traits["norm_position"],
                      activation=f.activation, scale_embeddings=f.all_traits["scale_embeddings"],
                      unit_offset_norms=f.all_traits["norm_unit_offset"])
        if not f.mixture:
            rows[g.name] = GGUFArch(**spelling, hf_dense=f.model_type, **traits)
            continue
        mixture = dict(gate_norm=g.gate_norm, expert_width=g.expert_width, hf_mixture=f.model_type,
                       moe_checks=g.moe_checks or f.model_type, moe_biases=g.moe_biases,
                       shared_expert=f.config.shared_expert, qkv_bias_always=f.config.qkv_bias_always,
                       zero_shared_expert=f.config.zero_shared_expert)
        rows[g.name] = (replace(rows[g.name], **mixture) if g.name in rows
                        else GGUFArch(**{**spelling, **mixture}, **traits))
    return rows


ARCHS: dict[str, GGUFArch] = _rows(FAMILIES)
TOKENIZER_SHAPES = {name: row.tokenizer for name, row in ARCHS.items()}  # SentencePiece shapes (gguf_sentencepiece)
# llama.cpp's values where a file of an architecture that always soft-caps has no key (llama-hparams.h)
SOFTCAP_DEFAULTS = {"attn_softcap": 50.0, "final_softcap": 30.0}
ROPE_ROWS = ("attn.q", "attn.k")  # the projections whose rows ROPE_PAIRS permutes (weights and biases)


def rope_heads(canonical: str, cfg: ModelConfig, arch: str) -> int | None:
    """The heads over which a tensor's rows are permuted between canonical and `arch`, or None."""
    parts = canonical.split(".")
    if len(parts) != 5 or ".".join(parts[2:4]) not in ROPE_ROWS or not ARCHS[arch].rope_pairs or cfg.rope_interleaved:
        return None
    return cfg.n_heads if parts[3] == "q" else cfg.n_kv_heads


def rope_pairs(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of a rotate-halves projection (weight [heads * Dh, D] or bias [heads * Dh]) reordered per head so that
    llama.cpp's pair rotation computes the same (convert_hf_to_gguf.py's LlamaModel.permute)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def rope_halves(w: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of rope_pairs (a row permutation, exact)."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ---- ROPE: scaled RoPE <-> {arch}.rope.scaling.* and frequency factors ---------------------------------------
# llama.cpp rotates by theta_p,i = p * base^(-2i/d) / ff_i * freq_scale (freq_scale = 1 / rope.scaling.factor), with
# per-pair frequency factors ff from a tensor (llama: rope_freqs, Llama 3's; phi3: rope_factors_long once the context
# n_ctx exceeds rope.scaling.original_context_length, else rope_factors_short), blended with the unscaled angle over
# YaRN's ramp for rope.scaling.type yarn, and cos / sin times rope.scaling.attn_factor (times 0.1 ln(factor) + 1 for
# yarn). So, from transformers' rope_parameters:
#   linear    type linear, factor
#   yarn      type yarn, factor, original_context_length, attn_factor = attention_factor / (0.1 ln(factor) + 1)
#             (beta_fast 32, beta_slow 1 and truncated correction dims: llama.cpp's, for these architectures)
#   llama3    the rope_freqs tensor, as convert_hf_to_gguf.py computes it (llama3_factors)
#   longrope  type longrope, original_context_length, attn_factor = attention_factor, rope_factors_long / _short
#             (llama.cpp picks the long factors by context size, the runtime and transformers by sequence length)
#   dynamic   none: llama.cpp has no dynamic NTK scaling
ROPE_TENSORS = {"llama3": ("ROPE_FREQS",), "longrope": ("ROPE_FACTORS_LONG", "ROPE_FACTORS_SHORT"),
                "proportional": ("ROPE_FREQS",)}
UNROTATED = 1e30  # gemma4's frequency factor of a pair proportional RoPE does not rotate (llama.cpp's converter's)
LLAMA3_DEFAULTS = dict(low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)  # Llama 3.x


def rope_tensor_name(member: str) -> str:
    g = gguf_module()
    return f"{g.TENSOR_NAMES[getattr(g.MODEL_TENSOR, member)]}.weight"


def yarn_mscale(factor: float) -> float:
    """YaRN's default cos / sin scale, which llama.cpp multiplies into rope.scaling.attn_factor."""
    return 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0


def llama3_factors(rope_theta: float, rotary_dim: int, s: dict) -> np.ndarray:
    """Llama 3's frequency factors [rotary_dim / 2], op for op as llama.cpp's convert_hf_to_gguf.py computes them
    (LlamaModel.generate_extra_tensors), so that a file converted there and one written here are bit-identical."""
    freqs = 1.0 / (rope_theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old = s["original_max_position_embeddings"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32).numpy()


def rope_scaling(cfg: ModelConfig) -> tuple[dict[str, tuple[str, Any]], dict[str, np.ndarray]]:
    """({key template: (kind, value)}, {tensor name: float32 factors}) that make llama.cpp rotate as cfg.scaled_rope
    does (section comment); a type llama.cpp lacks is gguf_export's to refuse first."""
    from bam_surgery.runtime.blocks import rope_frequencies  # the runtime's scale, to the last bit

    s = cfg.scaled_rope
    if s is None:
        return {}, {}
    rope = gguf_module().Keys.Rope
    kind = s["rope_type"]
    if kind == "linear":
        return {rope.SCALING_TYPE: ("str", "linear"), rope.SCALING_FACTOR: ("f32", float(s["factor"]))}, {}
    if kind == "llama3":
        return {}, {rope_tensor_name("ROPE_FREQS"): llama3_factors(cfg.rope_theta, cfg.rotary_dim, s)}
    if kind == "proportional":  # Gemma 4's global layers: the unrotated pairs' frequencies divided by 1e30
        half = cfg.global_rotary_dim // 2
        rotated = int(s.get("partial_rotary_factor", 1.0) * cfg.global_rotary_dim // 2)
        return {}, {rope_tensor_name("ROPE_FREQS"): np.array([1.0] * rotated + [UNROTATED] * (half - rotated),
                                                             dtype=np.float32)}
    original = s["original_max_position_embeddings"]
    _, scale = rope_frequencies(cfg, torch.device("cpu"), torch.tensor(0))
    if kind == "yarn":
        factor = float(s.get("factor") or cfg.max_positions / original)
        return {rope.SCALING_TYPE: ("str", "yarn"), rope.SCALING_FACTOR: ("f32", factor),
                rope.SCALING_ORIG_CTX_LEN: ("u32", original),
                rope.SCALING_ATTN_FACTOR: ("f32", float(scale) / yarn_mscale(factor))}, {}
    if kind == "longrope":
        return ({rope.SCALING_TYPE: ("str", "longrope"), rope.SCALING_ORIG_CTX_LEN: ("u32", original),
                 rope.SCALING_ATTN_FACTOR: ("f32", float(scale))},
                {rope_tensor_name(m): np.asarray(s[k], dtype=np.float32)
                 for m, k in (("ROPE_FACTORS_LONG", "long_factor"), ("ROPE_FACTORS_SHORT", "short_factor"))})
    raise ValueError(f"rope_type {kind!r} has no llama.cpp form")


def scaled_rope_of(arch: str, fields: dict, tensors: dict[str, np.ndarray], base: ModelConfig,
                   recorded: dict | None) -> tuple[dict | None, str | None]:
    """(ModelConfig.scaled_rope computing what llama.cpp computes for this file, or None for plain RoPE; a note when
    the factors are carried as they are) from its rope.scaling.* keys and factor tensors (`tensors`: those of
    ROPE_TENSORS present), `base` the config without scaling. `recorded` (our export's bam_surgery.config) is taken
    when writing it again gives exactly these keys and tensors. Raises ValueError (one line) for what it cannot map,
    gguf_metadata.MetadataError (naming the key) for a value of the wrong kind."""
    rope = gguf_module().Keys.Rope
    if ARCHS[arch].per_layer_geometry:
        return proportional_of(tensors.get(rope_tensor_name("ROPE_FREQS"))), None
    kinds = {rope.SCALING_TYPE: (STRING, None), rope.SCALING_FACTOR: (NUMBER, None),
             rope.SCALING_ATTN_FACTOR: (NUMBER, None), rope.SCALING_ORIG_CTX_LEN: (INTEGER, 1)}
    keys = {k: metadata_value(fields, k.format(arch=arch), kind, low=low) for k, (kind, low) in kinds.items()
            if k.format(arch=arch) in fields}
    if recorded is not None:
        try:
            written = rope_scaling(base.replace(scaled_rope=recorded))
        except (ValueError, TypeError, KeyError):
            written = None
        if written is not None and _same_encoding(written, keys, tensors):
            return recorded, None
    legacy = metadata_value(fields, f"{arch}.rope.scale_linear", NUMBER, None)
    factor = keys.get(rope.SCALING_FACTOR, legacy if legacy is not None else 0.0)
    kind = keys.get(rope.SCALING_TYPE, "linear")  # llama.cpp's default: a factor alone is linear
    factor = float(factor) or 1.0  # llama.cpp: 0 or absent is no scaling
    original = keys.get(rope.SCALING_ORIG_CTX_LEN, base.max_positions)
    attn = float(keys.get(rope.SCALING_ATTN_FACTOR, 1.0))
    freqs = tensors.get(rope_tensor_name("ROPE_FREQS"))
    long, short = (tensors.get(rope_tensor_name(m)) for m in ("ROPE_FACTORS_LONG", "ROPE_FACTORS_SHORT"))
    if (long is None) != (short is None):
        raise ValueError("one of rope_factors_long / rope_factors_short without the other")
    if long is not None and (kind in ("longrope", "linear") and factor == 1.0):
        return {"rope_type": "longrope", "long_factor": long.tolist(), "short_factor": short.tolist(),
                "original_max_position_embeddings": int(original), "attention_factor": attn}, None
    if freqs is not None and kind == "linear" and factor == 1.0 and attn == 1.0:
        return _llama3_of(freqs, base)
    if long is not None or freqs is not None:
        raise ValueError(f"frequency-factor tensors with rope.scaling.type {printable_kind(kind)}, factor {factor:g}, "
                         f"attn_factor {attn:g}: a combination the runtime does not compute")
    if (kind == "none" or kind == "linear") and attn == 1.0:
        return (None if kind == "none" or factor == 1.0 else {"rope_type": "linear", "factor": factor}), None
    if kind == "yarn":
        return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": int(original),
                "attention_factor": attn * yarn_mscale(factor)}, None
    raise ValueError(f"rope.scaling.type {printable_kind(kind)} (factor {factor:g}, attn_factor {attn:g}) is not one "
                     "this reader maps (none, linear, yarn, longrope, and Llama 3's rope_freqs)")


def printable_kind(kind: str) -> str:
    return repr("".join(c if c.isprintable() else "?" for c in kind)[:20])


def _same_encoding(written: tuple[dict, dict], keys: dict, tensors: dict[str, np.ndarray]) -> bool:
    """Whether the keys and tensors `written` (rope_scaling's) are exactly those of the file."""
    want_keys, want_tensors = written
    as_stored = {k: (np.float32(v) if kind == "f32" else v) for k, (kind, v) in want_keys.items()}
    return (as_stored == {k: (np.float32(v) if isinstance(v, float) else v) for k, v in keys.items()}
            and want_tensors.keys() == tensors.keys()
            and all(np.array_equal(want_tensors[n], tensors[n]) for n in tensors))


def _llama3_of(freqs: np.ndarray, base: ModelConfig) -> tuple[dict, str | None]:
    """rope_freqs as Llama 3's parameters when Llama 3.x's (LLAMA3_DEFAULTS, factor the largest factor) give exactly
    these factors; otherwise the factors as they are: longrope with equal long and short factors and attention factor
    1, which rotates exactly as llama.cpp does with them."""
    candidate = {"rope_type": "llama3", "factor": float(freqs.max()), **LLAMA3_DEFAULTS}
    if np.array_equal(llama3_factors(base.rope_theta, base.rotary_dim, candidate), freqs):
        return candidate, None
    factors = freqs.tolist()
    return ({"rope_type": "longrope", "long_factor": factors, "short_factor": factors,
             "original_max_position_embeddings": base.max_positions, "attention_factor": 1.0},
            "rope_freqs are not Llama 3.x's parameters (factor, low 1, high 4, original 8192): carried as the "
            "frequency factors they are (scaled_rope longrope with equal long and short factors)")


# ---- WINDOWS: sliding windows, their RoPE, the attention scale and (1 + w) norms (Gemma) ----------------------
# llama.cpp masks key p0 for query p1 of a sliding layer when p1 - p0 >= attention.sliding_window: a query sees the
# last sliding_window tokens, itself included (ModelConfig.attn_window). The sliding layers are the bool array
# attention.sliding_window_pattern (an integer n: layers i with i % n < n - 1; absent: the row's window_pattern). gemma3
# without sliding_window (or 0) has none; gemma2 always slides (4096 when absent), so a model without windows gets an
# all-false pattern. The sliding layers' RoPE (ModelConfig: plain RoPE of base window_rope_theta, or, None, the
# global RoPE):
#   global (gemma2)  base rope.freq_base_swa (absent: rope.freq_base), scaled as the other layers
#   plain (gemma3)   base rope.freq_base_swa (absent: 10000), never scaled
# The attention scale is no key: llama.cpp takes 1/sqrt(head_dim), or 1/sqrt(d_model / n_heads) (integer division)
# at the 27B's block_count (attn_scale_layers). Norms: llama.cpp's RMSNorm multiplies by the stored weight, so a
# (1 + w) norm is stored as 1 + w (float32 addition) in every architecture; gemma2 / gemma3 files are read as (1 + w)
# norms, w = v - 1 (float32 subtraction), as llama.cpp's converter stores Gemma's: 1 + (v - 1) == v exactly for every
# stored v >= 0.5 (Sterbenz), so the model read computes with exactly the stored scales; w itself comes back exactly
# only when 1 + w was (|w| >= 2^-23 has its bits below 2^-23 rounded away).
def sliding_layers(cfg: ModelConfig) -> list[bool]:
    """Whether each layer of cfg slides."""
    return [cfg.attn_window is not None and (cfg.attn_window_layers is None or i in cfg.attn_window_layers)
            for i in range(cfg.n_layers)]


def pattern_layers(n: int, n_layers: int) -> list[bool]:
    """llama.cpp's set_swa_pattern(n): layers i with i % n < n - 1 slide (n = 0: every layer)."""
    return [n == 0 or i % n < n - 1 for i in range(n_layers)]


def nope_layers(row: GGUFArch, cfg: ModelConfig) -> list[int] | None:
    """The layers llama.cpp's architecture computes without RoPE for cfg, as ModelConfig.nope_layers: its fixed
    period, or (rope_sliding_only) the layers without a window when it has windows."""
    if row.rope_sliding_only:
        sliding = sliding_layers(cfg)
        return [i for i, s in enumerate(sliding) if not s] or None if any(sliding) else None
    return row.nope_layers(cfg.n_layers)


def attn_scale_dim(arch: str, d_model: int, n_heads: int, n_layers: int, head_dim: int) -> int:
    """The dimension llama.cpp's `arch` scales attention logits by 1/sqrt of."""
    row = ARCHS[arch]
    return d_model // n_heads if row.attn_scale_layers and n_layers == row.attn_scale_layers else head_dim


def window_keys(cfg: ModelConfig, arch: str) -> dict[str, tuple[str, Any]]:
    """{key template: (kind, value)} that give llama.cpp's `arch` cfg's sliding layers (section comment); what it
    cannot compute is gguf_export's to refuse first."""
    if ARCHS[arch].windows == "none":
        return {}
    g = gguf_module()
    att, rope = g.Keys.Attention, g.Keys.Rope
    sliding = sliding_layers(cfg)
    out: dict[str, tuple[str, Any]] = {}
    if cfg.attn_window is not None:
        out[att.SLIDING_WINDOW] = ("u32", cfg.attn_window)
    if (cfg.attn_window is not None or ARCHS[arch].windows == "always") and \
            sliding != pattern_layers(ARCHS[arch].window_pattern, cfg.n_layers):
        out[att.SLIDING_WINDOW_PATTERN] = ("bools", sliding)
    if any(sliding):
        out[rope.FREQ_BASE_SWA] = ("f32", float(cfg.window_rope_theta or cfg.rope_theta))
    return out


def windows_of(arch: str, fields: dict, base: ModelConfig) -> dict[str, Any]:
    """ModelConfig fields (attn_window, attn_window_layers, window_rope_theta) computing the sliding layers llama.cpp
    computes for this file, `base` its config without windows. Raises ValueError (one line) for what the runtime does
    not compute."""
    row = ARCHS[arch]
    if row.windows == "none" or (row.windows == "fixed" and base.n_layers != row.window_block_count):
        return {}
    g = gguf_module()
    att, rope = g.Keys.Attention, g.Keys.Rope
    window = metadata_value(fields, att.SLIDING_WINDOW.format(arch=arch), INTEGER, row.default_window, low=0)
    if window == 0:
        return {}
    n = base.n_layers
    key = att.SLIDING_WINDOW_PATTERN.format(arch=arch)
    if row.windows == "fixed":  # llama.cpp sets its own pattern, whatever the key
        sliding = pattern_layers(row.window_pattern, n)
    elif isinstance(fields.get(key, row.window_pattern), int):  # a layer period (set_swa_pattern), else a bool a layer
        sliding = pattern_layers(metadata_value(fields, key, INTEGER, row.window_pattern, low=0), n)
    else:
        sliding = metadata_value(fields, key, BOOLEANS, length=n, per="one per layer").tolist()
    if not any(sliding):
        return {}
    key = rope.FREQ_BASE_SWA.format(arch=arch)
    local = float(metadata_value(fields, key, NUMBER, base.rope_theta if row.window_rope == "global" else 10000.0))
    if local == base.rope_theta and (row.window_rope == "global" or base.scaled_rope is None):
        theta = None  # the sliding layers rotate as the others
    elif row.window_rope == "global" and base.scaled_rope is not None:
        raise ValueError(f"{key} {local:g} with scaled RoPE: llama.cpp's {arch} scales its sliding layers' RoPE of "
                         "another base, which the runtime does not compute")
    else:
        theta = local
    nope = [i for i, s in enumerate(sliding) if not s] or None
    return dict(attn_window=window, attn_window_layers=None if all(sliding) else
                [i for i, s in enumerate(sliding) if s], window_rope_theta=theta,
                **({"nope_layers": nope} if row.rope_sliding_only else {}))


def is_norm(canonical: str) -> bool:
    """An RMSNorm weight (of the final norm, a block's norms, a QK-norm); not a Gated DeltaNet's gated norm, which
    scales by w in every Qwen3.5."""
    return canonical.endswith("norm.weight") and ".linear." not in canonical


# ---- LINEAR: Qwen3.5's Gated DeltaNet layers (qwen35, qwen35moe) -----------------------------------------------
# Keys, as llama.cpp's converter writes them: ssm.conv_kernel (the convolution's width), ssm.state_size (the key head
# size), ssm.group_count (key heads), ssm.time_step_rank (value heads), ssm.inner_size (value heads x value head
# size), full_attention_interval n (layers i with (i + 1) % n != 0 are Gated DeltaNet layers: the only pattern
# llama.cpp builds), rope.dimension_sections [11, 11, 10, 0] (every section rotates by the token's position in text).
# Tensors, each a transform of the canonical one, exactly invertible but for ssm_a:
#   ssm_a = -exp(a_log) (the reader takes log(-ssm_a), to float32 rounding);
#   value heads reordered from grouped by key head (head k * r + m, r value heads per key head: the canonical
#   order, transformers') to tiled (m * Hk + k), in the rows of attn_qkv's values, attn_gate, ssm_beta,
#   ssm_alpha, ssm_dt, ssm_a and ssm_conv1d's value channels, and the columns of ssm_out.
MROPE_SECTIONS = [11, 11, 10, 0]


def linear_interval(cfg: ModelConfig) -> int | None:
    """The full_attention_interval n whose layers (i + 1) % n != 0 are cfg's Gated DeltaNet layers, or None."""
    linear = cfg.linear_layers or []
    for n in range(2, cfg.n_layers + 1):
        if linear == [i for i in range(cfg.n_layers) if (i + 1) % n]:
            return n
    return None


def linear_keys(cfg: ModelConfig) -> dict[str, tuple[str, Any]]:
    g = gguf_module()
    ssm, llm, rope = g.Keys.SSM, g.Keys.LLM, g.Keys.Rope
    return {ssm.CONV_KERNEL: ("u32", cfg.linear_conv), ssm.STATE_SIZE: ("u32", cfg.linear_key_dim),
            ssm.GROUP_COUNT: ("u32", cfg.linear_key_heads), ssm.TIME_STEP_RANK: ("u32", cfg.linear_value_heads),
            ssm.INNER_SIZE: ("u32", cfg.linear_value_heads * cfg.linear_value_dim),
            llm.FULL_ATTENTION_INTERVAL: ("u32", linear_interval(cfg) or 0),
            rope.DIMENSION_SECTIONS: ("u32s", MROPE_SECTIONS)}


def linear_fields(arch: str, fields: dict, n_layers: int) -> dict[str, Any]:
    """The ModelConfig fields of a qwen35 / qwen35moe file's Gated DeltaNet layers (ValueError, one line, for keys
    that give none)."""
    g = gguf_module()
    ssm, llm = g.Keys.SSM, g.Keys.LLM
    keys = {k: metadata_value(fields, k.format(arch=arch), INTEGER, low=1)
            for k in (ssm.CONV_KERNEL, ssm.STATE_SIZE, ssm.GROUP_COUNT, ssm.TIME_STEP_RANK, ssm.INNER_SIZE)}
    interval = metadata_value(fields, llm.FULL_ATTENTION_INTERVAL.format(arch=arch), INTEGER, 4, low=1)  # llama.cpp's
    heads = keys[ssm.TIME_STEP_RANK]
    if keys[ssm.INNER_SIZE] % heads:
        raise ValueError(f"{ssm.INNER_SIZE.format(arch=arch)} {keys[ssm.INNER_SIZE]} is not a multiple of the "
                         f"{heads} value heads")
    return dict(linear_layers=[i for i in range(n_layers) if (i + 1) % interval] or None,
                linear_conv=keys[ssm.CONV_KERNEL], linear_key_dim=keys[ssm.STATE_SIZE],
                linear_key_heads=keys[ssm.GROUP_COUNT], linear_value_heads=heads,
                linear_value_dim=keys[ssm.INNER_SIZE] // heads, attn_output_gate=True)


def _v_heads(t: torch.Tensor, dim: int, cfg: ModelConfig, size: int, tiled: bool) -> torch.Tensor:
    """Value heads along `dim` (each `size` wide) from grouped to tiled order, or back."""
    Hk, r = cfg.linear_key_heads, cfg.linear_value_heads // cfg.linear_key_heads
    if r == 1:
        return t
    shape = list(t.shape)
    groups = [Hk, r] if tiled else [r, Hk]
    t = t.reshape(*shape[:dim], *groups, size, *shape[dim + 1:])
    return t.transpose(dim, dim + 1).reshape(shape)


_LINEAR_PART = {"qkv.weight": (0, "v"), "conv.weight": (0, "v"), "z.weight": (0, "dv"), "b.weight": (0, 1),
                "a.weight": (0, 1), "dt.bias": (0, 1), "a_log.weight": (0, 1), "out.weight": (1, "dv")}


def linear_tensor(canonical: str, t: torch.Tensor, cfg: ModelConfig, to_gguf: bool) -> torch.Tensor:
    """A Gated DeltaNet tensor as llama.cpp holds it (to_gguf) or back (the LINEAR section); others unchanged."""
    if ".linear." not in canonical:
        return t
    kind = canonical.split(".linear.", 1)[1]
    if kind == "a_log.weight" and not to_gguf:
        t = torch.log(-t.to(torch.float32))
    if kind in _LINEAR_PART:
        dim, size = _LINEAR_PART[kind]
        if size == "v":  # the value channels after q and k
            qk = 2 * cfg.linear_key_heads * cfg.linear_key_dim
            t = torch.cat((t[:qk], _v_heads(t[qk:], 0, cfg, cfg.linear_value_dim, to_gguf)))
        else:
            t = _v_heads(t, dim, cfg, cfg.linear_value_dim if size == "dv" else size, to_gguf)
    if kind == "a_log.weight" and to_gguf:
        t = -torch.exp(t.to(torch.float32))
    return t



# ---- GEMMA4: Gemma 4's layers (gemma4) -------------------------------------------------------------------------
# Keys, as llama.cpp's converter writes them: attention.key_length / value_length the global layers' head size,
# key_length_swa / value_length_swa the window layers'; rope.dimension_count the global head size (proportional RoPE:
# the rope_freqs tensor, 1 for the rotated pairs, UNROTATED for the others) and dimension_count_swa the window
# layers' rotated dims; attention.head_count_kv one per layer where the global layers' kv heads differ;
# feed_forward_length one per layer where the K/V-sharing layers' MLP is double-wide; attention.shared_kv_layers;
# embedding_length_per_layer_input. The attention scale (1), the value norm, the block scale and K = V (a global
# layer without attn_v) are llama.cpp's gemma4 graph's own.
def geometry_keys(cfg: ModelConfig) -> dict[str, tuple[str, Any]]:
    g = gguf_module()
    llm, att, rope = g.Keys.LLM, g.Keys.Attention, g.Keys.Rope
    full = cfg.global_head_dim or cfg.head_dim
    kv = [cfg.layer_kv_heads(i) for i in range(cfg.n_layers)]
    ffn = [cfg.layer_ffn_hidden(i) for i in range(cfg.n_layers)]
    return {att.KEY_LENGTH: ("u32", full), att.VALUE_LENGTH: ("u32", full),
            att.KEY_LENGTH_SWA: ("u32", cfg.head_dim), att.VALUE_LENGTH_SWA: ("u32", cfg.head_dim),
            rope.DIMENSION_COUNT: ("u32", cfg.global_rotary_dim), rope.DIMENSION_COUNT_SWA: ("u32", cfg.rotary_dim),
            att.HEAD_COUNT_KV: ("u32s", kv) if len(set(kv)) > 1 else ("u32", kv[0]),
            llm.FEED_FORWARD_LENGTH: ("u32s", ffn) if len(set(ffn)) > 1 else ("u32", ffn[0]),
            att.SHARED_KV_LAYERS: ("u32", cfg.kv_shared_layers),
            llm.EMBD_LENGTH_PER_LAYER_INP: ("u32", cfg.per_layer_dim)}


def geometry_fields(arch: str, fields: dict, has: set[str]) -> tuple[dict[str, Any], set[str]]:
    """(ModelConfig fields of a gemma4 file's layers, the keys they come from: the generic reading skips them), from
    its keys and tensor names `has`. ValueError (one line) for keys that give none."""
    g = gguf_module()
    llm, att, rope = g.Keys.LLM, g.Keys.Attention, g.Keys.Rope

    def key(template: str, *default: int) -> int:  # no default: required
        return metadata_value(fields, template.format(arch=arch), INTEGER, *default, low=0)

    def per_layer(template: str) -> list[int]:  # one value, or one per layer
        name = template.format(arch=arch)
        if isinstance(fields.get(name), (list, np.ndarray)):
            return [int(v) for v in metadata_value(fields, name, INTEGERS, length=n_layers, per="one per layer")]
        return [key(template)] * n_layers

    n_layers = key(llm.BLOCK_COUNT)
    full, swa = key(att.KEY_LENGTH), key(att.KEY_LENGTH_SWA)
    kv, ffn = per_layer(att.HEAD_COUNT_KV), per_layer(llm.FEED_FORWARD_LENGTH)
    shared = key(att.SHARED_KV_LAYERS, 0)
    pattern = metadata_value(fields, att.SLIDING_WINDOW_PATTERN.format(arch=arch), BOOLEANS, None)
    window = [bool(p) for p in pattern] if pattern is not None and len(pattern) == n_layers else [False] * n_layers
    swa_kv = next((k for k, w in zip(kv, window) if w), kv[0])
    full_kv = next((k for k, w in zip(kv, window) if not w), kv[0])
    owners = [i for i in range(n_layers - shared) if not window[i]]
    k_eq_v = bool(owners) and all(f"blk.{i}.attn_v.weight" not in has for i in owners)
    out = dict(head_dim=swa, global_head_dim=full if full != swa else None, n_kv_heads=swa_kv,
               global_kv_heads=full_kv if full_kv != swa_kv else None, global_k_eq_v=k_eq_v, ffn_hidden=ffn[0],
               kv_shared_layers=shared, kv_shared_ffn_hidden=ffn[-1] if ffn[-1] != ffn[0] else None,
               per_layer_dim=key(llm.EMBD_LENGTH_PER_LAYER_INP, 0), attn_scale_dim=1, v_norm=True, layer_scale=True,
               rotary_fraction=key(rope.DIMENSION_COUNT_SWA, swa) / swa if swa else 1.0)
    consumed = {k.format(arch=arch) for k in (att.KEY_LENGTH, att.VALUE_LENGTH, att.HEAD_COUNT_KV,
                                               llm.FEED_FORWARD_LENGTH, rope.DIMENSION_COUNT)}
    return out, consumed


def proportional_of(freqs: np.ndarray | None) -> dict | None:
    """Gemma 4's proportional RoPE from its rope_freqs (1: rotated, UNROTATED: not), or None without the tensor."""
    if freqs is None:
        return None
    rotated = int((freqs == 1.0).sum())
    if not np.all(freqs[:rotated] == 1.0) or not np.all(freqs[rotated:] >= UNROTATED / 10):
        raise ValueError("rope_freqs is not Gemma 4's proportional RoPE (ones, then factors of 1e30)")
    return {"rope_type": "proportional", "partial_rotary_factor": rotated / len(freqs)}
