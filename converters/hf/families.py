"""Every model family the tool reads, one record each: its base plus what differs (converters/hf/family.py says what a
record holds). The HF config maps and weight tables (architectures.py), llama.cpp's architectures (gguf_table.ARCHS),
the native mixture formats (converters/export.py), the GGUF tokenizer shapes and docs/families.md are derived from
these records. ARCHITECTURE.md ("Where to add things") and docs/families.md ("Adding a family") say how to add one.
"""
from __future__ import annotations

from typing import Any, Mapping

import dataclasses

from .config_map import (Activation, AttentionScale, DerivedEqual, FanOut, Field, ProportionalRope, GlobalLayers,
                         InnerWidth, KVSharing, LayerTypeRope, LinearLayers, NoRopeLayers, Nullable, ParallelResidual,
                         PerLayerInputs, Reciprocal, Require, Rope, Same, SlidingWindow, TemperedRope)
from .family import Family, Fused, Gguf, Refused
from .moe_family import TRUNK_FIELDS, AttentionBiasMoe, MoeConfigMap, RenormalizedMoe, SharedExpertMoe, TrunkMoe
from .ops import (CONV1D_SPLIT_QKV, DEPTHWISE_CONV, SPLIT_GATE_UP, SPLIT_QKV, SPLIT_QKV_PER_HEAD, SPLIT_QUERY_GATE,
                  TRANSPOSE)
from .weights import Rows, WeightRule, lm_head, linear, moe_rows, qkv, w

# tiny sizes of the docs' example configs (docs/families.md)
SIZES = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2)


def _sizes(max_positions: int, kv_heads: bool = True, head_dim_key: bool = False,
           head_dim_default: int | None = None) -> tuple[Field, ...]:
    """The Llama-style size keys."""
    out: list[Field] = [Same("vocab_size", "vocab_size"), Same("hidden_size", "d_model"),
                        Same("num_hidden_layers", "n_layers"), Same("num_attention_heads", "n_heads"),
                        Same("intermediate_size", "ffn_hidden"),
                        Same("max_position_embeddings", "max_positions", max_positions)]
    out.append(Same("num_key_value_heads", "n_kv_heads", None) if kv_heads else DerivedEqual("n_kv_heads", "n_heads"))
    out.append(Same("head_dim", "head_dim", head_dim_default) if head_dim_key
               else DerivedEqual("head_dim", "d_model/n_heads"))
    return tuple(out)


def _positions(default: int) -> Field:
    return Same("max_position_embeddings", "max_positions", default)


_HEAD_DIM_DERIVED = DerivedEqual("head_dim", "d_model/n_heads")
_QK_NORM_ROWS = (w("model.layers.{}.self_attn.q_norm.weight", "layers.{}.attn.q_norm.weight"),
                 w("model.layers.{}.self_attn.k_norm.weight", "layers.{}.attn.k_norm.weight"))
_ROTARY_BUFFER = "model.layers.{}.self_attn.rotary_emb"  # the inv_freq buffer of older checkpoints


# ---- Llama and the families written as its diff -----------------------------------------------------
LLAMA = Family(
    "llama", "LlamaForCausalLM", stands_for="Llama 3.2 (llama3 RoPE, tied)",
    keys=_sizes(2048, head_dim_key=True) + (
        Activation("hidden_act", gated=True, default="silu"), Same("rms_norm_eps", "norm_eps", 1e-6),
        Rope(default_theta=10000.0), Same("tie_word_embeddings", "tie_embeddings", False),
        FanOut("attention_bias", ("qkv_bias", "o_bias"), False), Same("mlp_bias", "ffn_bias", False)),
    rows=(w("model.embed_tokens.weight", "embed.weight"),
          w("model.layers.{}.input_layernorm.weight", "layers.{}.attn_norm.weight"),
          w("model.layers.{}.post_attention_layernorm.weight", "layers.{}.ffn_norm.weight"),
          *qkv("model.layers.{}.self_attn"),
          *linear("model.layers.{}.self_attn.o_proj", "layers.{}.attn.o"),
          *linear("model.layers.{}.mlp.gate_proj", "layers.{}.ffn.gate"),
          *linear("model.layers.{}.mlp.up_proj", "layers.{}.ffn.up"),
          *linear("model.layers.{}.mlp.down_proj", "layers.{}.ffn.down"),
          w(f"{_ROTARY_BUFFER}.inv_freq", None),
          w("model.norm.weight", "final_norm.weight"),
          lm_head()),
    gguf=Gguf("llama", rope_pairs=True, biases=("q/k/v", "o", "ffn"), rope_scalings=("linear", "yarn", "llama3")),
    example=dict(SIZES, model_type="llama", tie_word_embeddings=True, max_position_embeddings=131072,
                 rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=32.0, low_freq_factor=1.0,
                                      high_freq_factor=4.0, original_max_position_embeddings=8192)),
)

MISTRAL = LLAMA.child(
    "mistral", "MistralForCausalLM", stands_for="Mistral 7B v0.1 (4096-token window)",
    traits=dict(qkv_bias=False, o_bias=False, ffn_bias=False),
    keys=(_positions(131072), SlidingWindow("sliding_window", default=4096)),
    example=dict(SIZES, model_type="mistral", sliding_window=4096),
)

QWEN2 = LLAMA.child(
    "qwen2", "Qwen2ForCausalLM", stands_for="Qwen2.5 (q/k/v biases)",
    traits=dict(qkv_bias=True, o_bias=False, ffn_bias=False),  # q/k/v biases, none on o
    keys=(_positions(32768), SlidingWindow("sliding_window", enabled_key="use_sliding_window", default=4096,
                                           rule="from", layer_types=True)),
    gguf=Gguf("qwen2", q_is_d_model=True, picks={"qkv_bias": True}),
    example=dict(SIZES, model_type="qwen2", tie_word_embeddings=True),
)

# Qwen3: Llama with a per-head RMS QK-norm, an explicit head_dim and no q/k/v biases by default.
QWEN3 = LLAMA.child(
    "qwen3", "Qwen3ForCausalLM", stands_for="Qwen3 (QK-norm)",
    traits=dict(qk_norm="head", ffn_bias=False),
    keys=(_positions(32768), Same("head_dim", "head_dim", 128),
          SlidingWindow("sliding_window", enabled_key="use_sliding_window", default=4096, rule="from",
                        layer_types=True)),
    rows=Rows(add=_QK_NORM_ROWS),
    gguf=Gguf("qwen3"),
    example=dict(SIZES, model_type="qwen3", head_dim=32, tie_word_embeddings=True,
                 rope_parameters=dict(rope_type="default", rope_theta=1000000.0)),
)

# Phi-3 / Phi-3.5 / Phi-4-mini: Llama with fused qkv and gate_up projections, partial rotary (Phi-4-mini), longrope
# (the 128k models: its legacy names su and yarn mean longrope), original_max_position_embeddings at the top level.
PHI3 = LLAMA.child(
    "phi3", "Phi3ForCausalLM", stands_for="Phi-3.5-mini (fused projections, longrope)",
    traits=dict(qkv_bias=False, o_bias=False, ffn_bias=False),
    keys=(_positions(4096), _HEAD_DIM_DERIVED, Same("rms_norm_eps", "norm_eps", 1e-5),
          Rope(default_theta=10000.0, default_fraction=1.0, aliases={"su": "longrope", "yarn": "longrope"},
               original_key="original_max_position_embeddings"),
          SlidingWindow("sliding_window")),
    rows=Rows(drop=("layers.{}.attn.", "layers.{}.ffn.", _ROTARY_BUFFER), add=(
        w("model.layers.{}.self_attn.qkv_proj.weight",
          ("layers.{}.attn.q.weight", "layers.{}.attn.k.weight", "layers.{}.attn.v.weight"), SPLIT_QKV),
        w("model.layers.{}.self_attn.o_proj.weight", "layers.{}.attn.o.weight"),
        w("model.layers.{}.mlp.gate_up_proj.weight", ("layers.{}.ffn.gate.weight", "layers.{}.ffn.up.weight"),
          SPLIT_GATE_UP),
        w("model.layers.{}.mlp.down_proj.weight", "layers.{}.ffn.down.weight"))),
    gguf=Gguf("phi3", rope_scalings=("linear", "yarn", "longrope"), q_is_d_model=True, tokenizer="phi3",
              fused=(Fused(("layers.{}.attn.q", "layers.{}.attn.k", "layers.{}.attn.v"), "ATTN_QKV"),
                     Fused(("layers.{}.ffn.gate", "layers.{}.ffn.up"), "FFN_UP", ("weight",))),
              picks={"rope_type": "longrope"}),
    example=dict(SIZES, model_type="phi3", num_key_value_heads=4, max_position_embeddings=131072,
                 original_max_position_embeddings=4096,
                 rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, short_factor=[1.0] * 8,
                                      long_factor=[4.0] * 8)),
)

_GATE_UP_DOWN = tuple(w(f"model.layers.{{}}.mlp.{p}_proj.weight", f"layers.{{}}.ffn.{p}.weight")
                      for p in ("gate", "up", "down"))

# OLMo 2: no norm before the sublayers; each sublayer's output RMS-normed before the residual add (its
# post_attention_layernorm is the norm AFTER attention), and an RMS QK-norm over the full q and k width.
OLMO2 = LLAMA.child(
    "olmo2", "Olmo2ForCausalLM", stands_for="OLMo 2 (post-norms, full QK-norm)",
    traits=dict(qk_norm="full", norm_position="post", ffn_bias=False),
    keys=(_HEAD_DIM_DERIVED, Same("rms_norm_eps", "norm_eps", 1e-5)),
    rows=Rows(drop=("layers.{}.attn_norm", "layers.{}.ffn_norm", "layers.{}.ffn.", _ROTARY_BUFFER), add=(
        *_QK_NORM_ROWS,
        w("model.layers.{}.post_attention_layernorm.weight", "layers.{}.attn_post_norm.weight"),
        *_GATE_UP_DOWN,
        w("model.layers.{}.post_feedforward_layernorm.weight", "layers.{}.ffn_post_norm.weight"))),
    gguf=Gguf("olmo2", output_always=True, q_is_d_model=True),
    example=dict(SIZES, model_type="olmo2", rms_norm_eps=1e-6,
                 rope_parameters=dict(rope_type="default", rope_theta=500000.0)),
)

# OLMo 3: OLMo 2 with sliding-window attention in three layers of four (or layer_types) and a RoPE per layer type
OLMO3 = OLMO2.child(
    "olmo3", "Olmo3ForCausalLM", stands_for="OLMo 3 (sliding windows in 3 of 4 layers)",
    keys=(LayerTypeRope(default_theta=500000.0, local_key=None, default_local=500000.0),
          SlidingWindow("sliding_window", default=4096, rule="period", period=4, layer_types=True)),
    example=dict(SIZES, model_type="olmo3", sliding_window=512),
)

# SmolLM3: Llama with no RoPE in every fourth layer (no_rope_layers), tied embeddings by default.
SMOLLM3 = LLAMA.child(
    "smollm3", "SmolLM3ForCausalLM", stands_for="SmolLM3 (no RoPE every 4th layer)",
    keys=(_positions(32768), _HEAD_DIM_DERIVED, Rope(default_theta=2000000.0),
          Same("tie_word_embeddings", "tie_embeddings", True), NoRopeLayers(),
          SlidingWindow("sliding_window", enabled_key="use_sliding_window", rule="nope", layer_types=True)),
    gguf=Gguf("smollm3", rope_pairs=True, nope_every=4),
    example=dict(SIZES, model_type="smollm3"),
)

# Gemma 2 and Gemma 3 (text): sandwich norms of (1 + w) RMSNorm, embeddings times sqrt(hidden_size), GeGLU,
# attention scaled by query_pre_attn_scalar, sliding-window layers (Gemma 2 every other one, Gemma 3 five of six,
# or config.json's layer_types), soft-capped attention and output logits (Gemma 2), per-head QK-norm and the local
# layers' own RoPE base (Gemma 3), tied embeddings. The examples' query_pre_attn_scalar is their head_dim, as in
# Gemma 2 2B / 9B and Gemma 3 up to 12B.
GEMMA2 = LLAMA.child(
    "gemma2", "Gemma2ForCausalLM", stands_for="Gemma 2 (sandwich norms, soft-capping, every other layer sliding)",
    traits=dict(norm_position="sandwich", norm_unit_offset=True, scale_embeddings=True, ffn_bias=False),
    keys=(_positions(8192), Same("head_dim", "head_dim", 256),
          Activation("hidden_activation", gated=True, default="gelu_pytorch_tanh", gated_kinds=("geglu_tanh",)),
          Same("tie_word_embeddings", "tie_embeddings", True), Same("query_pre_attn_scalar", "attn_scale_dim", 256),
          SlidingWindow("sliding_window", default=4096, rule="period", period=2, layer_types=True),
          Nullable("attn_logit_softcapping", "attn_softcap", 50.0),
          Nullable("final_logit_softcapping", "final_softcap", 30.0),
          Require("use_bidirectional_attention", False, "bidirectional attention is not modelled")),
    rows=Rows(drop=("layers.{}.ffn_norm", "layers.{}.ffn.", _ROTARY_BUFFER), add=(
        w("model.layers.{}.post_attention_layernorm.weight", "layers.{}.attn_post_norm.weight"),
        w("model.layers.{}.pre_feedforward_layernorm.weight", "layers.{}.ffn_norm.weight"),
        w("model.layers.{}.post_feedforward_layernorm.weight", "layers.{}.ffn_post_norm.weight"),
        *_QK_NORM_ROWS, *_GATE_UP_DOWN)),
    gguf=Gguf("gemma2", biases=(), rope_scalings=("linear",), tied_only=True, attn_softcap="always",
              final_softcap="always", windows="always", default_window=4096, window_pattern=2, window_rope="global",
              attn_scale_layers=46, tokenizer="gemma"),
    example=dict(SIZES, model_type="gemma2", head_dim=32, query_pre_attn_scalar=32, sliding_window=512),
)

GEMMA3_TEXT = GEMMA2.child(
    "gemma3_text", "Gemma3ForCausalLM", stands_for="Gemma 3 270M (QK-norm, 5 of 6 layers sliding, local RoPE base)",
    traits=dict(qk_norm="head"),
    keys=(_positions(131072), LayerTypeRope(default_theta=1000000.0),
          SlidingWindow("sliding_window", default=4096, rule="period", period=6, period_key="sliding_window_pattern",
                        layer_types=True),
          Nullable("attn_logit_softcapping", "attn_softcap", None),
          Nullable("final_logit_softcapping", "final_softcap", None)),
    gguf=Gguf("gemma3", biases=(), rope_scalings=("linear",), final_softcap="optional", windows="optional",
              window_pattern=6, window_rope="plain", attn_scale_layers=62, tokenizer="gemma"),
    example=dict(SIZES, model_type="gemma3_text", num_hidden_layers=6, head_dim=32, query_pre_attn_scalar=32,
                 sliding_window=512),
)


# Granite: Llama with the residual stream's multipliers (embeddings, each sublayer's output), an attention scale of its
# own and logits divided by logits_scaling.
GRANITE = LLAMA.child(
    "granite", "GraniteForCausalLM", stands_for="Granite 3 (embedding, residual, attention and logit multipliers)",
    keys=(Same("embedding_multiplier", "embedding_multiplier", 1.0),
          Same("residual_multiplier", "residual_multiplier", 1.0),
          AttentionScale("attention_multiplier", "attn_scale"), Reciprocal("logits_scaling", "logit_scale")),
    gguf=Gguf("granite", rope_pairs=True, biases=("q/k/v", "o", "ffn"), rope_scalings=("linear", "yarn", "llama3"),
              carries=("embedding_multiplier", "residual_multiplier", "attn_scale", "logit_scale")),
    example=dict(SIZES, model_type="granite", tie_word_embeddings=True, embedding_multiplier=12.0,
                 residual_multiplier=0.22, attention_multiplier=0.0625, logits_scaling=8.0),
)

# Ministral 3: Mistral with YaRN by default and its queries scaled by position (rope_parameters' llama_4_scaling_beta)
MINISTRAL3 = MISTRAL.child(
    "ministral3", "Ministral3ForCausalLM", stands_for="Ministral 3 (YaRN, queries scaled by position)",
    keys=(_positions(262144), Same("num_key_value_heads", "n_kv_heads", 8), Same("head_dim", "head_dim", 128),
          Same("rms_norm_eps", "norm_eps", 1e-5),
          TemperedRope(default_theta=1000000.0, default_parameters=dict(
              type="yarn", rope_theta=1000000.0, factor=16.0, original_max_position_embeddings=16384,
              max_position_embeddings=262144, beta_fast=32.0, beta_slow=1.0, mscale_all_dim=1.0, mscale=1.0,
              llama_4_scaling_beta=0.1)),
          SlidingWindow("sliding_window")),
    example=dict(SIZES, model_type="ministral3", head_dim=16, max_position_embeddings=8192,
                 rope_parameters=dict(rope_type="yarn", rope_theta=1000000.0, factor=16.0,
                                      original_max_position_embeddings=512, beta_fast=32.0, beta_slow=1.0,
                                      mscale_all_dim=1.0, mscale=1.0, llama_4_scaling_beta=0.1)),
)

# EXAONE 4: OLMo 2's post-norms with a per-head QK-norm, sliding windows in three layers of four (or layer_types), RoPE
# only in the sliding layers when it has windows, no biases.
EXAONE4 = OLMO2.child(
    "exaone4", "Exaone4ForCausalLM", stands_for="EXAONE 4 (post-norms, QK-norm, RoPE only in the sliding layers)",
    traits=dict(qk_norm="head", qkv_bias=False, o_bias=False),
    keys=(Same("num_key_value_heads", "n_kv_heads", 32), Same("head_dim", "head_dim", None),
          SlidingWindow("sliding_window", default=4096, rule="period", period=4, period_key="sliding_window_pattern",
                        layer_types=True, rope_sliding_only=True)),
    gguf=Gguf("exaone4", biases=(), rope_scalings=("linear", "yarn", "llama3"), windows="fixed", window_pattern=4,
              window_block_count=64, default_window=4096, rope_sliding_only=True),
    example=dict(SIZES, model_type="exaone4", head_dim=16, sliding_window=512, sliding_window_pattern=4),
)


# ---- the families of 2026: their own layers ------------------------------------------------------------
# Qwen3.5 (text): Qwen3 with Gated DeltaNet layers (layer_types: linear_attention; linear_attn.* in place of self_attn),
# a gated attention output (q_proj holds each head's query and gate), (1 + w) norms, partial rotary (a quarter of
# each head by default), no sliding windows
QWEN3_5_TEXT = QWEN3.child(
    "qwen3_5_text", "Qwen3_5ForCausalLM", stands_for="Qwen3.5 (Gated DeltaNet in 3 of 4 layers, gated attention)",
    traits=dict(norm_unit_offset=True, attn_output_gate=True, attn_window=None, attn_window_layers=None),
    keys=(Same("num_key_value_heads", "n_kv_heads", 4), Same("head_dim", "head_dim", 256),
          Rope(default_theta=10000.0, default_fraction=0.25), LinearLayers()),
    rows=Rows(drop=("layers.{}.attn.q.",), add=(
        *[w(f"model.layers.{{}}.self_attn.q_proj.{p}", (f"layers.{{}}.attn.q.{p}", f"layers.{{}}.attn.gate.{p}"),
            SPLIT_QUERY_GATE) for p in ("weight", "bias")],
        *[w(f"model.layers.{{}}.linear_attn.{hf}", f"layers.{{}}.linear.{ours}") for hf, ours in (
            ("in_proj_qkv.weight", "qkv.weight"), ("in_proj_z.weight", "z.weight"), ("in_proj_b.weight", "b.weight"),
            ("in_proj_a.weight", "a.weight"), ("dt_bias", "dt.bias"), ("A_log", "a_log.weight"),
            ("norm.weight", "norm.weight"), ("out_proj.weight", "out.weight"))],
        w("model.layers.{}.linear_attn.conv1d.weight", "layers.{}.linear.conv.weight", DEPTHWISE_CONV))),
    # interleaved multi-section RoPE (text: every section the same position, so plain RoPE); (1 + w) norms stored as
    # 1 + w but the DeltaNet's gated norm; attn_q holds each head's query and gate (gguf_table's LINEAR section)
    gguf=Gguf("qwen35", biases=(), rope_scalings=(), partial_rotary=True, linear_attention=True,
              fused=(Fused(("layers.{}.attn.q", "layers.{}.attn.gate"), "ATTN_Q", per_head=True),),
              picks={"linear": True}),
    example=dict(SIZES, model_type="qwen3_5_text", head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                 linear_key_head_dim=16, linear_value_head_dim=16),
)

_KV_ROWS = tuple(WeightRule(r.hf, r.canonical, r.op, optional=True) for r in qkv("model.layers.{}.self_attn")[2:])

# Gemma 4 (text): Gemma 3's sandwich norms, GeGLU, scaled embeddings and sliding layers (the last layer always
# global), with norms scaling by w, unscaled attention logits (scaling 1: attn_scale_dim 1), RMS-normed values, a
# scalar per layer, the global layers' own head size, kv heads and K = V, proportional RoPE there, K/V shared by the
# last layers (double-wide MLPs there), per-layer inputs. No k/v (or v) where a layer reads another's K/V (or K = V):
# such tensors in a checkpoint are accepted and dropped. Its MoE block (enable_moe_block) is refused: its dense MLP
# and routed experts run side by side with norms of their own, which no mixture here computes.
GEMMA4_TEXT = GEMMA3_TEXT.child(
    "gemma4_text", "Gemma4ForCausalLM",
    stands_for="Gemma 4 E2B (per-layer inputs, shared K/V layers, global layers of their own head size)",
    traits=dict(norm_unit_offset=False, attn_scale_dim=1, attn_softcap=None, v_norm=True, layer_scale=True),
    keys=(Same("num_key_value_heads", "n_kv_heads", 4),
          SlidingWindow("sliding_window", default=512, rule="period", period=6, layer_types=True, last_global=True),
          ProportionalRope(default_theta=1000000.0, local_key=None), GlobalLayers(), KVSharing(), PerLayerInputs(),
          Require("use_bidirectional_attention", None, "bidirectional attention is not modelled"),
          Require("enable_moe_block", False, "Gemma 4's MoE block (a dense MLP beside routed experts, each with norms "
                                             "of its own, and a router with its own norm and per-expert scales) is "
                                             "not read")),
    rows=Rows(drop=("layers.{}.attn.k.", "layers.{}.attn.v."), add=(
        w("model.embed_tokens_per_layer.weight", "ple_embed.weight"),
        w("model.per_layer_model_projection.weight", "ple_proj.weight"),
        w("model.per_layer_projection_norm.weight", "ple_proj_norm.weight"),
        *_KV_ROWS,
        w("model.layers.{}.per_layer_input_gate.weight", "layers.{}.ple.gate.weight"),
        w("model.layers.{}.per_layer_projection.weight", "layers.{}.ple.out.weight"),
        w("model.layers.{}.post_per_layer_input_norm.weight", "layers.{}.ple_norm.weight"),
        w("model.layers.{}.layer_scalar", "layers.{}.layer_scale.weight"))),
    # the global layers' head size and kv heads, K = V, shared K/V layers, double-wide MLPs, per-layer inputs and
    # proportional RoPE as rope_freqs (gguf_table's GEMMA4 section)
    gguf=Gguf("gemma4", biases=(), rope_scalings=("proportional",), tied_only=True, final_softcap="optional",
              windows="optional", window_rope="plain", tokenizer="gemma", per_layer_geometry=True, picks={"v_norm": True}),
    example=dict(SIZES, model_type="gemma4_text", num_hidden_layers=6, head_dim=32, global_head_dim=64,
                 num_key_value_heads=1, num_kv_shared_layers=2, use_double_wide_mlp=True,
                 hidden_size_per_layer_input=16, sliding_window=512,
                 layer_types=["sliding_attention", "full_attention"] * 3),
)


# ---- families of their own shape ----------------------------------------------------------------------
GPT_NEOX = Family(
    "gpt_neox", "GPTNeoXForCausalLM", base_prefix="gpt_neox.", stands_for="Pythia (parallel, partial rotary)",
    alias_prefixes={"lm_head.": "embed_out."},  # transformers 5's in-memory name
    traits=dict(norm="layernorm", norm_bias=True, ffn_bias=True),
    keys=_sizes(2048, kv_heads=False) + (
        Activation("hidden_act", gated=False, default="gelu"), Same("layer_norm_eps", "norm_eps", 1e-5),
        Rope(default_theta=10000.0, default_fraction=0.25, legacy_theta_key="rotary_emb_base",
             legacy_fraction_key="rotary_pct"),
        Same("tie_word_embeddings", "tie_embeddings", False),
        ParallelResidual("use_parallel_residual", default=True),
        FanOut("attention_bias", ("qkv_bias", "o_bias"), True)),
    rows=(w("gpt_neox.embed_in.weight", "embed.weight"),
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
          lm_head("embed_out.weight")),  # the name on disk, for transformers 4 and 5 alike
    example=dict(SIZES, model_type="gpt_neox", num_key_value_heads=None, rotary_pct=0.25),
)

GPT2 = Family(
    "gpt2", "GPT2LMHeadModel", base_prefix="transformer.", stands_for="GPT-2 (learned positions)",
    traits=dict(norm="layernorm", norm_bias=True, position="learned", qkv_bias=True, o_bias=True, ffn_bias=True),
    keys=(Same("vocab_size", "vocab_size"), Same("n_embd", "d_model"), Same("n_layer", "n_layers"),
          Same("n_head", "n_heads"), InnerWidth("n_inner", "n_embd"), Same("n_positions", "max_positions", 1024),
          DerivedEqual("n_kv_heads", "n_heads"), DerivedEqual("head_dim", "d_model/n_heads"),
          Activation("activation_function", gated=False, default="gelu_new"),
          Same("layer_norm_epsilon", "norm_eps", 1e-5), Same("tie_word_embeddings", "tie_embeddings", True),
          Require("scale_attn_weights", True, "attention is scaled by 1/sqrt(head_dim)"),
          Require("scale_attn_by_inverse_layer_idx", False), Require("add_cross_attention", False)),
    rows=(w("transformer.wte.weight", "embed.weight"),
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
          lm_head()),
    example=dict(model_type="gpt2", vocab_size=512, n_embd=64, n_layer=4, n_head=4),
)

# Command R: one bias-free layernorm shared by attention and FFN, RoPE on interleaved pairs, scaled logits
COHERE = Family(
    "cohere", "CohereForCausalLM", stands_for="Command R (parallel, interleaved RoPE)",
    traits=dict(rope_interleaved=True, norm="layernorm", block="parallel"),
    keys=_sizes(8192) + (
        Activation("hidden_act", gated=True, default="silu"), Same("layer_norm_eps", "norm_eps", 1e-5),
        Rope(default_theta=500000.0), Same("tie_word_embeddings", "tie_embeddings", True),
        FanOut("attention_bias", ("qkv_bias", "o_bias"), False), Same("logit_scale", "logit_scale", 0.0625),
        Require("use_qk_norm", False, "per-head QK layernorm is not modelled")),
    rows=(w("model.embed_tokens.weight", "embed.weight"),
          w("model.layers.{}.input_layernorm.weight", "layers.{}.attn_norm.weight"),  # the one shared norm
          *qkv("model.layers.{}.self_attn"),
          *linear("model.layers.{}.self_attn.o_proj", "layers.{}.attn.o"),
          *_GATE_UP_DOWN,
          w(f"{_ROTARY_BUFFER}.inv_freq", None),
          w("model.norm.weight", "final_norm.weight"),
          lm_head()),
    example=dict(SIZES, model_type="cohere"),
)

# Phi-2: parallel attention and FFN on one layernorm with biases, partial rotary, a biased head
PHI = Family(
    "phi", "PhiForCausalLM", stands_for="Phi-2 (parallel, biases)",
    traits=dict(norm="layernorm", norm_bias=True, block="parallel", qkv_bias=True, o_bias=True, ffn_bias=True,
                lm_head_bias=True),
    keys=_sizes(2048) + (
        Activation("hidden_act", gated=False, default="gelu_new"), Same("layer_norm_eps", "norm_eps", 1e-5),
        Rope(default_theta=10000.0, default_fraction=0.5), Same("tie_word_embeddings", "tie_embeddings", False),
        Require("qk_layernorm", False, "per-head QK layernorm is not modelled")),
    rows=(w("model.embed_tokens.weight", "embed.weight"),
          *linear("model.layers.{}.input_layernorm", "layers.{}.attn_norm"),  # the one shared norm
          *qkv("model.layers.{}.self_attn"),
          *linear("model.layers.{}.self_attn.dense", "layers.{}.attn.o"),
          *linear("model.layers.{}.mlp.fc1", "layers.{}.ffn.up"),
          *linear("model.layers.{}.mlp.fc2", "layers.{}.ffn.down"),
          w(f"{_ROTARY_BUFFER}.inv_freq", None),
          *linear("model.final_layernorm", "final_norm"),
          lm_head(),
          w("lm_head.bias", "lm_head.bias")),
    example=dict(SIZES, model_type="phi", num_key_value_heads=4, partial_rotary_factor=0.5),
)


# ---- the native mixture formats: a family's trunk with FFN experts ------------------------------------
def _moe(kind: type[MoeConfigMap], experts: Mapping[str, str], defaults: Mapping[str, Any], **more: Any):
    """A native mixture's config map from its record: the trunk keys and the record's expert keys, its trunk."""
    def build(f: Family) -> MoeConfigMap:
        return kind(f.hf_class, f.model_type, {**TRUNK_FIELDS, **experts}, defaults, f.all_traits["qk_norm"],
                    f.all_traits["norm_position"], **more)
    return build


_ATTENTION_WEIGHTS = tuple(w(f"model.layers.{{}}.self_attn.{p}_proj.weight", f"layers.{{}}.attn.{p}.weight")
                           for p in "qkvo")
_SPARSE_KEYS = ("mlp_only_layers", "decoder_sparse_step", "norm_topk_prob")

# Mixtral: the Llama names, with a routed FFN of E experts (w1 = gate, w3 = up, w2 = down), no biases.
MIXTRAL = LLAMA.child(
    "mixtral", "MixtralForCausalLM", stands_for="Mixtral", summary="HF Mixtral directory, btx/upcycle of Llama-family inputs",
    rows=Rows(drop=("layers.{}.attn.", "layers.{}.ffn.", _ROTARY_BUFFER),
              add=(*_ATTENTION_WEIGHTS, *moe_rows("block_sparse_moe", "gate", ("w1", "w3", "w2")))),
    moe=_moe(RenormalizedMoe, {"ffn_hidden": "intermediate_size", "ffn_experts": "num_local_experts"}, {
        "rms_norm_eps": 1e-5, "max_position_embeddings": 4096 * 32, "tie_word_embeddings": False,
        "num_local_experts": 8, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.001,
        "hidden_act": "silu", "rope_theta": 1e6, "head_dim": None, "num_key_value_heads": None}),
    # llama.cpp's llama adds q/k/v and o biases to a mixture's attention as to a dense model's (a BTX of Qwen2 models)
    gguf=Gguf("llama", gate_norm="topk_softmax", moe_biases=("q/k/v", "o")),
)

# the always-on shared expert and its sigmoid gate (Qwen2-MoE, Qwen3.5-MoE)
_SHARED_EXPERT_ROWS = (*[w(f"model.layers.{{}}.mlp.shared_expert.{p}_proj.weight", f"layers.{{}}.ffn_shared.{p}.weight")
                         for p in ("gate", "up", "down")],
                       w("model.layers.{}.mlp.shared_expert_gate.weight", "layers.{}.ffn_shared_gate.weight"))

# Qwen2-MoE: the Llama names with q/k/v biases, a routed FFN (mlp.experts.{e}) and an always-on shared expert with
# its sigmoid gate; a mixture without biases or a shared expert (a BTX of Qwen2 models) is written with zeros there.
QWEN2_MOE = QWEN2.child(
    "qwen2_moe", "Qwen2MoeForCausalLM", stands_for="Qwen2-MoE",
    summary="HF Qwen2-MoE directory, btx/upcycle/btx-shared-expert of Llama/Qwen2-family inputs (q/k/v biases too)",
    rows=Rows(drop=("layers.{}.attn.o", "layers.{}.ffn.", _ROTARY_BUFFER), add=(
        w("model.layers.{}.self_attn.o_proj.weight", "layers.{}.attn.o.weight"),
        *moe_rows("mlp", "gate", ("gate_proj", "up_proj", "down_proj")),
        *_SHARED_EXPERT_ROWS)),
    moe=_moe(SharedExpertMoe, {"ffn_hidden": "moe_intermediate_size", "ffn_experts": "num_experts",
                               "ffn_shared_hidden": "shared_expert_intermediate_size"}, {
        "vocab_size": 151936, "hidden_size": 2048, "moe_intermediate_size": 1408, "num_hidden_layers": 24,
        "num_attention_heads": 16, "num_key_value_heads": 16, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768,
        "tie_word_embeddings": False, "num_experts": 60, "num_experts_per_tok": 4,
        "shared_expert_intermediate_size": 5632, "router_aux_loss_coef": 0.001, "hidden_act": "silu",
        "rope_theta": 10000.0, "norm_topk_prob": False, "decoder_sparse_step": 1, "head_dim": None,
        "sliding_window": 4096, "use_sliding_window": False}, typed_keys=_SPARSE_KEYS),
    gguf=Gguf("qwen2moe", gate_norm="softmax", expert_width=True, output_always=True, q_is_d_model=True),
)

_WITH_EXPERTS = Rows(drop=("layers.{}.ffn.",), add=moe_rows("mlp", "gate", ("gate_proj", "up_proj", "down_proj")))

# Qwen3-MoE: Qwen3's trunk (per-head QK-norm, q/k/v/o biases when attention_bias) with experts
QWEN3_MOE = QWEN3.child(
    "qwen3_moe", "Qwen3MoeForCausalLM", stands_for="Qwen3-MoE", summary="HF Qwen3-MoE directory, btx/upcycle of Qwen3 inputs",
    rows=_WITH_EXPERTS,
    moe=_moe(AttentionBiasMoe, {"ffn_hidden": "moe_intermediate_size", "ffn_experts": "num_experts"}, {
        "vocab_size": 151936, "hidden_size": 2048, "moe_intermediate_size": 768, "num_hidden_layers": 24,
        "num_attention_heads": 32, "num_key_value_heads": 4, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768,
        "tie_word_embeddings": False, "num_experts": 128, "num_experts_per_tok": 8, "router_aux_loss_coef": 0.001,
        "hidden_act": "silu", "rope_theta": 10000.0, "norm_topk_prob": False, "decoder_sparse_step": 1,
        "head_dim": None, "attention_bias": False, "sliding_window": 4096, "use_sliding_window": False},
        typed_keys=(*_SPARSE_KEYS, "attention_bias"), sparse=True),
    gguf=Gguf("qwen3moe", gate_norm="topk_softmax", expert_width=True, moe_checks="mixtral"),
)

# FlexOlmo: OLMo 2's trunk (post-norms, full-width QK-norm) with experts
FLEX_OLMO = OLMO2.child(
    "flex_olmo", "FlexOlmoForCausalLM", stands_for="FlexOlmo", summary="HF FlexOlmo directory, btx/upcycle of OLMo 2 inputs",
    rows=_WITH_EXPERTS,
    moe=_moe(AttentionBiasMoe, {"ffn_hidden": "intermediate_size", "ffn_experts": "num_experts"}, {
        "vocab_size": 100352, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": None, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
        "tie_word_embeddings": False, "num_experts": 7, "num_experts_per_tok": 5, "router_aux_loss_coef": 0.01,
        "hidden_act": "silu", "rope_theta": 500000.0, "norm_topk_prob": False, "head_dim": None,
        "attention_bias": False}, typed_keys=("norm_topk_prob", "attention_bias")),
)


# Qwen3.5-MoE: Qwen3.5's trunk (its Gated DeltaNet and gated attention layers, read and written by the qwen3_5_text
# record) with a sparse MoE block in every layer: softmax over all experts, the top-k renormalized, SwiGLU experts of
# moe_intermediate_size and an always-on shared expert (all zeros for a mixture without one: native_moe.py)
QWEN3_5_MOE = QWEN3_5_TEXT.child(
    "qwen3_5_moe_text", "Qwen3_5MoeForCausalLM", stands_for="Qwen3.5-MoE", format="qwen3_5_moe",
    summary="HF Qwen3.5-MoE directory, btx/btx-shared-expert/upcycle of Qwen3.5 inputs",
    rows=Rows(drop=("layers.{}.ffn.",), add=(*moe_rows("mlp", "gate", ("gate_proj", "up_proj", "down_proj")),
                                              *_SHARED_EXPERT_ROWS)),
    moe=lambda f: TrunkMoe(f.hf_class, f.model_type, f.format_name, f.base.config, {
        "moe_intermediate_size": ("ffn_hidden", 512), "num_experts": ("ffn_experts", 256),
        "num_experts_per_tok": ("ffn_top_k", 8), "shared_expert_intermediate_size": ("ffn_shared_hidden", 512),
        "router_aux_loss_coef": ("lb_coef", 0.001)}, {
        "vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 40, "num_attention_heads": 16,
        "num_key_value_heads": 2}),
    gguf=dataclasses.replace(QWEN3_5_TEXT.gguf, name="qwen35moe", gate_norm="topk_softmax", expert_width=True,
                             picks={"linear": True}),
)


# ---- the tables ------------------------------------------------------------------------------------------
# every family read, in the order the tool lists them (dense first, then the native mixtures)
FAMILIES: tuple[Family, ...] = (LLAMA, MISTRAL, QWEN2, GPT_NEOX, GPT2, COHERE, PHI, QWEN3, PHI3, OLMO2, OLMO3, SMOLLM3,
                                GEMMA2, GEMMA3_TEXT, GRANITE, MINISTRAL3, EXAONE4, QWEN3_5_TEXT, GEMMA4_TEXT, MIXTRAL,
                                QWEN2_MOE, QWEN3_MOE, FLEX_OLMO, QWEN3_5_MOE)
NATIVE_MIXTURES: tuple[Family, ...] = tuple(f for f in FAMILIES if f.moe is not None)

# Families users branch from that are read nowhere yet, with what stands in the way (one line, naming it)
REFUSED: tuple[Refused, ...] = (
    Refused("qwen3_5", "the multimodal Qwen3.5 (its vision tower) is not modelled; its text model (qwen3_5_text, "
                       "Qwen3_5ForCausalLM) is"),
    Refused("qwen3_next", "Qwen3-Next's fused in_proj_qkvz / in_proj_ba layout and its MoE layers are not read "
                          "(Qwen3.5's Gated DeltaNet, qwen3_5_text, is)"),
    Refused("gemma4", "the multimodal Gemma 4 (its vision and audio towers) is not modelled; its text model "
                      "(gemma4_text, Gemma4ForCausalLM) is"),
    Refused("gemma3", "the multimodal Gemma 3 (its vision tower) is not modelled; its text model (gemma3_text) is"),
    Refused("llama4", "Llama 4's chunked attention, interleaved NoPE/MoE layers and QK L2-norm are not modelled"),
    Refused("phimoe", "PhiMoE's LayerNorms and its sparsemixer router (top-2 picks, each gated by a softmax over the "
                      "experts within a relative threshold of the best one) are not modelled"),
)

# Native mixture formats of a family's own that no mixture of ours computes the same function in (--format refuses
# them in one line, saying why: converters/export.py REFUSED_FORMATS)
REFUSED_NATIVE: tuple[Refused, ...] = (
    Refused("gemma4_moe", "Gemma 4's MoE block runs a dense MLP beside its routed experts, RMS-normalizes the experts' "
                          "summed output and the MLP's each with a norm of its own before adding them, and routes from "
                          "its own scaled RMS norm of the residual with a scale per expert; a BTX of Gemma 4 models "
                          "sums its experts' outputs as they are, with no MLP beside them, so it would compute another "
                          "function there; --format hf writes it (the HF BAM model)"),
)
