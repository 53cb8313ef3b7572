"""The `gguf` format: one GGUF file for llama.cpp (llama-cli, llama-server, llama-cpp-python and what embeds them).

    exporter("gguf").write(reader, Path("mix.gguf"), ExportOptions(gguf_dtype="q8_0", tokenizer_files=(...)))

What llama.cpp runs, decided from the config alone (check_gguf: CapabilityError, one line, before any tensor is read):
the architecture is the first of `candidates(cfg)` (the nearest in trunk, gguf_table.ARCHS rows, from the family
records) whose column (`arch_column`: llama.cpp's column of the table of what runs where, converters/carry.py) carries
the model: the row's QK-norm, norm position, layers without RoPE, biases, RoPE scalings, attention width; else the
first, whose failures are the refusal.
  dense    sequential blocks, RMSNorm, RoPE over the whole head, SwiGLU FFN, a final norm, no logit scale, no lm_head
           bias; GQA, any head_dim and tied embeddings are fine. By family:
             olmo2    a full-width QK-norm and norms after attention and FFN (OLMo 2); q/k/v biases; H * Dh = d_model
             qwen3    a per-head QK-norm (Qwen3); q/k/v biases
             smollm3  no RoPE in every fourth layer (layers 3, 7, ...: llama.cpp's fixed pattern; another is refused)
             phi3     longrope (Phi-3): q/k/v fused into attn_qkv, gate and up into ffn_up, the factors as
                      rope_factors_long / _short; H * Dh = d_model
             qwen2    Qwen2's shape: q/k/v biases only, rotate-halves RoPE, H * Dh = d_model
             llama    the rest (Llama, Mistral): biases anywhere but the head, rotate-halves or pairs
             gemma2   norms before and after attention and FFN (Gemma 2): GeGLU, embeddings times sqrt(d_model),
                      attention and final soft-caps (both: llama.cpp applies 50 and 30 without the keys), sliding
                      layers (at least one), tied embeddings; gemma3 the same with a per-head QK-norm and no attention
                      soft-cap (Gemma 3). Their windows, the sliding layers' RoPE and the attention scale llama.cpp
                      derives from the block count: gguf_table's WINDOWS section; no mixture of their norms.
             granite  the residual stream's multipliers, an attention scale of its own and a logit divisor (Granite;
                      a Llama-shaped model with a logit scale too): {arch}.embedding_scale, residual_scale,
                      attention.scale, logit_scale
             exaone4  a per-head QK-norm with norms after attention and FFN (EXAONE 4); sliding windows only as
                      llama.cpp slides them: three layers of four at 64 layers, RoPE in those alone
             qwen35   Qwen3.5: Gated DeltaNet layers in all but every n-th layer (full_attention_interval), gated
                      attention, partial rotary, (1 + w) norms: what the HF qwen3_5_text format carries
                      (gguf_table's LINEAR section); qwen35moe a BTX of it, as the qwen3_5_moe format takes it
             gemma4   Gemma 4: what the HF gemma4_text format carries, with proportional RoPE and tied embeddings
                      (gguf_table's GEMMA4 section)
           A (1 + w) RMSNorm (Gemma's) is written as 1 + w, in every architecture: llama.cpp multiplies by it.
  mixture  the FFN experts the `mixtral` format takes (its record's config map, hf/moe_family.py): FFN experts of
           that shape, linear routers, top-k gates renormalized (gate_norm topk_softmax): the `llama` architecture
           with expert_count / expert_used_count, as llama.cpp's convert_hf_to_gguf.py writes Mixtral, with the q/k/v
           and o biases llama.cpp's llama adds when the file has them (a BTX of Qwen2 models: the record's
           Gguf.moe_biases); with softmax gates (the paper's top-1), which llama's graph would renormalize, `qwen2moe`
           with an all-zero shared expert (below); with a per-head QK-norm (BTX mixtures of Qwen3) `qwen3moe`, which
           renormalizes the top-k too (Qwen3-MoE's norm_topk_prob; softmax gates refused, unless top-k is every expert)
           and reads expert_feed_forward_length.
  shared   a mixture with a shared FFN expert (recipe btx-shared-expert): what the `qwen2_moe` format takes
           (hf/moe_family.py SharedExpertMoe) and llama.cpp's `qwen2moe` architecture computes:
           routed experts as above, plus the shared expert scaled by sigmoid(x . w); a mixture without one is written
           with converters/native_moe.py's all-zero shared expert, which adds exactly 0; expert_count,
           expert_used_count, expert_feed_forward_length, expert_shared_feed_forward_length. Its graph takes the
           gates p_i of the softmax over all experts and never renormalizes the top-k (expert_weights_norm is not
           read for qwen2moe), so gate_norm softmax, the recipe's default, is written and topk_softmax refused (unless
           top-k is every expert); its attention tensors are [d_model, d_model], so n_heads * head_dim = d_model.
           q/k/v biases are always written (zeros for a model without: what convert_hf_to_gguf.py's Qwen2-MoE files
           hold; llama.cpp 0.3.36 also loads a file without them), and a tied embedding once more as output.weight
           (qwen2moe requires that tensor, as olmo2 does). llama.cpp computes the shared gate's sigmoid(y) as
           silu(y) / y, NaN at y = 0: a gate weight of all zeros (btx-shared-expert as merged: 1/2 for every token)
           is written as SHEXP_GATE_EPS everywhere, which gives exactly 1/2 in f32.
  RoPE     scaled RoPE as gguf_table's ROPE section maps it: linear and yarn (rope.scaling.* keys) everywhere; llama3
           as llama.cpp's rope_freqs tensor (llama only); longrope as phi3's factor tensors (llama.cpp takes the long
           factors when its context exceeds the original length, the runtime when the sequence does); yarn only with
           llama.cpp's fixed beta_fast 32, beta_slow 1 and truncated ramp; dynamic refused (llama.cpp has none).
  refused  attention experts (BAM) and every other block: the canonical, hf and onnx formats carry them.

Tensors take llama.cpp's names (gguf.TENSOR_NAMES: token_embd, blk.N.attn_q, blk.N.ffn_gate_exps, ...), checked
against the architecture's list (gguf.MODEL_TENSORS) by gguf_table.tensor_layout, which also stacks the parts of a
fused tensor (phi3); experts go stacked [E, ...] as they are, the shared expert
as ffn_{gate,up,down}_shexp and its gate as ffn_gate_inp_shexp. The `llama` and `smollm3` architectures rotate
pairs of dimensions, so the Q and K rows (weights and biases) of a rotate-halves model are permuted per head as
convert_hf_to_gguf.py does (LlamaModel.permute); the others rotate halves (NEOX) and take them as they are.
Types: the matrices in f32, f16 or q8_0 (GGUFOptions.dtype, the format's own option, else f32 for float32 weights
and f16 for 16-bit ones); 1-D tensors (norms, biases, RoPE's factors), the routers and the shared expert's gate stay f32,
and a q8_0 matrix whose rows are not a multiple of 32 values falls back to f16, as llama.cpp's converter
does. One tensor is in memory at a time: the header is written from the shapes, then each tensor is read,
converted and appended.

The tokenizer goes into tokenizer.ggml.*, as the gpt2 (byte-level BPE) model of llama.cpp:
  * the input's tokenizer.json, when it is a byte-level BPE whose pre-tokenizer llama.cpp implements (gpt-2,
    llama-bpe, qwen2, smollm; gguf_tokenizer.PRE_TOKENIZERS, the table the GGUF reader rebuilds tokenizers from):
    tokens, token types (special added tokens CONTROL, other added tokens USER_DEFINED, ids past the tokenizer's
    [PADn] UNUSED up to vocab_size), merges, eos/bos/pad ids (the generation config's, else tokenizer_config.json's, else <|endoftext|>; bos defaults to eos), add_bos and
    add_eos from its post-processor (what `tokenizers` adds on encode), tokenizer_config.json's chat template;
  * the project's byte tokenizer (train/tokenize.py ByteTokenizer) when there is no tokenizer.json and the
    checkpoint says `bam_tokenizer: bytes` or its vocabulary has 256 to 512 tokens (train's rule): token i is
    GPT-2's byte-to-unicode character of byte i (1..255), token 0 the end-of-text token (eos and bos; no BOS is
    added, as the runtime adds none), ids from 256 up [PADn], no merges, so llama.cpp encodes text to its UTF-8
    bytes as the runtime does (NUL bytes dropped by both).
Anything else is refused in one line naming why.

The model card is GGUF metadata: general.name (OUT's stem), general.description (what the model is, how it was
made), general.base_model.* (the merge's inputs from the provenance record, or the converted source),
general.license when the input's README.md front matter names one, general.file_type; and bam_surgery.format
(the mark by which --force recognises the file as ours, runtime/outputs.py), bam_surgery.version,
bam_surgery.config (the ModelConfig of the tensors written, as JSON: qkv_bias true where zero biases were added),
bam_surgery.provenance (a merge's record, when there is one).
The file is written under a temporary name beside OUT and renamed at the end (runtime/atomic.py).
"""
from __future__ import annotations

import errno
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from functools import lru_cache
from typing import Any, Callable, Iterable, Mapping

import numpy as np
import torch

from bam_surgery import __version__
from bam_surgery.runtime.atomic import atomic_path
from bam_surgery.runtime.checkpoint import PROVENANCE_KEY, provenance_inputs
from bam_surgery.runtime.config import ModelConfig
from bam_surgery.runtime.dtypes import main_dtype
from bam_surgery.runtime.errors import CheckpointError, OptionError, printable
from bam_surgery.runtime.jsonfile import json_field, parse_json
from bam_surgery.runtime.layout import tensor_shapes
from bam_surgery.runtime.options import declared
from bam_surgery.runtime.outputs import FORMAT, GGUF_FORMAT_KEY
from bam_surgery.runtime.reader import Reader, check_layout
from bam_surgery.runtime.shards import read_side_file

from .base import CapabilityError, ExportOptions, Exporter
from .hf.files import side_file
from .byte_tokenizer import (BYTE_FALLBACK_MAX_VOCAB, BYTE_VOCAB, BYTES, EOS_CANDIDATES, TOKENIZER_KEY,
                             byte_symbols, unavailable_tokenizer, uses_byte_tokenizer)
from .hf.architectures import ARCHITECTURES
from .carry import SIZES, TRAINING, Carry, Column, anything, rule, values
from .hf.moe_family import BIASES, bias_row, hybrid_rows, raise_problems, spec_rows
from .gguf_tokenizer import PRE_TOKENIZERS, pre_tokenizer_name
from .gguf_table import (ARCHS, attn_scale_dim, fused_of, geometry_keys, gguf_module, hparams, is_norm, join_heads,
                         linear_interval, linear_keys, linear_tensor, nope_layers, pattern_layers, rope_heads,
                         rope_pairs, rope_scaling, sliding_layers, tensor_layout, tensor_names, window_keys)
from .native_moe import as_held, zeros_note

GGUF_DTYPES = ("f32", "f16", "q8_0")
SUFFIX = ".gguf"
EOS_TEXT = "<|endoftext|>"

# ---- what llama.cpp can run ----------------------------------------------------------------------------
_QK_NORMS = {"none": "no QK-norm", "head": "a per-head QK-norm", "full": "a full-width QK-norm"}
_NORM_POSITIONS = {"pre": "norms before attention and FFN", "post": "norms after attention and FFN",
                   "sandwich": "norms before and after attention and FFN"}
_SOFTCAPS = {"none": "no {} soft-capping", "always": "{} soft-capping", "optional": ""}


def _features(cfg: ModelConfig) -> dict[str, Any]:
    """What of a config picks llama.cpp's architecture for it: its trunk (QK-norm, norm position, layers without RoPE,
    shared expert), then what a family record's Gguf.picks name (a RoPE type, q/k/v biases)."""
    return dict(linear=bool(cfg.linear_layers), v_norm=cfg.v_norm, qk_norm=cfg.qk_norm,
                norm_position=cfg.norm_position, nope=bool(cfg.nope_layers), shared=bool(cfg.ffn_shared_hidden),
                rope_type=(cfg.scaled_rope or {}).get("rope_type"), qkv_bias=cfg.qkv_bias)


FAMILY_FEATURES = ("linear", "v_norm")  # a family's own layers (Qwen3.5's Gated DeltaNet, Gemma 4's): first of all
TRUNK_FEATURES = ("qk_norm", "norm_position", "nope", "shared")


def candidates(cfg: ModelConfig) -> list[str]:
    """llama.cpp's architectures of the model's kind (a mixture's: those with a gating), the nearest first: fewest
    of the family's own layers (FAMILY_FEATURES), then trunk features (_features) that differ from the row's, then
    fewest others, then in gguf_table.ARCHS order."""
    want = _features(cfg)
    rows = [r for r in ARCHS.values() if (r.gate_norm is not None if cfg.ffn_experts else r.hf_dense is not None)]

    def misses(row) -> tuple[int, int, int]:
        have = {**dict(linear=False, v_norm=False, qk_norm=row.qk_norm, norm_position=row.norm_position,
                       nope=bool(row.nope_every), shared=row.shared_expert, rope_type=None, qkv_bias=False),
                **row.picks}
        differ = {k for k, v in want.items() if have[k] != v}
        return (len(differ & set(FAMILY_FEATURES)), len(differ & set(TRUNK_FEATURES)),
                len(differ - set(TRUNK_FEATURES) - set(FAMILY_FEATURES)))

    return [r.name for r in sorted(rows, key=misses)]


def gguf_architecture(cfg: ModelConfig) -> str:
    """llama.cpp's architecture for a model: the first candidate that computes exactly what it computes (else the
    first, whose problems check_gguf reports)."""
    options = candidates(cfg)
    return next((a for a in options if not arch_problems(cfg, a)), options[0])


def gguf_problems(cfg: ModelConfig) -> list[tuple[str, str]]:
    """(what llama.cpp needs, what this model has) for every feature the architecture gguf_architecture picks lacks;
    attention experts alone, where the model has them (no architecture of llama.cpp has any)."""
    problems = arch_problems(cfg, gguf_architecture(cfg))
    return problems[:1] if cfg.attn_experts else problems


def arch_problems(cfg: ModelConfig, arch: str) -> list[tuple[str, str]]:
    """What llama.cpp's `arch` lacks for this model: the failures of its column (arch_column). A mixture whose norm
    position no llama.cpp mixture has is told that alone."""
    mixtures = [r for r in ARCHS.values() if r.gate_norm is not None]
    if cfg.ffn_experts and not cfg.attn_experts and cfg.norm_position not in {r.norm_position for r in mixtures}:
        names = [r.name for r in mixtures]
        return [(f"a dense model, or a mixture of llama.cpp's {', '.join(names[:-1])} or {names[-1]} (none has "
                 f"{_NORM_POSITIONS[cfg.norm_position]})", f"a mixture with {_NORM_POSITIONS[cfg.norm_position]}")]
    return arch_column(arch).problems(cfg)


def _when(kind: bool, rows: Iterable[Carry], tag: str) -> list[Carry]:
    """Rows that apply to a mixture (kind True) or a dense model only (`tag` in the table's cells, or none)."""
    def shown(r: Carry) -> str | dict[str, str]:
        tagged = {f: s if s.startswith("any") or not tag else f"{s} ({tag})" for f in r.fields for s in [r.shown_for(f)]}
        return tagged if len(set(tagged.values())) > 1 else next(iter(tagged.values()))
    return [Carry(r.fields, (lambda r: lambda cfg: bool(cfg.ffn_experts) != kind or r.ok(cfg))(r), r.needs, r.has,
                  shown(r), r.allowed) for r in rows]


def _plain(row, cfg: ModelConfig) -> ModelConfig:
    """A mixture's config with the trunk llama.cpp's row decides itself left plain (its FFN side judged alone)."""
    return cfg.replace(qk_norm="none", norm_position="pre", nope_layers=None, scaled_rope=None,
                       gate_norm=row.gate_norm or cfg.gate_norm)


@lru_cache(maxsize=None)
def arch_column(arch: str) -> Column:
    """What llama.cpp's `arch` carries (converters/carry.py), from its gguf_table.ARCHS row: a mixture's FFN side as
    the native HF format the row names judges it (hf/moe_family.py: llama.cpp runs the same experts), a dense model's
    from the row, then the trunk both share; the llama.cpp column of the table of what runs where."""
    row = ARCHS[arch]
    if row.linear_attention or row.per_layer_geometry:
        return _family_column(row)
    rows: list[Carry] = [values("attn_experts", (0,), "dense attention (llama.cpp has no attention experts)",
                                "{} attention experts")]
    if row.gate_norm is None:  # a dense row: the mixture's fields do not apply (its kind's candidates only)
        rows += anything("ffn_top_k", "gate_norm", "router", "router_hidden", "router_temperature",
                         shown="any (no experts)")
    else:
        judge = ARCHITECTURES[row.moe_checks].config.column
        decides = _ROW_DECIDES | (set(BIASES) if row.moe_biases is not None else set())
        lifted = [Carry(r.fields, (lambda r: lambda cfg: r.ok(_plain(row, cfg)))(r),
                        (lambda r: lambda cfg: r.needs_text(_plain(row, cfg)))(r),
                        (lambda r: lambda cfg: r.has_text(_plain(row, cfg)))(r), r.shown, r.allowed)
                  for r in judge.rows if not set(r.fields) & decides]
        biases = [] if row.moe_biases is None else [
            bias_row(row.moe_biases, f"no biases but on {' and '.join(row.moe_biases)} (llama.cpp's {arch})")]
        rows += _when(True, [*lifted, *biases, _gates(row)], "mixture" if row.hf_dense else "")
    if row.hf_dense is not None:
        rows += _when(False, [r for r in _dense_rows(row) if not set(r.fields) & set(row.carries)],
                      "dense" if row.gate_norm else "")
    rows += anything(*row.carries, shown="any (its keys)")
    return Column(f"gguf:{arch}", (*rows, *_trunk_rows(row), *anything(*SIZES, "rope_theta", *TRAINING),
                                   *anything("attn_top_k", "kv_mode", "attn_router", shown="any (no attention experts)")))


def _family_column(row) -> Column:
    """llama.cpp's architectures of a family's own layers (qwen35, qwen35moe, gemma4): what the family's HF format
    carries (a mixture's: its native format's column; a dense model's: its record's config map, hf/moe_family.py
    spec_rows; llama.cpp's converter reads the same config.json), and llama.cpp's own limits beyond it."""
    arch, own = row.name, f" (llama.cpp's {row.name})"
    if row.gate_norm is not None:
        rows = list(ARCHITECTURES[row.moe_checks].config.column.rows)
    else:
        rows = [values("attn_experts", (0,), "dense attention (llama.cpp has no attention experts)",
                       "{} attention experts"),
                *anything("ffn_top_k", "gate_norm", "router", "router_hidden", "router_temperature",
                          shown="any (no experts)"),
                *spec_rows(ARCHITECTURES[row.hf_dense].config, row.hf_dense), *anything(*TRAINING),
                *anything("attn_top_k", "kv_mode", "attn_router", shown="any (no attention experts)")]
    if row.linear_attention:
        rows += [rule("linear_layers", lambda cfg: linear_interval(cfg) is not None,
                      "Gated DeltaNet layers in all but every n-th layer (full_attention_interval)" + own,
                      "Gated DeltaNet layers {}", "all but every n-th layer"),
                 rule("scaled_rope", lambda cfg: cfg.scaled_rope is None, "plain RoPE" + own, "scaled_rope {}",
                      "None")]
    if row.per_layer_geometry:
        def proportional(cfg) -> bool:
            s = cfg.scaled_rope or {}
            return s.get("rope_type") == "proportional" and s.get("factor", 1.0) == 1.0
        rows += [rule("scaled_rope", proportional, "proportional RoPE without a factor in the global layers" + own,
                      "scaled_rope {}", "proportional (no factor)"),
                 rule("tie_embeddings", lambda cfg: cfg.tie_embeddings, "tied embeddings" + own,
                      "an lm_head of its own", "True")]
    return Column(f"gguf:{arch}", tuple(rows))


# the row's to decide, not the judge's
_ROW_DECIDES = {"qk_norm", "norm_position", "nope_layers", "scaled_rope", "gate_norm", "attn_experts"}


def _gates(row) -> Carry:
    arch = row.name
    return rule("gate_norm", lambda cfg: cfg.gate_norm == row.gate_norm or cfg.ffn_top_k == cfg.ffn_experts,
                "gates p_i of the softmax over all experts, not renormalized over the top-k (llama.cpp's "
                f"{arch}; rebuild the mixture with --gate-norm softmax)" if row.gate_norm == "softmax" else
                f"top-k gates renormalized to sum to 1 (llama.cpp's {arch}; rebuild the mixture with --gate-norm "
                "topk_softmax)", lambda cfg: f"gate_norm {cfg.gate_norm} with top-{cfg.ffn_top_k} of "
                                             f"{cfg.ffn_experts} experts", row.gate_norm)


def _dense_rows(row) -> list[Carry]:
    arch = row.name
    return [values("activation", (row.activation,), f"{_ACTIVATIONS[row.activation]} FFNs (llama.cpp's {arch})",
                   "activation {}"),
            values("norm", ("rmsnorm",), "RMSNorm", "norm {}"),
            values("norm_bias", (False,), "norms without bias", "norm biases"),
            values("block", ("sequential",), "sequential blocks", "block {}"),
            values("position", ("rope",), "RoPE", "position {}"),
            values("rotary_fraction", (1.0,), "RoPE over the whole head", "rotary_fraction {}"),
            values("logit_scale", (1.0,), "unscaled logits", "logit_scale {}"),
            values("final_norm", (True,), "a final norm", "no final norm"),
            bias_row(row.biases, f"no biases but on {' and '.join(row.biases)} (llama.cpp's {arch})"
                     if row.biases else f"no biases (llama.cpp's {arch})"),
            *feature_rows(row), *hybrid_rows()]


def _trunk_rows(row) -> list[Carry]:
    arch = row.name
    nope = lambda cfg: nope_layers(row, cfg)  # noqa: E731
    out = [rule("rope_interleaved", lambda cfg: row.rope_pairs or not cfg.rope_interleaved,
                f"half-split RoPE (llama.cpp's {arch})", "interleaved RoPE", "any" if row.rope_pairs else "False"),
           values("qk_norm", (row.qk_norm,), f"{_QK_NORMS[row.qk_norm]} (llama.cpp's {arch})",
                  lambda cfg: _QK_NORMS.get(cfg.qk_norm, "")),
           values("norm_position", (row.norm_position,), f"{_NORM_POSITIONS[row.norm_position]} (llama.cpp's {arch})",
                  lambda cfg: _NORM_POSITIONS.get(cfg.norm_position, "")),
           rule("nope_layers", lambda cfg: (cfg.nope_layers or None) == nope(cfg),
                lambda cfg: f"no RoPE in layers {nope(cfg)} (llama.cpp's {arch}: "
                            f"{'its layers without a window' if row.rope_sliding_only else f'every {row.nope_every}th'})"
                if nope(cfg) else f"RoPE in every layer (llama.cpp's {arch})",
                lambda cfg: f"no RoPE in layers {cfg.nope_layers}" if cfg.nope_layers else "RoPE in every layer",
                "the layers without a window" if row.rope_sliding_only else
                f"every {row.nope_every}th layer" if row.nope_every else "None")]
    if row.q_is_d_model:
        out.append(rule(("n_heads", "head_dim"), lambda cfg: cfg.n_heads * cfg.head_dim == cfg.d_model,
                        f"n_heads * head_dim = d_model (llama.cpp's {arch})",
                        lambda cfg: f"{cfg.n_heads} heads of {cfg.head_dim} in d_model {cfg.d_model}",
                        "n_heads * head_dim = d_model"))
    return [*out, *_rope_rows(row)]


_ACTIVATIONS = {"swiglu": "SwiGLU", "geglu_tanh": "GeGLU (tanh GELU)"}


def feature_rows(row) -> list[Carry]:
    """The newer families' features (gguf_table's WINDOWS section) llama.cpp's dense `arch` computes otherwise: scaled
    embeddings, soft-capping, the attention scale, sliding windows and their RoPE, tied embeddings. ((1 + w) norms are
    carried everywhere: stored as 1 + w, llama.cpp multiplies by them.)"""
    arch = row.name
    own = f" (llama.cpp's {arch})"
    scaled = "embeddings times sqrt(d_model)"
    dim = lambda cfg: attn_scale_dim(arch, cfg.d_model, cfg.n_heads, cfg.n_layers, cfg.head_dim)  # noqa: E731
    plain_local = lambda cfg: cfg.window_rope_theta is not None  # noqa: E731  the sliding layers' RoPE: unscaled
    local = {True: "sliding layers with unscaled RoPE", False: "sliding layers with the global RoPE scaling"}
    out = [values("scale_embeddings", (row.scale_embeddings,), (scaled if row.scale_embeddings else
                  "unscaled embeddings") + own, lambda cfg: scaled if cfg.scale_embeddings else "unscaled embeddings")]
    for which, field, mode in (("attention", "attn_softcap", row.attn_softcap),
                               ("final", "final_softcap", row.final_softcap)):
        out.append(rule(field, (lambda field, mode: lambda cfg: mode == "optional"
                                or (mode == "always") == (getattr(cfg, field) is not None))(field, mode),
                        _SOFTCAPS[mode].format(which) + own,
                        (lambda field, which: lambda cfg: f"{which} soft-capping {getattr(cfg, field)}"
                         if getattr(cfg, field) is not None else f"no {which} soft-capping")(field, which),
                        {"none": "None", "always": "> 0", "optional": "any"}[mode]))
    out += [rule("attn_scale_dim", lambda cfg: (cfg.attn_scale_dim or cfg.head_dim) == dim(cfg),
                 lambda cfg: f"attention scaled by 1/sqrt({dim(cfg)})" + own,
                 "attention scaled by 1/sqrt({})", "llama.cpp's scale"),
            _window_row(row),
            # gemma2 always builds its sliding-window cache, and aborts (GGML_ASSERT is_swa_any) on a file without
            rule("attn_window_layers", lambda cfg: row.windows != "always" or any(sliding_layers(cfg)),
                 "sliding-window layers" + own, "no sliding-window layers",
                 "some" if row.windows == "always" else "any"),
            rule("window_rope_theta", lambda cfg: not any(sliding_layers(cfg)) or cfg.scaled_rope is None
                 or plain_local(cfg) == (row.window_rope == "plain"), local[row.window_rope == "plain"] + own,
                 lambda cfg: local[plain_local(cfg)], "any"),
            rule("tie_embeddings", lambda cfg: cfg.tie_embeddings or not row.tied_only, "tied embeddings" + own,
                 "an lm_head of its own", "True" if row.tied_only else "any"),
            *anything("norm_unit_offset", shown="any (stored as 1 + w)")]
    return out


def _window_row(row) -> Carry:
    """The sliding windows llama.cpp's architecture computes: none, any, or (fixed) its pattern at one block count."""
    own = f" (llama.cpp's {row.name})"
    if row.windows != "fixed":
        return rule("attn_window", lambda cfg: row.windows != "none" or cfg.attn_window is None,
                    "attention over the whole prefix" + own, "a sliding window of {}",
                    "None" if row.windows == "none" else "any")
    fixed = f"windows in the layers i with i % {row.window_pattern} < {row.window_pattern - 1} at {row.window_block_count} layers"
    return rule("attn_window", lambda cfg: cfg.attn_window is None or (
        cfg.n_layers == row.window_block_count and sliding_layers(cfg) == pattern_layers(row.window_pattern,
                                                                                          cfg.n_layers)),
        f"attention over the whole prefix, or {fixed}{own}",
        lambda cfg: f"a sliding window of {cfg.attn_window} in layers {cfg.attn_window_layers} of {cfg.n_layers}",
        f"None, or {fixed}")


def _rope_rows(row) -> list[Carry]:
    """Scaled RoPE llama.cpp's `arch` applies as the runtime does (gguf_table's ROPE section)."""
    arch, supported = row.name, row.rope_scalings
    kind = lambda cfg: (cfg.scaled_rope or {}).get("rope_type")  # noqa: E731

    def yarn_ok(cfg) -> bool:
        s = cfg.scaled_rope or {}
        return kind(cfg) != "yarn" or (s.get("beta_fast", 32) == 32 and s.get("beta_slow", 1) == 1
                                       and s.get("truncate", True))

    def yarn_has(cfg) -> str:
        s = cfg.scaled_rope
        return (f"yarn with beta_fast {s.get('beta_fast', 32)}, beta_slow {s.get('beta_slow', 1)}, truncate "
                f"{s.get('truncate', True)}")

    why = lambda cfg: " (llama.cpp has no dynamic NTK scaling)" if kind(cfg) == "dynamic" else ""  # noqa: E731
    return [rule("scaled_rope", lambda cfg: kind(cfg) in (None, *supported),
                 lambda cfg: f"RoPE scaling llama.cpp's {arch} applies ({', '.join(supported)}){why(cfg)}",
                 lambda cfg: f"rope_type {kind(cfg)!r}", f"None, {', '.join(supported)}"),
            rule("scaled_rope", yarn_ok, f"YaRN with beta_fast 32, beta_slow 1 and truncated correction dims "
                 f"(llama.cpp's {arch})", yarn_has, "yarn: beta_fast 32, beta_slow 1, truncated")]


def check_gguf(cfg: ModelConfig, recipe: str | None = None) -> None:
    """Raise CapabilityError (one line) if llama.cpp cannot compute exactly what this model computes
    (converters/export.py:check_export adds the formats that carry it)."""
    raise_problems(gguf_problems(cfg), "gguf export (llama.cpp)", recipe)


def parse_gguf_dtype(text: str) -> str:
    """--dtype f32|f16|q8_0."""
    if text not in GGUF_DTYPES:
        raise OptionError(f"--dtype: unknown dtype {text!r}; choose one of {', '.join(GGUF_DTYPES)}")
    return text


@dataclass(frozen=True)
class GGUFOptions:
    """The gguf format's own options (`bam-surgery export-gguf` declares its flags from them)."""

    dtype: str | None = declared(
        None, "--dtype", metavar="|".join(GGUF_DTYPES), parse=parse_gguf_dtype,
        help="Type of the weight matrices: f32, f16 or q8_0 (8-bit blocks of 32); norms, biases and routers stay f32. "
             "Default: f32 for float32 checkpoints, f16 for 16-bit ones.")


def resolve_dtype(reader: Reader, own: GGUFOptions) -> str:
    """The matrices' type: the one asked for, else f32 for float32 weights and f16 for 16-bit ones."""
    if own.dtype is not None:
        if own.dtype not in GGUF_DTYPES:
            raise CapabilityError(f"gguf dtype {own.dtype!r}: choose one of {', '.join(GGUF_DTYPES)}")
        return own.dtype
    entries = [(n, reader.shape(n), reader.dtype(n)) for n in reader.names()]
    return "f32" if main_dtype(entries) == torch.float32 else "f16"


# ---- tensors ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorPlan:
    parts: tuple[str, ...]  # the canonical tensors it holds, stacked along the rows (one but for fused tensors)
    name: str  # llama.cpp's
    shape: tuple[int, ...]
    qtype: Any  # gguf.GGMLQuantizationType
    heads: int | None  # rope_pairs over this many heads, or None
    fixed: np.ndarray | None = None  # a tensor computed from the config (RoPE frequency factors), not read
    unit_offset: bool = False  # a (1 + w) norm's weight w, written as 1 + w (float32)

    @property
    def canonical(self) -> str:
        return self.parts[0] if self.parts else self.name


def plan_tensors(cfg: ModelConfig, arch: str, dtype: str) -> list[TensorPlan]:
    """Every tensor of the file: RoPE's frequency factors (gguf_table.rope_scaling, f32), then the model's in canonical
    order with their names (gguf_table.tensor_layout), types and the Q/K permutation; for an architecture that always
    loads output.weight (qwen2moe, olmo2) with tied embeddings, the embedding once more as output.weight."""
    g = gguf_module()
    qt = g.GGMLQuantizationType
    matrix_type = {"f32": qt.F32, "f16": qt.F16, "q8_0": qt.Q8_0}[dtype]
    block = g.GGML_QUANT_SIZES[qt.Q8_0][0]
    layout, unmapped = tensor_layout(arch, cfg)
    if unmapped:
        raise CapabilityError(f"gguf export: llama.cpp's {arch} architecture has no tensor for {unmapped[0]}")
    shapes = tensor_shapes(cfg)
    out = [TensorPlan((), name, data.shape, qt.F32, None, data) for name, data in rope_scaling(cfg)[1].items()]
    for name, parts in layout.items():
        first = shapes[parts[0]]
        shape = (sum(shapes[c][0] for c in parts), *first[1:])
        if len(shape) < 2 or "_router." in parts[0] or "_shared_gate." in parts[0]:
            qtype = qt.F32
        elif matrix_type == qt.Q8_0 and shape[-1] % block:
            qtype = qt.F16
        else:
            qtype = matrix_type
        heads = rope_heads(parts[0], cfg, arch) if len(parts) == 1 else None
        out.append(TensorPlan(parts, name, shape, qtype, heads, unit_offset=cfg.norm_unit_offset and is_norm(parts[0])))
        if parts == ("embed.weight",) and ARCHS[arch].output_always and cfg.tie_embeddings:
            out.append(TensorPlan(parts, tensor_names(arch, cfg.n_layers)["lm_head.weight"], shape, qtype, None))
    return out


# llama.cpp's qwen2moe computes the shared expert's gate sigmoid(y), y = x . w, as silu(y) / y: 0 / 0 = NaN for
# every token when w is all zeros, as btx-shared-expert merges it (the gate at 1/2). Such a w is written as this
# value everywhere (kept f32): |y| stays many orders of magnitude below f32's resolution at 1/2, so llama.cpp gets
# silu(y) / y = 1/2 for every token, which is what w = 0 computes.
SHEXP_GATE_EPS = 1e-20
_SHARED_GATE = re.compile(r"layers\.\d+\.ffn_shared_gate\.weight")


def _encoded(t: TensorPlan, reader: Reader, arch: str) -> np.ndarray:
    if t.fixed is not None:
        return t.fixed
    cfg = reader.config
    parts = [linear_tensor(c, reader.get(c), cfg, to_gguf=True) for c in t.parts]
    fused = fused_of(arch, t.parts[0]) if len(parts) > 1 else None
    w = join_heads(parts, cfg.n_heads) if fused is not None and fused.per_head else torch.cat(parts) \
        if len(parts) > 1 else parts[0]
    if t.heads is not None:
        w = rope_pairs(w, t.heads)
    if _SHARED_GATE.fullmatch(t.canonical) and not w.any():
        w = torch.full(w.shape, SHEXP_GATE_EPS, dtype=torch.float32)
    if t.unit_offset:
        w = w.to(torch.float32) + 1.0
    return gguf_module().quants.quantize(w.to(torch.float32).contiguous().numpy(), t.qtype)


def _byte_shape(t: TensorPlan) -> tuple[tuple[int, ...], int, Any]:
    """(shape to declare, bytes, numpy dtype) of a tensor in its type, for the header written before the data."""
    g = gguf_module()
    qt = g.GGMLQuantizationType
    if t.qtype in (qt.F32, qt.F16):
        dtype = np.float32 if t.qtype == qt.F32 else np.float16
        return t.shape, int(np.prod(t.shape)) * np.dtype(dtype).itemsize, dtype
    shape = g.quant_shape_to_byte_shape(t.shape, t.qtype)
    return shape, int(np.prod(shape)), np.uint8


# ---- tokenizer -------------------------------------------------------------------------------------------
@dataclass
class Vocabulary:
    """What goes into tokenizer.ggml.* (llama.cpp's gpt2 model)."""

    source: str  # for the card: "tokenizer.json" or "bytes"
    pre: str
    tokens: list[str]
    types: list[int]
    merges: list[str]
    eos: int | None
    bos: int | None = None
    pad: int | None = None
    add_bos: bool = False
    add_eos: bool = False
    chat_template: str | None = None
    notes: list[str] = field(default_factory=list)


def byte_vocabulary(vocab_size: int) -> Vocabulary:
    """The runtime's byte tokenizer as a gpt2 vocabulary: 0 end of text, 1..255 the bytes, no merges."""
    g = gguf_module()
    chars = byte_symbols()
    tokens = ([EOS_TEXT] + [chars[b] for b in range(1, BYTE_VOCAB)]
              + [f"[PAD{i}]" for i in range(BYTE_VOCAB, vocab_size)])
    types = ([g.TokenType.CONTROL] + [g.TokenType.NORMAL] * (BYTE_VOCAB - 1)
             + [g.TokenType.UNUSED] * (vocab_size - BYTE_VOCAB))
    return Vocabulary(BYTES, "gpt-2", tokens, [int(t) for t in types], [], eos=0, bos=0)


def _special_ends(post: Any, where: str) -> tuple[str | None, str | None]:
    """(the special token a tokenizer.json post-processor puts first, last) on a single sequence."""
    if post is None or (isinstance(post, dict) and post.get("type") == "ByteLevel"):
        return None, None
    if isinstance(post, dict) and post.get("type") == "Sequence":
        ends = [_special_ends(p, where) for p in json_field(post, "processors", list, f"{where}: post_processor",
                                                             default=[])]
        return (next((a for a, _ in ends if a), None), next((b for _, b in ends if b), None))
    if isinstance(post, dict) and post.get("type") == "TemplateProcessing" and isinstance(post.get("single"), list):
        single = post["single"]
        if not all(isinstance(item, dict) for item in single):
            raise CheckpointError(f"{where}: post_processor.single holds an item that is not an object")

        def special(i: int) -> str | None:
            if "SpecialToken" not in single[i]:
                return None
            entry = json_field(single[i], "SpecialToken", dict, f"{where}: post_processor.single[{i}]")
            return json_field(entry, "id", str, f"{where}: post_processor.single[{i}].SpecialToken")
        return (special(0) if single else None, special(len(single) - 1) if len(single) > 1 else None)
    kind = post.get("type") if isinstance(post, dict) else type(post).__name__
    raise CapabilityError(f"{where}: post-processor {str(kind)[:40]!r} is not one this export maps to llama.cpp "
                          "(ByteLevel, TemplateProcessing)")


def _vocab_entries(body: dict, where: str) -> dict[int, tuple[str, str]]:
    """id -> (token text, kind: normal | control | user) from tokenizer.json's model.vocab and added_tokens."""
    vocab = body["model"].get("vocab")
    if not isinstance(vocab, dict) or not all(isinstance(i, int) and 0 <= i < 2**31 for i in vocab.values()):
        raise CheckpointError(f"{where}: model.vocab is not an object of token -> id")
    out = {i: (t, "normal") for t, i in vocab.items()}
    for a in json_field(body, "added_tokens", list, where, default=[]):
        if not (isinstance(a, dict) and isinstance(a.get("id"), int) and isinstance(a.get("content"), str)):
            raise CheckpointError(f"{where}: added_tokens holds an entry without an integer id and a content string")
        special = a.get("special") or (a["content"].startswith("<|") and a["content"].endswith("|>"))
        out[a["id"]] = (a["content"], "control" if special else "user")
    return out


def _merges(model: dict, where: str) -> list[str]:
    merges = json_field(model, "merges", list, f"{where}: model", default=[])
    out = []
    for m in merges:
        if isinstance(m, list) and len(m) == 2 and all(isinstance(p, str) for p in m):
            m = " ".join(m)
        if not isinstance(m, str) or " " not in m[1:]:
            raise CheckpointError(f"{where}: model.merges holds {str(m)[:40]!r}, not a pair of tokens")
        out.append(m)
    return out


def _check_bpe_model(body: dict, where: str) -> dict:
    model = body.get("model")
    if not isinstance(model, dict) or model.get("type") != "BPE":
        kind = model.get("type") if isinstance(model, dict) else None
        raise CapabilityError(f"{where}: a {str(kind)[:30]} tokenizer; the gguf export embeds byte-level BPE "
                              "tokenizers (GPT-2, Llama 3, Qwen2 kinds) and the byte tokenizer")
    for key in ("byte_fallback", "continuing_subword_prefix", "end_of_word_suffix", "dropout"):
        if model.get(key):
            raise CapabilityError(f"{where}: BPE with {key} {str(model[key])[:30]!r} is not llama.cpp's byte-level "
                                  "BPE")
    normalizer = body.get("normalizer")
    if normalizer is not None and not (isinstance(normalizer, dict) and normalizer.get("type") == "NFC"):
        raise CapabilityError(f"{where}: normalizer {json.dumps(normalizer)[:80]} is not applied by llama.cpp's "
                              "byte-level BPE")
    return model


def bpe_vocabulary(path: Path, vocab_size: int, generation: Mapping[str, Any],
                   tokenizer_config: Mapping[str, Any]) -> Vocabulary:
    """tokenizer.json (a byte-level BPE) as llama.cpp's gpt2 vocabulary of exactly vocab_size tokens."""
    g = gguf_module()
    where = str(path)
    body = parse_json(read_side_file(path), where, expect=dict)  # through its one checked descriptor
    model = _check_bpe_model(body, where)
    pre = pre_tokenizer_name(body.get("pre_tokenizer"), where)
    if bool(model.get("ignore_merges")) != PRE_TOKENIZERS[pre][2]:
        how = "ignores" if PRE_TOKENIZERS[pre][2] else "applies"
        raise CapabilityError(f"{where}: ignore_merges {bool(model.get('ignore_merges'))} with a {pre} pre-tokenizer; "
                              f"llama.cpp's {pre} {how} merges on whole words")
    entries = _vocab_entries(body, where)
    if max(entries, default=-1) >= vocab_size:
        raise CapabilityError(f"{where}: token id {max(entries)} is outside the model's vocabulary "
                              f"(vocab_size {vocab_size})")
    kinds = {"normal": g.TokenType.NORMAL, "control": g.TokenType.CONTROL, "user": g.TokenType.USER_DEFINED}
    tokens = [entries[i][0] if i in entries else f"[PAD{i}]" for i in range(vocab_size)]
    types = [int(kinds[entries[i][1]]) if i in entries else int(g.TokenType.UNUSED) for i in range(vocab_size)]
    ids = {t: i for i, t in enumerate(tokens)}
    first, last = _special_ends(body.get("post_processor"), where)
    eos = _token_id(generation, "eos", tokenizer_config, ids, EOS_CANDIDATES)
    bos = ids.get(first) if first else _token_id(generation, "bos", tokenizer_config, ids, ())
    vocab = Vocabulary("tokenizer.json", pre, tokens, types, _merges(model, where), eos=eos,
                       bos=bos if bos is not None else eos,  # GPT-2's convention; llama.cpp's default (11) is a token
                       pad=_token_id(generation, "pad", tokenizer_config, ids, ()),
                       add_bos=first is not None, add_eos=last is not None)
    template = tokenizer_config.get("chat_template")
    vocab.chat_template = template if isinstance(template, str) else None
    if isinstance(body.get("normalizer"), dict):
        vocab.notes.append("tokenizer.json's NFC normalizer is not applied by llama.cpp (text already in NFC "
                           "tokenizes the same)")
    return vocab


def _token_id(generation: Mapping[str, Any], kind: str, tokenizer_config: Mapping[str, Any], ids: dict[str, int],
              candidates: tuple[str, ...]) -> int | None:
    """A special token's id: the generation config's {kind}_token_id, else tokenizer_config.json's
    {kind}_token, else the first of `candidates` in the vocabulary."""
    value = generation.get(f"{kind}_token_id")
    if isinstance(value, list):
        value = value[0] if value else None
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < len(ids):
        return value
    text = tokenizer_config.get(f"{kind}_token")
    if isinstance(text, str) and text in ids:
        return ids[text]
    return next((ids[c] for c in candidates if c in ids), None)


def _tokenizer_config(path: Path) -> dict[str, Any]:
    """The fields of tokenizer_config.json this export uses, type-checked: each special token a string or an
    added-token object ({"content": string}, taken as its content); chat_template a string (or transformers'
    list of named templates, which llama.cpp's one template cannot carry: left out)."""
    where = str(path)
    body = parse_json(read_side_file(path), where, expect=dict)  # through its one checked descriptor
    out: dict[str, Any] = {}
    for kind in ("eos", "bos", "pad"):
        value = json_field(body, f"{kind}_token", (str, dict), where)
        if isinstance(value, dict):
            value = json_field(value, "content", str, f"{where}: {kind}_token")
        out[f"{kind}_token"] = value
    template = json_field(body, "chat_template", (str, list), where)
    out["chat_template"] = template if isinstance(template, str) else None
    return out


def find_vocabulary(reader: Reader, options: ExportOptions) -> Vocabulary:
    """The tokenizer the file embeds (module docstring), or CapabilityError naming why there is none."""
    cfg = reader.config
    files = {Path(f).name: Path(f) for f in options.tokenizer_files}
    generation = dict(options.generation or {})
    if "tokenizer.json" in files:
        tok_config = {}
        if "tokenizer_config.json" in files:
            tok_config = _tokenizer_config(files["tokenizer_config.json"])
        vocab = bpe_vocabulary(files["tokenizer.json"], cfg.vocab_size, generation, tok_config)
        if "chat_template.jinja" in files:  # transformers' own file for the template, ahead of tokenizer_config's
            vocab.chat_template = read_side_file(files["chat_template.jinja"]).decode("utf-8", errors="replace")
        return vocab
    missing = unavailable_tokenizer(reader.metadata)
    if missing is not None:  # its own tokenizer could not be rebuilt: never the byte tokenizer in its place
        raise CapabilityError(f"gguf export: {reader.path}: its tokenizer could not be rebuilt ({missing}), and "
                              "llama.cpp needs the vocabulary in the file")
    if uses_byte_tokenizer(reader.metadata.get(TOKENIZER_KEY) == BYTES, False, cfg.vocab_size) \
            and cfg.vocab_size >= BYTE_VOCAB:
        return byte_vocabulary(cfg.vocab_size)
    if files:
        raise CapabilityError(f"gguf export: the input's tokenizer ({', '.join(sorted(files))}) has no tokenizer.json; "
                              "llama.cpp needs its vocabulary (save a fast tokenizer's tokenizer.json beside it)")
    raise CapabilityError(f"gguf export: the input carries no tokenizer.json and its vocabulary ({cfg.vocab_size} "
                          f"tokens) is not the byte tokenizer's ({BYTE_VOCAB} to {BYTE_FALLBACK_MAX_VOCAB}); llama.cpp "
                          "needs the vocabulary in the file")


# ---- the card --------------------------------------------------------------------------------------------
def _license(reader: Reader) -> str | None:
    """`license:` of the input's README.md front matter (a Hugging Face model card), if it has one."""
    # a README.md linking out of the model folder is refused (side_file), as every side file is, and read through
    # its one checked descriptor (read_side_file): never another file's text in general.license
    readme = side_file(reader.source_dir, "README.md") if reader.source_dir is not None else None
    try:
        if readme is None or not readme.is_file() or readme.stat().st_size > 1 << 20:
            return None
    except OSError:
        return None
    text = read_side_file(readme, "README.md", max_bytes=1 << 20).decode("utf-8", errors="replace")
    if not text.startswith("---"):
        return None
    front = text[3:].split("\n---", 1)[0]
    m = re.search(r"^license:\s*['\"]?([^'\"\n#]+?)['\"]?\s*$", front, re.M)
    return m.group(1) if m else None


def _provenance(reader: Reader) -> dict | None:
    raw = reader.metadata.get(PROVENANCE_KEY)
    if not raw:
        return None
    try:
        value = parse_json(raw, PROVENANCE_KEY, expect=dict)
    except CheckpointError:
        return None
    return value


def card_entries(reader: Reader, out: Path, options: ExportOptions, arch: str, vocab: Vocabulary) -> dict[str, Any]:
    """general.* and bam_surgery.* entries: {key: value} (strings, or lists for base models)."""
    cfg = reader.config
    prov = _provenance(reader)
    layout = ARCHITECTURES[ARCHS[arch].hf_mixture].stands_for if cfg.ffn_experts else ""
    zeros = zeros_note(reader)
    if cfg.ffn_shared_hidden:
        renormalized = ARCHS[arch].gate_norm == "topk_softmax"
        kind = (f"FFN-expert mixture with a shared expert ({cfg.ffn_experts} routed experts, top-{cfg.ffn_top_k}, "
                f"gates {'renormalized over the top-k' if renormalized else 'from the softmax over all experts'}; a shared "
                f"expert of {cfg.ffn_shared_hidden} hidden units on every token, scaled by sigmoid(x . w); "
                f"{layout}'s layout{'; ' + zeros if zeros else ''})")
    elif cfg.ffn_experts:
        kind = (f"FFN-expert mixture ({cfg.ffn_experts} experts, top-{cfg.ffn_top_k}, gates renormalized over the "
                f"top-k, {layout}'s layout)")
    else:
        kind = "dense model"
    made = ""
    bases: list[tuple[str, str]] = []
    if prov is not None:
        recipe = (prov.get("recipe") or {}).get("name") if isinstance(prov.get("recipe"), dict) else None
        inputs = provenance_inputs(prov)
        bases = [(str(i.get("name")), f"{i.get('role')} ({i.get('path')})") for i in inputs]
        made = f" Merged with recipe {recipe} from {', '.join(n for n, _ in bases)}." if recipe else ""
    else:
        source = options.metadata.get("bam_source") or (str(reader.path) if reader.path else None)
        if source:
            bases = [(source, "converted source")]
            made = f" Converted from {source}."
    tokenizer = "the byte tokenizer (UTF-8 bytes, 0 = end of text)" if vocab.source == BYTES else f"{vocab.pre} BPE"
    description = (f"A {kind}: {cfg.n_layers} layers, d_model {cfg.d_model}, {cfg.n_heads} heads "
                   f"({cfg.n_kv_heads} KV), vocab {cfg.vocab_size}, as llama.cpp's {arch} architecture; tokenizer: "
                   f"{tokenizer}."
                   f"{made} Written by bam-surgery {__version__}.")
    entries: dict[str, Any] = {"name": out.name.removesuffix(SUFFIX), "description": description, "bases": bases,
                               "license": _license(reader), "config": json.dumps(cfg.to_dict(), sort_keys=True),
                               "provenance": reader.metadata.get(PROVENANCE_KEY) if prov is not None else None}
    return entries


# ---- the writer ------------------------------------------------------------------------------------------
def _write_metadata(w, cfg: ModelConfig, arch: str, dtype: str, vocab: Vocabulary, card: Mapping[str, Any]) -> None:
    g = gguf_module()
    w.add_string(GGUF_FORMAT_KEY, FORMAT)  # second entry, after general.architecture: runtime/outputs.py reads it
    w.add_string("bam_surgery.version", __version__)
    w.add_type(g.GGUFType.MODEL)
    w.add_name(card["name"])
    w.add_description(card["description"])
    if card["license"]:
        w.add_license(card["license"])
    if card["bases"]:
        w.add_base_model_count(len(card["bases"]))
        for i, (name, description) in enumerate(card["bases"]):
            w.add_base_model_name(i, name)
            w.add_base_model_description(i, description)
    w.add_tags(["bam-surgery", "mixture-of-experts" if cfg.ffn_experts else "dense"])
    w.add_file_type({"f32": g.LlamaFileType.ALL_F32, "f16": g.LlamaFileType.MOSTLY_F16,
                     "q8_0": g.LlamaFileType.MOSTLY_Q8_0}[dtype])
    if dtype == "q8_0":
        w.add_quantization_version(g.GGML_QUANT_VERSION)
    _write_hparams(w, cfg)
    _write_vocabulary(w, vocab)
    w.add_string("bam_surgery.config", card["config"])
    if card["provenance"]:
        w.add_string("bam_surgery.provenance", card["provenance"])


def _write_hparams(w, cfg: ModelConfig) -> None:
    """The architecture's keys llama.cpp reads ({arch}.context_length, ...): gguf_table.hparams, in its order, then
    the RoPE scaling's (gguf_table.rope_scaling) and the sliding windows' (gguf_table.window_keys)."""
    entries = {h.key: (h.kind, 1.0 / getattr(cfg, h.field) if h.reciprocal else getattr(cfg, h.field))
               for h in hparams() if h.when(cfg, w.arch)}
    entries.update(rope_scaling(cfg)[0])
    entries.update(window_keys(cfg, w.arch))
    if ARCHS[w.arch].linear_attention:
        entries.update(linear_keys(cfg))
    if ARCHS[w.arch].per_layer_geometry:  # its own values of some keys (per-layer arrays, the global head size)
        entries.update(geometry_keys(cfg))
    for key, (kind, value) in entries.items():
        add = {"f32": w.add_float32, "u32": w.add_uint32, "str": w.add_string, "bools": w.add_array,
               "u32s": w.add_array}[kind]
        add(key.format(arch=w.arch), float(value) if kind == "f32" else value)


def _write_vocabulary(w, vocab: Vocabulary) -> None:
    g = gguf_module()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(vocab.pre)
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.types)
    # llama.cpp requires the merges key; GGUFWriter.add_array skips an empty list, so it is set directly
    w.add_key_value(g.Keys.Tokenizer.MERGES, vocab.merges, g.GGUFValueType.ARRAY, sub_type=g.GGUFValueType.STRING)
    for key, value in (("eos", vocab.eos), ("bos", vocab.bos), ("pad", vocab.pad)):
        if value is not None:
            getattr(w, f"add_{key}_token_id")(value)
    w.add_add_bos_token(vocab.add_bos)
    w.add_add_eos_token(vocab.add_eos)
    if vocab.chat_template:
        w.add_chat_template(vocab.chat_template)


def _writer_class():
    g = gguf_module()

    class Writer(g.GGUFWriter):
        """GGUFWriter that also packs an empty array (the byte tokenizer's merges), which it refuses."""

        def _pack_val(self, val, vtype, add_vtype, sub_type=None):
            if vtype == g.GGUFValueType.ARRAY and sub_type is not None and len(val) == 0:
                return (self._pack("I", vtype) if add_vtype else b"") + self._pack("I", sub_type) + self._pack("Q", 0)
            return super()._pack_val(val, vtype, add_vtype, sub_type)

    return Writer


def write_gguf(reader: Reader, path: Path, arch: str, dtype: str, vocab: Vocabulary, card: Mapping[str, Any],
               log: Callable[[str], None]) -> int:
    """Write the GGUF file at `path` (a temporary name), one tensor in memory at a time; returns its bytes."""
    cfg = reader.config
    tensors = plan_tensors(cfg, arch, dtype)
    w = _writer_class()(path, arch)
    try:
        _write_metadata(w, cfg, arch, dtype, vocab, card)
        for t in tensors:
            shape, nbytes, np_dtype = _byte_shape(t)
            w.add_tensor_info(t.name, shape, np.dtype(np_dtype), nbytes, raw_dtype=t.qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for t in tensors:
            w.write_tensor_data(_encoded(t, reader, arch))
        fallbacks = [t.canonical for t in tensors if dtype == "q8_0" and t.qtype == gguf_module().GGMLQuantizationType.F16]
        if fallbacks:
            log(f"gguf: {len(fallbacks)} matrices kept in f16 (rows not a multiple of 32 values), e.g. {fallbacks[0]}")
    except OSError as e:
        if e.errno is None:  # numpy's tofile (the gguf package writes tensors with it) reports a short write of a
            # file without an errno ("8192 requested and 5912 written"): the disk (or the quota) is full. As ENOSPC
            # on the file, runtime.atomic names the output and says so.
            raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)}: the disk is full ({e})", str(path)) from None
        raise
    finally:
        w.close()
    reader.check_unchanged()
    return path.stat().st_size


class GGUFExporter(Exporter):
    name = "gguf"
    summary = (f"one GGUF file for llama.cpp: dense models as {', '.join(r.name for r in ARCHS.values() if r.hf_dense)}, "
               f"mixtures as {', '.join(r.name for r in ARCHS.values() if r.gate_norm)} (bam-surgery export-gguf has "
               "its options)")
    writes_directory = False
    Options = GGUFOptions

    def check(self, cfg: ModelConfig, *, recipe: str | None = None, architecture: str | None = None) -> None:
        check_gguf(cfg, recipe)

    def write(self, reader: Reader, out: Path, options: ExportOptions) -> Path:
        cfg = reader.config
        check_gguf(cfg, options.recipe)
        if not out.name.endswith(SUFFIX) or out.name == SUFFIX:
            raise CapabilityError(f"--format gguf writes one file named *{SUFFIX}; {printable(str(out))} is not")
        dtype = resolve_dtype(reader, self.own(options))
        arch = gguf_architecture(cfg)
        vocab = find_vocabulary(reader, options)  # before any tensor is read: a refused tokenizer writes nothing
        check_layout(reader)
        row = ARCHS[arch]  # its files carry q/k/v biases, or a shared expert, always: zeros add nothing
        reader = as_held(reader, row.qkv_bias_always, row.zero_shared_expert)
        card = card_entries(reader, out, options, arch, vocab)
        log = options.log or (lambda line: None)
        for note in vocab.notes:
            log(f"gguf: {note}")
        with atomic_path(out, replace=options.replace) as tmp:
            size = write_gguf(reader, tmp, arch, dtype, vocab, card, log)
        log(f"gguf: {arch} architecture, {dtype}, {vocab.pre if vocab.source != BYTES else 'byte'} tokenizer "
            f"({len(vocab.tokens)} tokens), {size:,} bytes")
        return out


__all__ = ["CapabilityError", "GGUFExporter", "GGUFOptions", "GGUF_DTYPES", "check_gguf", "gguf_architecture", "gguf_problems"]
