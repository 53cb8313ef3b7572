"""One weight-mapping table per Hugging Face architecture, registered by config.json's model_type.

A table row (`WeightRule`) says: these HF tensors <-> these canonical tensors, through this named
reshape op. `{}` in a name is the layer index; `{e}` in an HF name the expert index, expanded to one
HF tensor per FFN expert (Mixtral's experts, stacked into one canonical [E, ...] tensor by STACK).
Import runs `op.forward`; export runs `op.inverse` over the same rows, so the canonical -> HF
direction is never written by hand.

Which rows apply depends on the config (bias rows only when the config has biases, lm_head only
when embeddings are untied): a row is active when all its canonical tensors are in
`runtime.layout.tensor_shapes(cfg)`. `bind` checks that the active rows produce every canonical
tensor exactly once. Rows whose canonical side is None are HF buffers dropped on purpose.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from bam_surgery.runtime.config import ModelConfig
from bam_surgery.runtime.layout import tensor_shapes

from ..base import CapabilityError
from . import config_map as cm
from .mixtral_config import MIXTRAL
from .qk_norm_moe_config import FLEX_OLMO, QWEN3_MOE
from .qwen2_moe_config import QWEN2_MOE
from .qwen3_5_moe_config import QWEN3_5_MOE
from .ops import (CONV1D_SPLIT_QKV, DEPTHWISE_CONV, DROP, IDENTITY, SPLIT_GATE_UP, SPLIT_QKV, SPLIT_QKV_PER_HEAD,
                  SPLIT_QUERY_GATE, STACK, TRANSPOSE, ReshapeOp)


@dataclass(frozen=True)
class WeightRule:
    hf: tuple[str, ...]  # HF name templates
    canonical: tuple[str, ...]  # canonical name templates; () = dropped on purpose
    op: ReshapeOp = IDENTITY
    tied_alias: bool = False  # the HF lm_head that duplicates tied embeddings: accepted, dropped, not written
    # where the config has no use for it, an HF tensor some checkpoints still carry (Gemma 4's K/V projections in
    # the layers that read another layer's): accepted there, dropped, not written
    optional: bool = False

    @property
    def per_layer(self) -> bool:
        return any("{}" in n for n in self.hf + self.canonical)

    @property
    def per_expert(self) -> bool:
        return any("{e}" in n for n in self.hf)


def w(hf: str | tuple[str, ...], canonical: str | tuple[str, ...] | None, op: ReshapeOp = IDENTITY) -> WeightRule:
    """A table row; canonical None = an HF tensor dropped on purpose (a buffer the model rebuilds)."""
    as_tuple = lambda x: (x,) if isinstance(x, str) else tuple(x)  # noqa: E731
    if canonical is None:
        return WeightRule(as_tuple(hf), (), DROP)
    return WeightRule(as_tuple(hf), as_tuple(canonical), op)


def lm_head(hf: str = "lm_head.weight") -> WeightRule:
    return WeightRule((hf,), ("lm_head.weight",), IDENTITY, tied_alias=True)


def linear(hf_prefix: str, canonical_prefix: str, op: ReshapeOp = IDENTITY) -> list[WeightRule]:
    """weight and (when the config has one) bias of one projection."""
    return [w(f"{hf_prefix}.weight", f"{canonical_prefix}.weight", op),
            w(f"{hf_prefix}.bias", f"{canonical_prefix}.bias")]


def qkv(hf_attn: str, names: tuple[str, str, str] = ("q_proj", "k_proj", "v_proj")) -> list[WeightRule]:
    out: list[WeightRule] = []
    for hf_name, c in zip(names, "qkv"):
        out += linear(f"{hf_attn}.{hf_name}", f"layers.{{}}.attn.{c}")
    return out


@dataclass(frozen=True)
class Architecture:
    model_type: str
    hf_class: str  # config.json "architectures" entry written on export
    base_prefix: str  # prefix of the base model inside the *ForCausalLM (checkpoints of the base model lack it)
    weights: tuple[WeightRule, ...]
    config: cm.ConfigMap
    # other spellings of an HF name prefix, accepted on import (export writes the table's spelling)
    alias_prefixes: Mapping[str, str] = field(default_factory=dict)

    @property
    def mixture(self) -> bool:
        """An architecture with FFN experts (Mixtral); the others are dense."""
        return any(r.per_expert for r in self.weights)


# ---- tables ---------------------------------------------------------------------------------
_LLAMA_WEIGHTS = tuple([
    w("model.embed_tokens.weight", "embed.weight"),
    w("model.layers.{}.input_layernorm.weight", "layers.{}.attn_norm.weight"),
    w("model.layers.{}.post_attention_layernorm.weight", "layers.{}.ffn_norm.weight"),
    *qkv("model.layers.{}.self_attn"),
    *linear("model.layers.{}.self_attn.o_proj", "layers.{}.attn.o"),
    *linear("model.layers.{}.mlp.gate_proj", "layers.{}.ffn.gate"),
    *linear("model.layers.{}.mlp.up_proj", "layers.{}.ffn.up"),
    *linear("model.layers.{}.mlp.down_proj", "layers.{}.ffn.down"),
    w("model.layers.{}.self_attn.rotary_emb.inv_freq", None),  # buffer in older checkpoints
    w("model.norm.weight", "final_norm.weight"),
    lm_head(),
])

_GPT_NEOX_WEIGHTS = (
    w("gpt_neox.embed_in.weight", "embed.weight"),
    *linear("gpt_neox.layers.{}.input_layernorm", "layers.{}.attn_norm"),
    *linear("gpt_neox.layers.{}.post_attention_layernorm", "layers.{}.ffn_norm"),
    # [H*3*Dh, D], rows per head (q, k, v)
    w("gpt_neox.layers.{}.attention.query_key_value.weight",
      ("layers.{}.attn.q.weight", "layers.{}.attn.k.weight", "layers.{}.attn.v.weight"), SPLIT_QKV_PER_HEAD),
    w("gpt_neox.layers.{}.attention.query_key_value.bias",
      ("layers.{}.attn.q.bias", "layers.{}.attn.k.bias", "layers.{}.attn.v.bias"), SPLIT_QKV_PER_HEAD),
    *linear("gpt_neox.layers.{}.attention.dense", "layers.{}.attn.o"),
    *linear("gpt_neox.layers.{}.mlp.dense_h_to_4h", "layers.{}.ffn.up"),
    *linear("gpt_neox.layers.{}.mlp.dense_4h_to_h", "layers.{}.ffn.down"),
    w("gpt_neox.layers.{}.attention.rotary_emb.inv_freq", None),  # buffers in older (Pythia) checkpoints
    w("gpt_neox.layers.{}.attention.bias", None),
    w("gpt_neox.layers.{}.attention.masked_bias", None),
    *linear("gpt_neox.final_layer_norm", "final_norm"),
    lm_head("embed_out.weight"),  # the name on disk, for transformers 4 and 5 alike
)

_GPT2_WEIGHTS = (
    w("transformer.wte.weight", "embed.weight"),
    w("transformer.wpe.weight", "pos_embed.weight"),
    *linear("transformer.h.{}.ln_1", "layers.{}.attn_norm"),
    *linear("transformer.h.{}.ln_2", "layers.{}.ffn_norm"),
    # Conv1D weights are [in, out]; c_attn is [D, 3D] with columns [q | k | v]
    w("transformer.h.{}.attn.c_attn.weight",
      ("layers.{}.attn.q.weight", "layers.{}.attn.k.weight", "layers.{}.attn.v.weight"), CONV1D_SPLIT_QKV),
    w("transformer.h.{}.attn.c_attn.bias",
      ("layers.{}.attn.q.bias", "layers.{}.attn.k.bias", "layers.{}.attn.v.bias"), SPLIT_QKV),
    *linear("transformer.h.{}.attn.c_proj", "layers.{}.attn.o", TRANSPOSE),
    *linear("transformer.h.{}.mlp.c_fc", "layers.{}.ffn.up", TRANSPOSE),
    *linear("transformer.h.{}.mlp.c_proj", "layers.{}.ffn.down", TRANSPOSE),
    w("transformer.h.{}.attn.bias", None),  # causal-mask buffers in older checkpoints
    w("transformer.h.{}.attn.masked_bias", None),
    *linear("transformer.ln_f", "final_norm"),
    lm_head(),
)

_COHERE_WEIGHTS = (
    w("model.embed_tokens.weight", "embed.weight"),
    w("model.layers.{}.input_layernorm.weight", "layers.{}.attn_norm.weight"),  # the one shared norm
    *qkv("model.layers.{}.self_attn"),
    *linear("model.layers.{}.self_attn.o_proj", "layers.{}.attn.o"),
    w("model.layers.{}.mlp.gate_proj.weight", "layers.{}.ffn.gate.weight"),
    w("model.layers.{}.mlp.up_proj.weight", "layers.{}.ffn.up.weight"),
    w("model.layers.{}.mlp.down_proj.weight", "layers.{}.ffn.down.weight"),
    w("model.layers.{}.self_attn.rotary_emb.inv_freq", None),
    w("model.norm.weight", "final_norm.weight"),
    lm_head(),
)

_PHI_WEIGHTS = (
    w("model.embed_tokens.weight", "embed.weight"),
    *linear("model.layers.{}.input_layernorm", "layers.{}.attn_norm"),  # the one shared norm
    *qkv("model.layers.{}.self_attn"),
    *linear("model.layers.{}.self_attn.dense", "layers.{}.attn.o"),
    *linear("model.layers.{}.mlp.fc1", "layers.{}.ffn.up"),
    *linear("model.layers.{}.mlp.fc2", "layers.{}.ffn.down"),
    w("model.layers.{}.self_attn.rotary_emb.inv_freq", None),
    *linear("model.final_layernorm", "final_norm"),
    lm_head(),
    w("lm_head.bias", "lm_head.bias"),
)

# Qwen3 and SmolLM3: the Llama names; Qwen3's per-head QK-norm (absent from configs without one: rows that do not
# apply are inactive)
_QK_NORM_ROWS = (w("model.layers.{}.self_attn.q_norm.weight", "layers.{}.attn.q_norm.weight"),
                 w("model.layers.{}.self_attn.k_norm.weight", "layers.{}.attn.k_norm.weight"))
_QWEN3_WEIGHTS = _LLAMA_WEIGHTS[:-2] + _QK_NORM_ROWS + _LLAMA_WEIGHTS[-2:]

# Phi-3: one fused qkv_proj [q; k; v] and one gate_up_proj [gate; up]
_PHI3_WEIGHTS = (
    w("model.embed_tokens.weight", "embed.weight"),
    w("model.layers.{}.input_layernorm.weight", "layers.{}.attn_norm.weight"),
    w("model.layers.{}.post_attention_layernorm.weight", "layers.{}.ffn_norm.weight"),
    w("model.layers.{}.self_attn.qkv_proj.weight",
      ("layers.{}.attn.q.weight", "layers.{}.attn.k.weight", "layers.{}.attn.v.weight"), SPLIT_QKV),
    w("model.layers.{}.self_attn.o_proj.weight", "layers.{}.attn.o.weight"),
    w("model.layers.{}.mlp.gate_up_proj.weight", ("layers.{}.ffn.gate.weight", "layers.{}.ffn.up.weight"),
      SPLIT_GATE_UP),
    w("model.layers.{}.mlp.down_proj.weight", "layers.{}.ffn.down.weight"),
    w("model.norm.weight", "final_norm.weight"),
    lm_head(),
)

# OLMo 2: post_attention_layernorm is the norm AFTER attention (not before the FFN, as in Llama); no input norm
_OLMO2_WEIGHTS = (
    w("model.embed_tokens.weight", "embed.weight"),
    *qkv("model.layers.{}.self_attn"),
    *linear("model.layers.{}.self_attn.o_proj", "layers.{}.attn.o"),
    *_QK_NORM_ROWS,
    w("model.layers.{}.post_attention_layernorm.weight", "layers.{}.attn_post_norm.weight"),
    w("model.layers.{}.mlp.gate_proj.weight", "layers.{}.ffn.gate.weight"),
    w("model.layers.{}.mlp.up_proj.weight", "layers.{}.ffn.up.weight"),
    w("model.layers.{}.mlp.down_proj.weight", "layers.{}.ffn.down.weight"),
    w("model.layers.{}.post_feedforward_layernorm.weight", "layers.{}.ffn_post_norm.weight"),
    w("model.norm.weight", "final_norm.weight"),
    lm_head(),
)


def _moe_rows(moe: str, router: str, expert: tuple[str, str, str]) -> tuple[WeightRule, ...]:
    """The router at model.layers.{}.MOE.ROUTER and the experts at MOE.experts.{e}.NAME (gate, up, down names)."""
    m = f"model.layers.{{}}.{moe}"
    return (w(f"{m}.{router}.weight", "layers.{}.ffn_router.weight"),
            *[w(f"{m}.experts.{{e}}.{name}.weight", f"layers.{{}}.ffn_experts.{proj}.weight", STACK)
              for name, proj in zip(expert, ("gate", "up", "down"))])


# Gemma 2 and 3: sandwich norms (input, post-attention, pre- and post-feedforward), Gemma 3's per-head QK-norm
_GEMMA_WEIGHTS = (
    w("model.embed_tokens.weight", "embed.weight"),
    w("model.layers.{}.input_layernorm.weight", "layers.{}.attn_norm.weight"),
    w("model.layers.{}.post_attention_layernorm.weight", "layers.{}.attn_post_norm.weight"),
    w("model.layers.{}.pre_feedforward_layernorm.weight", "layers.{}.ffn_norm.weight"),
    w("model.layers.{}.post_feedforward_layernorm.weight", "layers.{}.ffn_post_norm.weight"),
    *qkv("model.layers.{}.self_attn"),
    *linear("model.layers.{}.self_attn.o_proj", "layers.{}.attn.o"),
    *_QK_NORM_ROWS,
    w("model.layers.{}.mlp.gate_proj.weight", "layers.{}.ffn.gate.weight"),
    w("model.layers.{}.mlp.up_proj.weight", "layers.{}.ffn.up.weight"),
    w("model.layers.{}.mlp.down_proj.weight", "layers.{}.ffn.down.weight"),
    w("model.norm.weight", "final_norm.weight"),
    lm_head(),
)


# Qwen3.5 (text): Qwen3's names, q_proj holding each head's query and output gate, (1 + w) norms; Gated DeltaNet
# layers (linear_attn) in place of self_attn where layer_types says linear_attention (rows of the layers a config
# lacks are inactive)
_QWEN3_5_WEIGHTS = (
    w("model.embed_tokens.weight", "embed.weight"),
    w("model.layers.{}.input_layernorm.weight", "layers.{}.attn_norm.weight"),
    w("model.layers.{}.post_attention_layernorm.weight", "layers.{}.ffn_norm.weight"),
    *[w(f"model.layers.{{}}.self_attn.q_proj.{p}", (f"layers.{{}}.attn.q.{p}", f"layers.{{}}.attn.gate.{p}"),
        SPLIT_QUERY_GATE) for p in ("weight", "bias")],
    *qkv("model.layers.{}.self_attn")[2:],
    *linear("model.layers.{}.self_attn.o_proj", "layers.{}.attn.o"),
    *_QK_NORM_ROWS,
    *[w(f"model.layers.{{}}.linear_attn.{hf}", f"layers.{{}}.linear.{ours}") for hf, ours in (
        ("in_proj_qkv.weight", "qkv.weight"), ("in_proj_z.weight", "z.weight"), ("in_proj_b.weight", "b.weight"),
        ("in_proj_a.weight", "a.weight"), ("dt_bias", "dt.bias"), ("A_log", "a_log.weight"),
        ("norm.weight", "norm.weight"), ("out_proj.weight", "out.weight"))],
    w("model.layers.{}.linear_attn.conv1d.weight", "layers.{}.linear.conv.weight", DEPTHWISE_CONV),
    *_LLAMA_WEIGHTS[11:17],  # mlp gate, up, down (weights and biases)
    w("model.norm.weight", "final_norm.weight"),
    lm_head(),
)

# Gemma 4 (text): Gemma 3's names, the per-layer inputs (embed_tokens_per_layer, per_layer_model_projection and its
# norm; per layer the gate, projection and norm), each layer's layer_scalar; no k/v (or v) where the layer reads
# another's K/V (or K = V): such K/V tensors in a checkpoint are dropped
_GEMMA4_WEIGHTS = (
    w("model.embed_tokens.weight", "embed.weight"),
    w("model.embed_tokens_per_layer.weight", "ple_embed.weight"),
    w("model.per_layer_model_projection.weight", "ple_proj.weight"),
    w("model.per_layer_projection_norm.weight", "ple_proj_norm.weight"),
    *(r for r in _GEMMA_WEIGHTS[1:-2] if not any(".attn.k" in c or ".attn.v" in c for c in r.canonical)),
    *(WeightRule(r.hf, r.canonical, r.op, optional=True) for r in _GEMMA_WEIGHTS
      if any(".attn.k" in c or ".attn.v" in c for c in r.canonical)),
    w("model.layers.{}.per_layer_input_gate.weight", "layers.{}.ple.gate.weight"),
    w("model.layers.{}.per_layer_projection.weight", "layers.{}.ple.out.weight"),
    w("model.layers.{}.post_per_layer_input_norm.weight", "layers.{}.ple_norm.weight"),
    w("model.layers.{}.layer_scalar", "layers.{}.layer_scale.weight"),
    *_GEMMA_WEIGHTS[-2:],
)


def _moe_weights(attention: list[WeightRule], moe: str, router: str, expert: tuple[str, str, str],
                 shared: tuple[WeightRule, ...] = ()) -> tuple[WeightRule, ...]:
    """A Llama-family mixture's table: the Llama trunk with `attention`'s rows, the router and experts (_moe_rows),
    then any shared-expert rows."""
    return (
        w("model.embed_tokens.weight", "embed.weight"),
        w("model.layers.{}.input_layernorm.weight", "layers.{}.attn_norm.weight"),
        w("model.layers.{}.post_attention_layernorm.weight", "layers.{}.ffn_norm.weight"),
        *attention,
        *_moe_rows(moe, router, expert),
        *shared,
        w("model.norm.weight", "final_norm.weight"),
        lm_head(),
    )


def _with_experts(dense: tuple[WeightRule, ...]) -> tuple[WeightRule, ...]:
    """A dense table whose FFN rows become a router and experts in Qwen2-MoE's names (mlp.gate, mlp.experts.{e}.*_proj;
    Qwen3-MoE and FlexOlmo take them)."""
    trunk = tuple(r for r in dense if not any(".ffn." in c for c in r.canonical))
    return trunk + _moe_rows("mlp", "gate", ("gate_proj", "up_proj", "down_proj"))


# the always-on shared expert and its sigmoid gate (Qwen2-MoE, Qwen3.5-MoE)
_SHARED_EXPERT_ROWS = (*[w(f"model.layers.{{}}.mlp.shared_expert.{p}_proj.weight", f"layers.{{}}.ffn_shared.{p}.weight")
                         for p in ("gate", "up", "down")],
                       w("model.layers.{}.mlp.shared_expert_gate.weight", "layers.{}.ffn_shared_gate.weight"))

# Mixtral: the Llama names, with a routed FFN of E experts (w1 = gate, w3 = up, w2 = down), no biases.
_MIXTRAL_WEIGHTS = _moe_weights(
    [w(f"model.layers.{{}}.self_attn.{p}_proj.weight", f"layers.{{}}.attn.{p}.weight") for p in "qkvo"],
    "block_sparse_moe", "gate", ("w1", "w3", "w2"))

# Qwen2-MoE: the Llama names with q/k/v biases, a routed FFN (mlp.experts.{e}) and an always-on shared expert with
# its sigmoid gate. The exporter gives models without q/k/v biases zero ones (converters/qwen2_moe.py).
_QWEN2_MOE_WEIGHTS = _moe_weights(
    [*qkv("model.layers.{}.self_attn"), w("model.layers.{}.self_attn.o_proj.weight", "layers.{}.attn.o.weight")],
    "mlp", "gate", ("gate_proj", "up_proj", "down_proj"),
    shared=_SHARED_EXPERT_ROWS)

# Qwen3-MoE: Qwen3's trunk (per-head QK-norm, q/k/v/o biases when attention_bias) with experts; FlexOlmo: OLMo 2's
# (post-norms, full-width QK-norm) with experts.
_QWEN3_MOE_WEIGHTS = _with_experts(_QWEN3_WEIGHTS)
_FLEX_OLMO_WEIGHTS = _with_experts(_OLMO2_WEIGHTS)
_QWEN3_5_MOE_WEIGHTS = _with_experts(_QWEN3_5_WEIGHTS) + _SHARED_EXPERT_ROWS  # Qwen3.5's trunk, Qwen2-MoE's experts

ARCHITECTURES: dict[str, Architecture] = {a.model_type: a for a in (
    Architecture("llama", "LlamaForCausalLM", "model.", _LLAMA_WEIGHTS, cm.LLAMA),
    Architecture("mistral", "MistralForCausalLM", "model.", _LLAMA_WEIGHTS, cm.MISTRAL),
    Architecture("qwen2", "Qwen2ForCausalLM", "model.", _LLAMA_WEIGHTS, cm.QWEN2),
    Architecture("gpt_neox", "GPTNeoXForCausalLM", "gpt_neox.", _GPT_NEOX_WEIGHTS, cm.GPT_NEOX,
                 alias_prefixes={"lm_head.": "embed_out."}),  # transformers 5's in-memory name
    Architecture("gpt2", "GPT2LMHeadModel", "transformer.", _GPT2_WEIGHTS, cm.GPT2),
    Architecture("cohere", "CohereForCausalLM", "model.", _COHERE_WEIGHTS, cm.COHERE),
    Architecture("phi", "PhiForCausalLM", "model.", _PHI_WEIGHTS, cm.PHI),
    Architecture("qwen3", "Qwen3ForCausalLM", "model.", _QWEN3_WEIGHTS, cm.QWEN3),
    Architecture("phi3", "Phi3ForCausalLM", "model.", _PHI3_WEIGHTS, cm.PHI3),
    Architecture("olmo2", "Olmo2ForCausalLM", "model.", _OLMO2_WEIGHTS, cm.OLMO2),
    Architecture("olmo3", "Olmo3ForCausalLM", "model.", _OLMO2_WEIGHTS, cm.OLMO3),
    Architecture("smollm3", "SmolLM3ForCausalLM", "model.", _LLAMA_WEIGHTS, cm.SMOLLM3),
    Architecture("gemma2", "Gemma2ForCausalLM", "model.", _GEMMA_WEIGHTS, cm.GEMMA2),
    Architecture("gemma3_text", "Gemma3ForCausalLM", "model.", _GEMMA_WEIGHTS, cm.GEMMA3_TEXT),
    Architecture("qwen3_5_text", "Qwen3_5ForCausalLM", "model.", _QWEN3_5_WEIGHTS, cm.QWEN3_5_TEXT),
    Architecture("gemma4_text", "Gemma4ForCausalLM", "model.", _GEMMA4_WEIGHTS, cm.GEMMA4_TEXT),
    Architecture("mixtral", "MixtralForCausalLM", "model.", _MIXTRAL_WEIGHTS, MIXTRAL),
    Architecture("qwen2_moe", "Qwen2MoeForCausalLM", "model.", _QWEN2_MOE_WEIGHTS, QWEN2_MOE),
    Architecture("qwen3_moe", "Qwen3MoeForCausalLM", "model.", _QWEN3_MOE_WEIGHTS, QWEN3_MOE),
    Architecture("flex_olmo", "FlexOlmoForCausalLM", "model.", _FLEX_OLMO_WEIGHTS, FLEX_OLMO),
    Architecture("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM", "model.", _QWEN3_5_MOE_WEIGHTS, QWEN3_5_MOE),
)}


# Families users branch from that are read nowhere yet, with what stands in the way (one line, naming it)
REFUSED: dict[str, str] = {
    "qwen3_5": "the multimodal Qwen3.5 (its vision tower) is not modelled; its text model (qwen3_5_text, "
               "Qwen3_5ForCausalLM) is",
    "qwen3_next": "Qwen3-Next's fused in_proj_qkvz / in_proj_ba layout and its MoE layers are not read (Qwen3.5's "
                  "Gated DeltaNet, qwen3_5_text, is)",
    "gemma4": "the multimodal Gemma 4 (its vision and audio towers) is not modelled; its text model (gemma4_text, "
              "Gemma4ForCausalLM) is",
    "gemma3": "the multimodal Gemma 3 (its vision tower) is not modelled; its text model (gemma3_text) is",
    "llama4": "Llama 4's chunked attention, interleaved NoPE/MoE layers and QK L2-norm are not modelled",
    "phimoe": "PhiMoE's LayerNorms and its sparsemixer router (top-2 picks, each gated by a softmax over the experts "
              "within a relative threshold of the best one) are not modelled",
}


def architecture(model_type: str | None) -> Architecture:
    if isinstance(model_type, str) and model_type in REFUSED:
        raise CapabilityError(f"model_type={model_type!r} is not supported: {REFUSED[model_type]}")
    if not isinstance(model_type, str) or model_type not in ARCHITECTURES:
        raise CapabilityError(f"model_type={str(model_type)[:60]!r} is not supported "
                                 f"(supported: {', '.join(sorted(ARCHITECTURES))})")
    return ARCHITECTURES[model_type]


# ---- binding a table to a config ------------------------------------------------------------
@dataclass(frozen=True)
class BoundRule:
    """A table row with the layer index filled in."""

    hf: tuple[str, ...]
    canonical: tuple[str, ...]
    op: ReshapeOp
    rule: WeightRule


@dataclass
class Binding:
    active: list[BoundRule]  # rows that move data, in canonical (model) order
    optional_drops: set[str]  # HF names accepted if present and dropped (buffers, tied lm_head)
    inactive: dict[str, BoundRule]  # HF names the table knows but this config says are absent
    producer: dict[str, tuple[BoundRule, int]]  # canonical name -> (row, index into op outputs)

    def known(self) -> set[str]:
        return {n for r in self.active for n in r.hf} | self.optional_drops | set(self.inactive)


def _expand(rule: WeightRule, cfg: ModelConfig) -> list[BoundRule]:
    """The rows of one rule: one per layer if it has `{}`; `{e}` HF names once per FFN expert, in order."""
    experts = range(cfg.ffn_experts) if rule.per_expert else [None]
    out = []
    for i in range(cfg.n_layers) if rule.per_layer else [None]:
        fill = (lambda n, e=None: n.format(i, e=e)) if i is not None else (lambda n, e=None: n.format(e=e))
        hf = tuple(fill(n, e) for n in rule.hf for e in experts) if rule.per_expert or i is not None else rule.hf
        canonical = tuple(fill(n) for n in rule.canonical) if i is not None else rule.canonical
        out.append(BoundRule(hf, canonical, rule.op, rule))
    return out


def bind(arch: Architecture, cfg: ModelConfig) -> Binding:
    """The rows of `arch`'s table that apply to `cfg`, with every canonical tensor produced once."""
    expected = tensor_shapes(cfg)
    b = Binding(active=[], optional_drops=set(), inactive={}, producer={})
    bound = [br for r in arch.weights for br in _expand(r, cfg)]
    for br in bound:
        present = [c in expected for c in br.canonical]
        if not br.canonical:
            b.optional_drops.update(br.hf)
        elif all(present):
            b.active.append(br)
            for j, c in enumerate(br.canonical):
                if c in b.producer:
                    raise CapabilityError(f"{arch.model_type} table maps {c} twice")
                b.producer[c] = (br, j)
        elif any(present):
            raise CapabilityError(f"{arch.model_type} table row {br.hf} -> {br.canonical} only partly "
                                     "applies to this config")
        elif (br.rule.tied_alias and cfg.tie_embeddings) or br.rule.optional:
            b.optional_drops.update(br.hf)  # a stored copy of the tied embeddings; the model reuses embed
        else:
            for n in br.hf:
                b.inactive[n] = br
    order = {c: k for k, c in enumerate(expected)}
    b.active.sort(key=lambda br: min(order[c] for c in br.canonical))
    missing = [c for c in expected if c not in b.producer]
    if missing:
        raise CapabilityError(f"{arch.model_type} has no HF tensor for canonical {missing[0]}")
    return b
