"""The ONNX graph of a runtime model: what it takes, what it returns, and how it is traced.

    graph = DecoderGraph(model, kv_cache=True)        # a wrapper module; the model math stays in runtime/blocks.py
    export_graph(model, path, opset=18, kv_cache=True)   # model.onnx (+ model.onnx.data past 2 GB); onnx_fold

Graph I/O (B batch, T new tokens, P past tokens, Hkv = the heads the runtime cache holds per layer: E*G for
expert KV, G for shared KV and dense attention; Dh head_dim; V vocab):

    input_ids                      int64 [B, T]
    attention_mask                 int64 [B, P+T]  1 token, 0 padding (left padding: position ids skip it)
    position_ids                   int64 [B, T]    (optional without a cache: default from attention_mask)
    past_key_values.{i}.key/value  [B, Hkv, P, Dh] keys after RoPE, as runtime.ModelKVCache holds them
  ->
    logits                         float [B, T, V]
    present.{i}.key/value          [B, Hkv, P+T, Dh]  the past with the new tokens appended

With kv_cache=False: input_ids, attention_mask (, position_ids) -> logits. Axes batch, sequence and
past_sequence are dynamic.

The wrapper calls the runtime's own Transformer.hidden_states and head with impl="export" (runtime/blocks.py):
routers, norms, RoPE and attention are the runtime's modules, traced as they are; only the cache is
replaced by one that concatenates the graph's past inputs with the new keys and values (and hands them out
as present outputs) instead of writing a preallocated buffer.
"""
from __future__ import annotations

import contextlib
import io
import warnings
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor, nn

from bam_surgery.runtime.blocks import ModelKVCache
from bam_surgery.runtime.model import Model

# Opsets the TorchScript exporter writes for these graphs: scaled_dot_product_attention needs 14; 17 has
# LayerNormalization as one op; 20 is the exporter's last.
MIN_OPSET = 14
DEFAULT_OPSET = 17
MAX_OPSET = 20


# Weights past this go to external data (one file beside the graph): a protobuf message cannot exceed 2 GiB;
# leave room for the graph.
EXTERNAL_DATA_BYTES = 2 * 1024**3 - 64 * 1024**2

# the cache's input and output names (ONNX Runtime GenAI's defaults too: converters/onnx_genai.py)
PAST_NAME = "past_key_values.{layer}.{kind}"
PRESENT_NAME = "present.{layer}.{kind}"


def kv_names(n_layers: int) -> tuple[list[str], list[str]]:
    """(past input names, present output names), layer by layer, key before value."""
    past = [PAST_NAME.format(layer=i, kind=kind) for i in range(n_layers) for kind in ("key", "value")]
    present = [PRESENT_NAME.format(layer=i, kind=kind) for i in range(n_layers) for kind in ("key", "value")]
    return past, present


def input_names(n_layers: int, kv_cache: bool) -> list[str]:
    return ["input_ids", "attention_mask", "position_ids"] + (kv_names(n_layers)[0] if kv_cache else [])


def output_names(n_layers: int, kv_cache: bool) -> list[str]:
    return ["logits"] + (kv_names(n_layers)[1] if kv_cache else [])


class ConcatCache:
    """The runtime cache protocol (.update(layer, input_pos, k, v) -> every key slot's k, v) over the graph's past
    inputs: past [B, Hkv, P, Dh] with the new k, v [B, Hkv, T, Dh] appended; keeps the results as presents."""

    def __init__(self, past: list[Tensor]):
        self.past = past  # key, value of layer 0, then layer 1, ...
        self.present: list[Tensor] = []

    def update(self, layer: int, input_pos: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        k = torch.cat([self.past[2 * layer], k.to(self.past[2 * layer].dtype)], dim=2)
        v = torch.cat([self.past[2 * layer + 1], v.to(self.past[2 * layer + 1].dtype)], dim=2)
        self.present += [k, v]
        return k, v


class PassThroughCache:
    """A cache over nothing: attention sees only the new tokens (the no-cache graph). Handing the runtime a cache
    lets it take input_pos as given, so the traced graph holds no check of the sequence length."""

    @staticmethod
    def update(layer: int, input_pos: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        return k, v


class DecoderGraph(nn.Module):
    """forward(input_ids, attention_mask, position_ids, *past) -> (logits, *present) for a runtime Model; see the
    module docstring for shapes. ffn_kernel "dense" runs every FFN expert on every token (only to measure the
    sparse dispatch against)."""

    def __init__(self, model: Model, kv_cache: bool = True, ffn_kernel: Optional[str] = None):
        super().__init__()
        self.model, self.kv_cache, self.ffn_kernel = model, kv_cache, ffn_kernel

    def forward(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, *past: Tensor):
        model = self.model
        T = input_ids.shape[1]
        n_keys = attention_mask.shape[1]
        input_pos = torch.arange(T, device=input_ids.device) + (n_keys - T)  # the new tokens' key slots: P..P+T-1
        cache = ConcatCache(list(past)) if self.kv_cache else PassThroughCache()
        impl, kernel = model.impl, model.expert_kernel
        model.impl, model.expert_kernel = "export", self.ffn_kernel
        try:
            x, _ = model.hidden_states(model.embed_tokens(input_ids), attention_mask=attention_mask, positions=position_ids,
                                       input_pos=input_pos, cache=cache)
        finally:
            model.impl, model.expert_kernel = impl, kernel
        logits = model.head(x)
        return (logits, *cache.present) if self.kv_cache else logits


def positions_from_mask(attention_mask: Tensor, n_new: int) -> Tensor:
    """Position ids [B, T] of the last n_new slots: real tokens counted from the mask (as the runtime does)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -n_new:]


def past_shape(model: Model, batch: int, past_len: int) -> tuple[int, int, int, int]:
    cfg = model.config
    return batch, ModelKVCache.kv_heads(cfg), past_len, cfg.head_dim


def example_inputs(model: Model, kv_cache: bool, dtype: torch.dtype, batch: int = 2, new: int = 3,
                   past_len: int = 2) -> tuple[Tensor, ...]:
    """Inputs to trace with: sizes of at least 2 on every dynamic axis (the exporter specializes 0 and 1)."""
    cfg = model.config
    past_len = past_len if kv_cache else 0
    ids = torch.arange(batch * new).reshape(batch, new) % cfg.vocab_size
    mask = torch.ones(batch, past_len + new, dtype=torch.long)
    mask[0, 0] = 0  # a padded row, so nothing specializes to an all-ones mask
    pos = positions_from_mask(mask, new)
    past = [torch.zeros(past_shape(model, batch, past_len), dtype=dtype) for _ in range(2 * cfg.n_layers)]
    return (ids, mask, pos, *past) if kv_cache else (ids, mask, pos)


def dynamic_axes(n_layers: int, kv_cache: bool) -> dict[str, dict[int, str]]:
    """Named dynamic axes of every input and output (see the module docstring)."""
    axes = {"input_ids": {0: "batch", 1: "sequence"}, "attention_mask": {0: "batch", 1: "total_sequence"},
            "position_ids": {0: "batch", 1: "sequence"}, "logits": {0: "batch", 1: "sequence"}}
    past, present = kv_names(n_layers)
    if kv_cache:
        axes.update({name: {0: "batch", 2: "past_sequence"} for name in past})
        axes.update({name: {0: "batch", 2: "total_sequence"} for name in present})
    return axes


def export_graph(model: Model, path: Path, *, opset: int = DEFAULT_OPSET, kv_cache: bool = True,
                 ffn_kernel: Optional[str] = None, metadata: Optional[dict[str, str]] = None,
                 external_data_bytes: int = EXTERNAL_DATA_BYTES) -> bool:
    """Trace `model` (eval mode, in the dtype it should run in, fp32 or fp16) into an ONNX file at path, with
    dynamic batch, sequence and past-sequence axes and `metadata` as its metadata_props. Returns whether the
    weights went to external data: one file, path's name + ".data" beside it, when they pass
    external_data_bytes (protobuf cannot hold 2 GB in one file). fold_graph, write_graph and onnx_fold.move_inline
    are its steps, for a caller that frees the model and checks the graph in between (onnx_export)."""
    from .onnx_fold import move_inline  # lazy: onnx_fold imports onnx (0.06 s at start-up)

    graph, store = fold_graph(model, path, opset=opset, kv_cache=kv_cache, ffn_kernel=ffn_kernel, metadata=metadata)
    write_graph(graph, store, path)
    if store.weight_bytes > external_data_bytes:
        return True
    move_inline(path, store)
    return False


def fold_graph(model: Model, path: Path, *, opset: int = DEFAULT_OPSET, kv_cache: bool = True,
               ffn_kernel: Optional[str] = None, metadata: Optional[dict[str, str]] = None):
    """(graph, store): the traced graph of `model` with its weights folded into initializers written to
    path's name + ".data" (converters/onnx_fold.ONNXWeightStore); write_graph then writes model.onnx.

    The TorchScript exporter (torch.onnx.export(dynamo=False)): a tiny model exports in about a second, where
    the dynamo exporter takes 25-35 s, and its named dynamic axes can say that the mask's length is the
    past's plus the new tokens' (torch.export's Dims cannot). Tracing records Python values as constants, so
    the traced code has no Python branch on anything that varies: sizes are read from tensors, FFN experts
    are dispatched with nonzero/index_add (impl "export"), and the tests run the graph at other batch,
    sequence and past sizes than it was traced at.

    Memory: the graph is traced without its weights (each weight is an input, nothing folded: see trace), then
    converters/onnx_fold folds the nodes that transpose and slice the weights, one weight at a time, writing
    each initializer as it comes, so this holds the model once plus about one weight (the exporter's own
    folding and serialization held five copies of the weights)."""
    import onnx  # lazy: onnx costs 0.06 s at start-up (the CLI loads this module for --help)

    from .onnx_fold import ONNXWeightStore, fold_constants  # lazy: as onnx

    if model.embed.weight.dtype not in (torch.float32, torch.float16):
        raise ValueError(f"the ONNX export traces fp32 or fp16 models, not {model.embed.weight.dtype}")
    wrapper = DecoderGraph(model, kv_cache, ffn_kernel).eval()
    graph = trace(wrapper, opset=opset, kv_cache=kv_cache)
    if metadata:
        onnx.helper.set_model_props(graph, metadata)
    store = ONNXWeightStore(path.parent / (path.name + ".data"), path.name + ".data")
    try:
        with torch.no_grad():
            fold_constants(graph, {name: p.detach().numpy() for name, p in wrapper.named_parameters()}, store)
    except BaseException:
        store.discard()
        raise
    return graph, store


def write_graph(graph, store, path: Path) -> None:
    """Write fold_graph's graph at path, its weights in the store's file beside it (onnx_fold.write_external)."""
    from .onnx_fold import write_external  # lazy: onnx_fold imports onnx (0.06 s at start-up)

    write_external(graph, store, path)


def trace(wrapper: DecoderGraph, *, opset: int, kv_cache: bool):
    """The traced graph (an onnx ModelProto) of a DecoderGraph, without weights: each parameter is a graph input
    named as in wrapper.named_parameters(), feeding the nodes that use it, unfolded.

    The parameters go in as inputs of the traced function (_WeightsAsInputs), not as the module's parameters:
    torch.onnx.export runs ONNX shape inference over every parameter it is given and copies each into a
    protobuf on the way (twice the weights at its peak, even with export_params=False); an input is only a
    shape to it."""
    import onnx  # lazy: see fold_graph

    model = wrapper.model
    dtype = model.embed.weight.dtype
    n_layers = model.config.n_layers
    as_inputs = _WeightsAsInputs(wrapper)
    args = (*example_inputs(model, kv_cache, dtype), *(p.detach() for _, p in wrapper.named_parameters()))
    buffer = io.BytesIO()
    with torch.no_grad(), _quiet():
        torch.onnx.export(as_inputs, args, buffer, dynamo=False, opset_version=opset, do_constant_folding=False,
                          input_names=input_names(n_layers, kv_cache) + as_inputs.names,
                          output_names=output_names(n_layers, kv_cache), dynamic_axes=dynamic_axes(n_layers, kv_cache))
    graph = onnx.load_model_from_string(buffer.getvalue())
    if model.config.position == "none":
        _declare_position_ids(graph)
    return graph


class _WeightsAsInputs(nn.Module):
    """forward(*graph inputs, *parameters): a DecoderGraph run with the given tensors in place of its parameters.
    The DecoderGraph is held but not registered, so this module has no parameters; while forward runs, each
    parameter of the model is swapped for its input tensor (a plain attribute) and put back afterwards
    (torch.func.functional_call refuses to run under the tracer)."""

    def __init__(self, graph: DecoderGraph):
        super().__init__()
        self.__dict__["graph"] = graph
        self.names = [name for name, _ in graph.named_parameters()]

    def forward(self, *args: Tensor):
        n = len(args) - len(self.names)
        slots = [self.graph.get_submodule(name.rpartition(".")[0]) for name in self.names]
        originals = [getattr(module, name.rpartition(".")[2]) for module, name in zip(slots, self.names)]
        try:
            for module, name, tensor in zip(slots, self.names, args[n:]):
                attr = name.rpartition(".")[2]
                delattr(module, attr)  # unregisters the parameter; the plain tensor goes in its place
                setattr(module, attr, tensor)
            return self.graph(*args[:n])
        finally:
            for module, name, parameter in zip(slots, self.names, originals):
                attr = name.rpartition(".")[2]
                if attr in module.__dict__:
                    delattr(module, attr)
                module.register_parameter(attr, parameter)


def _declare_position_ids(graph) -> None:
    """A model without positions never reads position_ids, and the tracer drops unread inputs; declare it again
    (ONNX allows an unused input) so every export takes the same inputs."""
    import onnx  # lazy: see export_graph

    names = [i.name for i in graph.graph.input]
    if "position_ids" not in names:
        declared = onnx.helper.make_tensor_value_info("position_ids", onnx.TensorProto.INT64, ["batch", "sequence"])
        graph.graph.input.insert(names.index("attention_mask") + 1, declared)


@contextlib.contextmanager
def _quiet():
    """torch.onnx warns about tracing (values that are constant by design here) and its own deprecation; a CLI
    speaks for itself."""
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        yield
