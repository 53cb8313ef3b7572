"""The `onnx` format: one ONNX graph of the model for onnxruntime (and any ONNX runtime), with its KV cache.

    exporter("onnx").write(reader, Path("out"), ExportOptions(own=OnnxOptions(opset=17, dtype=torch.float16,
                                                                              verify=True), log=print))

OUT (a folder, written atomically through runtime.atomic, with its marker):
    model.onnx        the graph (converters/onnx_graph: inputs, outputs, dynamic axes); the model's config is
                      in its metadata ("bam_config")
    model.onnx.data   the weights, when they pass EXTERNAL_DATA_BYTES (protobuf cannot hold 2 GB in one file)
    README.md         how to run it with onnxruntime (greedy decoding through the KV cache, in numpy) and with
                      ONNX Runtime GenAI
    genai_config.json ONNX Runtime GenAI's description of the graph (converters/onnx_genai); with the KV cache only
                      (GenAI's generator feeds the graph only the new tokens), options.log says so otherwise
    tokenizer files   copied from the input when it has them (options.tokenizer_files)
The format's own options are OnnxOptions (opset, dtype, kv_cache, verify); with verify the export is run in onnxruntime against the runtime (converters/onnx_runtime) before
it is put in place; a mismatch leaves nothing at OUT.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from bam_surgery.runtime import model_from_reader
from bam_surgery.runtime.atomic import atomic_dir
from bam_surgery.runtime.blocks import ModelKVCache
from bam_surgery.runtime.config import ModelConfig
from bam_surgery.runtime.errors import CheckpointError, OptionError
from bam_surgery.runtime.options import declared
from bam_surgery.runtime.reader import Reader, check_layout
from bam_surgery.runtime.shards import copy_side_file

from .base import CapabilityError, ExportOptions, Exporter
from .carry import Column, rule, runtime_column
from .hf.files import GENERATION_CONFIG, generation_config_text
from .onnx_genai import GENAI_CONFIG, genai_config
from .onnx_graph import DEFAULT_OPSET, MAX_OPSET, MIN_OPSET, fold_graph, write_graph
from .onnx_graph import EXTERNAL_DATA_BYTES as GRAPH_EXTERNAL_DATA_BYTES
from .onnx_runtime import compare_export, reference_outputs

GRAPH_FILE = "model.onnx"
DATA_FILE = "model.onnx.data"
# Weights past this go to DATA_FILE: a protobuf message (model.onnx) cannot exceed 2 GiB; leave room for the graph.
EXTERNAL_DATA_BYTES = GRAPH_EXTERNAL_DATA_BYTES
DTYPES = {"fp32": torch.float32, "fp16": torch.float16}


class VerificationError(CheckpointError):
    """--verify found the export and the runtime disagreeing (the message gives the numbers)."""


def check_opset(opset: int) -> None:
    if not MIN_OPSET <= opset <= MAX_OPSET:
        raise CapabilityError(f"--opset {opset}: the ONNX export needs opset {MIN_OPSET} to {MAX_OPSET} "
                              f"(scaled dot-product attention needs {MIN_OPSET}); default {DEFAULT_OPSET}")


def parse_opset(text: str) -> int:
    """--opset N: an integer the export can write."""
    try:
        opset = int(text)
    except ValueError:
        raise OptionError(f"--opset: {text!r} is not an integer") from None
    check_opset(opset)
    return opset


def parse_dtype(text: str) -> torch.dtype:
    """--dtype fp32|fp16."""
    if text not in DTYPES:
        raise OptionError(f"--dtype: unknown dtype {text!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[text]


@dataclass(frozen=True)
class OnnxOptions:
    """The onnx format's own options (`bam-surgery export-onnx` declares its flags from them)."""

    opset: int = declared(DEFAULT_OPSET, "--opset", metavar="N", parse=parse_opset,
                          help=f"ONNX opset to write ({MIN_OPSET} to {MAX_OPSET}; default {DEFAULT_OPSET}).")
    dtype: torch.dtype = declared(torch.float32, "--dtype", metavar="|".join(DTYPES), show_default="fp32",
                                  parse=parse_dtype, help="Weight and KV-cache dtype of the graph.")
    kv_cache: bool = declared(
        True, "--kv-cache/--no-kv-cache",
        help=f"Past and present key values as graph inputs and outputs (default); --no-kv-cache exports input_ids, "
             f"attention_mask, position_ids -> logits only (no {GENAI_CONFIG}: GenAI needs the cache).")
    verify: bool = declared(
        False, "--verify",
        help="Run the export in onnxruntime before writing it: logits of a left-padded prompt batch against the "
             "runtime (fp32: within 1e-4) and greedy tokens through its KV cache against runtime.generate; a "
             "mismatch writes nothing.")

    @property
    def dtype_name(self) -> str:
        """fp32 or fp16, as --dtype spells it."""
        return next((name for name, dtype in DTYPES.items() if dtype == self.dtype), str(self.dtype))


# ONNX's column of the table of what runs where (converters/carry.py): the graph traces the runtime's own model math,
# but for the layers OnnxExporter.check refuses (Qwen3.5's Gated DeltaNet, Gemma 4's per-layer cache geometry)
_PER_LAYER_GEOMETRY = ("global_head_dim", "global_kv_heads", "kv_shared_layers", "per_layer_dim")


def _per_layer_geometry(cfg) -> bool:
    return cfg.global_head_dim is not None or cfg.global_kv_heads is not None or bool(cfg.kv_shared_layers) \
        or bool(cfg.per_layer_dim)


COLUMN = Column("onnx", (
    *(r for r in runtime_column("onnx").rows if not set(r.fields) & {"linear_layers", *_PER_LAYER_GEOMETRY}),
    rule("linear_layers", lambda cfg: not cfg.linear_layers,
         "attention layers only (a Gated DeltaNet layer's recurrent state is not built)", "Gated DeltaNet layers",
         "None (a recurrent state: not built)"),
    rule(_PER_LAYER_GEOMETRY, lambda cfg: not _per_layer_geometry(cfg),
         "one cache geometry in every layer and no per-layer inputs", "a per-layer cache geometry",
         {"global_head_dim": "None", "global_kv_heads": "None", "kv_shared_layers": "0", "per_layer_dim": "0"})))


class OnnxExporter(Exporter):
    name = "onnx"
    summary = "ONNX graph with KV-cache inputs and outputs for onnxruntime (bam-surgery export-onnx has its options)"
    Options = OnnxOptions

    def check(self, cfg: ModelConfig, *, recipe: str | None = None, architecture: str | None = None) -> None:
        """Every model of one cache geometry traces: dense, FFN experts, attention experts (both KV modes, top-k).
        Refused, in one line: Qwen3.5's Gated DeltaNet layers and Gemma 4's per-layer cache geometry."""
        if cfg.linear_layers:
            raise CapabilityError(
                "onnx export of Gated DeltaNet layers is not built: each carries a convolution state and a "
                "recurrent state [heads, Dk, Dv] across calls, and its gated delta rule loops over the sequence, "
                "which the traced exporter unrolls at the traced length; a graph with conv/recurrent past and "
                "present inputs and an ONNX Loop over the tokens (or one over chunks of 64 with a triangular solve "
                "written out) would carry it, at the cost of one small matmul chain per token (or chunk) and "
                "layer in the prefill, and GenAI has no such state; --format hf (HF BAM) carries it, and a BTX of it its "
                "family's native mixture format (docs/families.md)")
        if _per_layer_geometry(cfg):
            raise CapabilityError(
                "onnx export of per-layer cache geometries is not built: its past/present caches would differ from layer to "
                "layer (the global layers' own head size and kv heads, no cache in the layers that read another's "
                "K/V) where the graph and GenAI's config declare one geometry, and its per-layer inputs are a second "
                "embedding lookup; --format hf (HF BAM) carries it")

    def write(self, reader: Reader, out: Path, options: ExportOptions) -> Path:
        import onnx  # lazy: onnx costs 0.06 s at start-up (the CLI loads this module for --help)

        from .onnx_fold import move_inline  # lazy: as onnx (it imports onnx)

        own = self.own(options)
        opset, dtype = own.opset, own.dtype
        check_opset(opset)
        if dtype not in DTYPES.values():
            raise CapabilityError(f"onnx export writes fp32 or fp16 weights, not {str(dtype)[6:]}")
        cfg = reader.config
        check_layout(reader)
        log = options.log or (lambda line: None)
        with atomic_dir(out, replace=options.replace) as tmp:
            # One copy of the model at a time (issue 31: the exporter's own folding and serialization held five,
            # 9.2 GB for a 1.8 GB model): the weights are folded into tmp/DATA_FILE as they are traced
            # (onnx_graph.fold_graph), --verify's runtime outputs are taken before the model is dropped, the
            # checker and onnxruntime read the graph with its weights still in DATA_FILE, and only then, under
            # EXTERNAL_DATA_BYTES, are they streamed into model.onnx (onnx_fold.move_inline).
            traced = model_from_reader(reader, "cpu", dtype)
            metadata = {"bam_config": json.dumps(cfg.to_dict(), sort_keys=True), "producer": "bam-surgery"}
            graph, store = fold_graph(traced, tmp / GRAPH_FILE, opset=opset, kv_cache=own.kv_cache,
                                      metadata=metadata)
            try:
                reference = None
                if own.verify:
                    if dtype != torch.float32:  # an fp16 graph is checked against the fp32 runtime
                        del traced
                        traced = model_from_reader(reader, "cpu", torch.float32)
                    reference = reference_outputs(traced)
                del traced
                write_graph(graph, store, tmp / GRAPH_FILE)
                del graph
            finally:
                store.close()
            external = store.weight_bytes > EXTERNAL_DATA_BYTES
            onnx.checker.check_model(str(tmp / GRAPH_FILE))  # by path: also checks the external data
            if reference is not None:
                report = compare_export(reference, tmp / GRAPH_FILE, fp16=dtype == torch.float16)
                log(report.summary())
                if not report.ok:
                    raise VerificationError(f"{out}: the ONNX export does not match the runtime ({report.summary()}); "
                                            "nothing was written")
            if not external:
                move_inline(tmp / GRAPH_FILE, store)
            for f in options.tokenizer_files:
                copy_side_file(Path(f), tmp / Path(f).name)
            if options.generation:  # eos for any loop over the graph (GenAI's is genai_config.json's)
                (tmp / GENERATION_CONFIG).write_text(generation_config_text(options.generation), encoding="utf-8")
            write_genai_config(cfg, tmp, options, own.kv_cache, log)
            (tmp / "README.md").write_text(onnx_card(cfg, out.name, options, own, external))
        return out


def write_genai_config(cfg: ModelConfig, folder: Path, options: ExportOptions, kv_cache: bool, log) -> None:
    """genai_config.json for ONNX Runtime GenAI, whose generator needs the graph's KV cache."""
    if not kv_cache:
        log(f"bam-surgery: note: no {GENAI_CONFIG}: ONNX Runtime GenAI's generator feeds the graph only the new "
            "tokens, so it needs the KV cache (export without --no-kv-cache)")
        return
    text = json.dumps(genai_config(cfg, options.generation, GRAPH_FILE), indent=2) + "\n"
    (folder / GENAI_CONFIG).write_text(text, encoding="utf-8")


def onnx_card(cfg: ModelConfig, name: str, options: ExportOptions, own: OnnxOptions, external: bool) -> str:
    """README.md of an export: what the graph takes and returns, and a snippet that runs it (tests run it)."""
    np_dtype = "np.float16" if own.dtype == torch.float16 else "np.float32"
    kind = (("BAM mixture" if cfg.attn_experts else "BTX/MoE mixture") if cfg.is_mixture else "dense model")
    files = f"`{GRAPH_FILE}`" + (f" and its weights `{DATA_FILE}` (keep them side by side)" if external else "")
    io, snippet = _cached_graph(cfg, np_dtype) if own.kv_cache else _uncached_graph(cfg)
    return f"""---
library_name: onnx
tags: [onnx, onnxruntime, bam-surgery]
---
# {name}

An ONNX export of a {kind} ({cfg.n_layers} layers, d_model {cfg.d_model}, vocab {cfg.vocab_size}) written by
**bam-surgery export-onnx**: {files}, {"fp16" if own.dtype == torch.float16 else "fp32"} weights,
opset {own.opset}.

## Graph

{io}

Axes batch, sequence and past are dynamic.{_ffn_note(cfg)}

## Run it with onnxruntime

Needs `numpy` and `onnxruntime` only:

{snippet}
{_genai_section(options) if own.kv_cache else ""}"""


def _cached_graph(cfg: ModelConfig, np_dtype: str) -> tuple[str, str]:
    """(inputs and outputs, a snippet that runs them) of a graph with a KV cache."""
    io = f"""Inputs: `input_ids` int64 [batch, sequence], `attention_mask` int64 [batch, past + sequence]
(1 token, 0 padding; pad on the left), `position_ids` int64 [batch, sequence] (real tokens counted from the mask),
and `past_key_values.{{i}}.key` / `.value` [batch, {ModelKVCache.kv_heads(cfg)}, past, {cfg.head_dim}] for each of the
{cfg.n_layers} layers (empty, past 0, for the prompt). Outputs: `logits` [batch, sequence, {cfg.vocab_size}] and
`present.{{i}}.key` / `.value` (the past with the new tokens appended), the next step's past."""
    snippet = f"""```python
import numpy as np
import onnxruntime as ort

session = ort.InferenceSession("{GRAPH_FILE}", providers=["CPUExecutionProvider"])
ids = np.array([[1, 2, 3]], dtype=np.int64)  # prompt token ids [batch, length], padded on the left
mask = np.ones_like(ids)  # 1 token, 0 padding
past = {{i.name: np.zeros((ids.shape[0], i.shape[1], 0, i.shape[3]), {np_dtype})
        for i in session.get_inputs() if i.name.startswith("past_key_values.")}}
new = []
for _ in range(8):  # greedy: the prompt once, then one token per step through the KV cache
    positions = (mask.cumsum(-1) - 1).clip(min=0)[:, -ids.shape[1]:]
    logits, *present = session.run(None, {{"input_ids": ids, "attention_mask": mask,
                                          "position_ids": positions, **past}})
    ids = logits[:, -1].argmax(-1)[:, None].astype(np.int64)
    new.append(ids)
    mask = np.concatenate([mask, np.ones_like(ids)], axis=1)
    past = dict(zip(past, present))
print(np.concatenate(new, axis=1))
```"""
    return io, snippet


def _genai_section(options: ExportOptions) -> str:
    """The card's ONNX Runtime GenAI part: its generator reads genai_config.json beside the graph."""
    names = {Path(f).name for f in options.tokenizer_files}
    text = ("" if "tokenizer.json" not in names or "tokenizer_config.json" not in names else
            " With the tokenizer files here, `og.Tokenizer(model)` encodes text (`.encode(text)`) and decodes tokens.")
    return f"""
## Run it with ONNX Runtime GenAI

`{GENAI_CONFIG}` describes the graph to ONNX Runtime GenAI's generator (`pip install onnxruntime-genai`); its
`search` section sets the defaults (greedy here), and a sequence ends after the `eos_token_id` of its `model`
section (0, end of text, where the checkpoint names none: GenAI always has one).{text}

```python
import numpy as np
import onnxruntime_genai as og

model = og.Model(".")  # this folder
params = og.GeneratorParams(model)
params.set_search_options(do_sample=False, max_length=3 + 8)  # greedy; prompt and new tokens
generator = og.Generator(model, params)
generator.append_tokens(np.array([[1, 2, 3]], dtype=np.int32))  # prompt token ids [batch, length]
new = []
while not generator.is_done():
    generator.generate_next_token()
    new.append(int(generator.get_next_tokens()[0]))
print(new)
```
"""


def _uncached_graph(cfg: ModelConfig) -> tuple[str, str]:
    """(inputs and outputs, a snippet that runs them) of a graph without a KV cache."""
    io = f"""Inputs: `input_ids` int64 [batch, sequence], `attention_mask` int64 [batch, sequence] (1 token,
0 padding; pad on the left), `position_ids` int64 [batch, sequence] (real tokens counted from the mask).
Output: `logits` [batch, sequence, {cfg.vocab_size}]. Exported without a KV cache: every step recomputes the
whole sequence."""
    snippet = f"""```python
import numpy as np
import onnxruntime as ort

session = ort.InferenceSession("{GRAPH_FILE}", providers=["CPUExecutionProvider"])
ids = np.array([[1, 2, 3]], dtype=np.int64)  # prompt token ids [batch, length], padded on the left
mask = np.ones_like(ids)  # 1 token, 0 padding
prompt_len = ids.shape[1]
for _ in range(8):  # greedy, recomputing the whole sequence each step (no KV cache in this export)
    positions = (mask.cumsum(-1) - 1).clip(min=0)
    (logits,) = session.run(None, {{"input_ids": ids, "attention_mask": mask, "position_ids": positions}})
    token = logits[:, -1].argmax(-1)[:, None].astype(np.int64)
    ids = np.concatenate([ids, token], axis=1)
    mask = np.concatenate([mask, np.ones_like(token)], axis=1)
print(ids[:, prompt_len:])
```"""
    return io, snippet


def _ffn_note(cfg: ModelConfig) -> str:
    if not cfg.ffn_experts:
        return ""
    return (f" FFN experts are dispatched sparsely: each of the {cfg.ffn_experts} experts runs only on the tokens "
            f"routed to it (top-{cfg.ffn_top_k}), so a token costs {cfg.ffn_top_k} FFNs, not {cfg.ffn_experts}.")
