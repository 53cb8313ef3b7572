"""llama.cpp's names for canonical tensors and config fields: one table, read both ways.

The GGUF export (gguf_export.py) runs it canonical -> GGUF, the GGUF reader (gguf_reader.py) GGUF -> canonical; neither
spells a name or a key of its own.

  TENSORS   canonical prefix ("layers.{}.attn.q") <-> gguf.MODEL_TENSOR member (ATTN_Q: "blk.{bid}.attn_q"), with the
            suffixes it takes (weight, bias); a row applies to an architecture when llama.cpp lists the member for it
            (gguf.MODEL_TENSORS), so `tensor_names(arch, n_layers)` is the whole map of one architecture.
  HPARAMS   {arch}.* metadata key (gguf.Keys) <-> ModelConfig field, in the order the export writes them; `when` says
            which configs carry a key (the experts' keys only for mixtures).
  ARCHS     what each llama.cpp architecture computes beyond the tensors: whether it rotates pairs of dimensions
            (llama: the Q/K rows of a rotate-halves model are permuted per head, ROPE_PAIRS, exactly invertible),
            how it gates a mixture (llama: top-k renormalized, Mixtral's; qwen2moe: the softmax over all experts), and
            whether it loads a tied embedding as output.weight once more (qwen2moe).

A new architecture is a row of ARCHS (and its new tensors rows of TENSORS, its new keys rows of HPARAMS); the export
decides which architecture a config becomes (gguf_export.gguf_architecture), the reader takes any row.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from bam_surgery.runtime.config import ModelConfig


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


_WB = ("weight", "bias")
TENSORS = (
    TensorRow("embed", "TOKEN_EMBD"),
    TensorRow("final_norm", "OUTPUT_NORM"),
    TensorRow("lm_head", "OUTPUT"),
    TensorRow("layers.{}.attn_norm", "ATTN_NORM"),
    TensorRow("layers.{}.ffn_norm", "FFN_NORM"),
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
        if tensor not in known:
            continue
        layers = range(n_layers) if "{}" in row.canonical else [None]
        for i in layers:
            base, canonical = g.TENSOR_NAMES[tensor].format(bid=i), row.canonical.format(i)
            for suffix in row.suffixes:
                out[f"{canonical}.{suffix}"] = f"{base}.{suffix}"
    return out


@dataclass(frozen=True)
class HParam:
    key: str  # a gguf.Keys template ("{arch}.context_length")
    kind: str  # "u32" or "f32"
    field: str  # the ModelConfig field (or property: rotary_dim)
    when: Callable[[ModelConfig], bool] = lambda cfg: True


def _keys():
    g = gguf_module()
    return g.Keys.LLM, g.Keys.Attention, g.Keys.Rope


def hparams() -> tuple[HParam, ...]:
    """The architecture's keys llama.cpp reads, as convert_hf_to_gguf.py writes them, in that order."""
    llm, att, rope = _keys()
    return (
        HParam(llm.VOCAB_SIZE, "u32", "vocab_size"),
        HParam(llm.CONTEXT_LENGTH, "u32", "max_positions"),
        HParam(llm.EMBEDDING_LENGTH, "u32", "d_model"),
        HParam(llm.BLOCK_COUNT, "u32", "n_layers"),
        HParam(llm.FEED_FORWARD_LENGTH, "u32", "ffn_hidden"),
        HParam(att.HEAD_COUNT, "u32", "n_heads"),
        HParam(att.HEAD_COUNT_KV, "u32", "n_kv_heads"),
        HParam(att.KEY_LENGTH, "u32", "head_dim"),
        HParam(att.VALUE_LENGTH, "u32", "head_dim"),
        HParam(rope.DIMENSION_COUNT, "u32", "rotary_dim"),
        HParam(rope.FREQ_BASE, "f32", "rope_theta"),
        HParam(att.LAYERNORM_RMS_EPS, "f32", "norm_eps"),
        HParam(llm.EXPERT_COUNT, "u32", "ffn_experts", lambda cfg: bool(cfg.ffn_experts)),
        HParam(llm.EXPERT_USED_COUNT, "u32", "ffn_top_k", lambda cfg: bool(cfg.ffn_experts)),
        HParam(llm.EXPERT_FEED_FORWARD_LENGTH, "u32", "ffn_hidden", lambda cfg: bool(cfg.ffn_shared_hidden)),
        HParam(llm.EXPERT_SHARED_FEED_FORWARD_LENGTH, "u32", "ffn_shared_hidden",
               lambda cfg: bool(cfg.ffn_shared_hidden)),
    )


@dataclass(frozen=True)
class GGUFArch:
    name: str
    rope_pairs: bool  # rotates pairs of dimensions (LLAMA_ROPE_TYPE_NORM): rotate-halves Q/K rows permuted
    gate_norm: str | None  # the mixture gates its graph computes; None: no mixture
    hf_dense: str | None  # the HF model_type of a dense model of this architecture (converters/hf/architectures.py)
    hf_mixture: str | None  # ... of a mixture
    output_always: bool = False  # loads output.weight even for tied embeddings


ARCHS = {
    "llama": GGUFArch("llama", rope_pairs=True, gate_norm="topk_softmax", hf_dense="llama", hf_mixture="mixtral"),
    "qwen2": GGUFArch("qwen2", rope_pairs=False, gate_norm=None, hf_dense="qwen2", hf_mixture=None),
    "qwen2moe": GGUFArch("qwen2moe", rope_pairs=False, gate_norm="softmax", hf_dense=None, hf_mixture="qwen2_moe",
                         output_always=True),
}
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
