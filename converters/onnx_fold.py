"""Constant folding of a traced ONNX graph, one weight at a time, and writing its initializers without holding
them all: how `export-onnx` keeps its memory near one copy of the model.

    fold_constants(graph, {name: tensor.numpy() for name, tensor in state.items()}, store)   # graph: no weights
    write_external(graph, store, folder / "model.onnx")        # the weights in model.onnx.data beside it
    move_inline(folder / "model.onnx", store)                 # under 2 GB: into model.onnx itself

Why: torch.onnx.export(export_params=True) folds every weight into a transposed or per-expert copy, builds the
whole model as one protobuf in C++, serializes it to a string, hands Python a bytes copy and parses it once more
(five copies of the weights at its peak: a 1.8 GB model took 9.2 GB). Traced with export_params=False and
do_constant_folding=False instead, the graph holds no weights: each weight is a graph input named after its
parameter, feeding the nodes that transpose, split or reshape it. fold_constants evaluates those nodes (every
node whose inputs are all constant: weights, Constant nodes, outputs of folded nodes) in graph order with onnx's
reference evaluator, keeps each value only until its last folding consumer has run, and hands every value that
a remaining node reads to the store, which appends its bytes to a file at once. The graph that comes out runs
the same computation on the same values as the exporter's own folding (the weights' transposes and slices are
exact); its folded initializers are named after the node outputs they replace.

ONNXWeightStore appends initializers to one data file (external data, offsets aligned as onnx aligns them);
write_external points model.onnx at that file, and move_inline then streams the weights into model.onnx
itself, in chunks (a model under protobuf's 2 GB, checked and verified in its external form first): protobuf parsers merge repeated occurrences of a message field, so the model
without initializers followed by one `graph { initializer: t }` record per tensor parses as the model with all
of them (the protobuf encoding's documented rule for a singular message field seen more than once).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Iterator, Mapping

import numpy as np
import onnx  # this module is imported only by the export itself (onnx_graph imports it lazily)
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

# Offsets of tensors of at least ALIGN_THRESHOLD bytes are multiples of ALIGN (onnx's own external-data
# defaults: aligned tensors can be memory-mapped on every platform).
ALIGN = 64 * 1024
ALIGN_THRESHOLD = 1024 * 1024
INLINE_BYTES = 1024  # smaller initializers stay in model.onnx (ONNXWeightStore)
# Nodes never folded: control flow (subgraphs) and ops whose output is not a function of their inputs.
NOT_FOLDED = {"If", "Loop", "Scan", "RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike",
              "Multinomial", "Bernoulli", "SequenceConstruct"}
# protobuf field numbers (onnx.proto): ModelProto.graph, GraphProto.initializer, TensorProto.raw_data
GRAPH_FIELD, INITIALIZER_FIELD, RAW_DATA_FIELD = 7, 5, 9
COPY_CHUNK = 16 * 1024 * 1024


class ONNXWeightStore:
    """Initializers written as they come to one file, those under INLINE_BYTES kept in memory: they stay in
    model.onnx even with external data (onnxruntime's shape inference reads small constant inputs such as
    Reshape shapes and Slice bounds from the graph file itself; onnx's save_model keeps them there too)."""

    def __init__(self, path: Path, location: str):
        self.path, self.location = Path(path), location
        # name, data_type, dims, then (offset, length) in the file or the bytes themselves
        self.entries: list[tuple[str, int, list[int], tuple[int, int] | bytes]] = []
        self.nbytes = 0  # of the file
        self.weight_bytes = 0  # of every initializer
        self._file = open(self.path, "wb")

    def add(self, name: str, value: np.ndarray) -> None:
        value = np.ascontiguousarray(value)
        data_type = helper.np_dtype_to_tensor_dtype(value.dtype)
        self.weight_bytes += value.nbytes
        if value.nbytes < INLINE_BYTES:
            self.entries.append((name, data_type, list(value.shape), value.tobytes()))
            return
        if value.nbytes >= ALIGN_THRESHOLD and self.nbytes % ALIGN:
            pad = ALIGN - self.nbytes % ALIGN
            self._file.write(b"\0" * pad)
            self.nbytes += pad
        self._file.write(memoryview(value.reshape(-1)).cast("B"))
        self.entries.append((name, data_type, list(value.shape), (self.nbytes, value.nbytes)))
        self.nbytes += value.nbytes

    def discard(self) -> None:
        """Close and delete the file (a failed export)."""
        self.close()
        self.path.unlink(missing_ok=True)

    def close(self) -> None:
        if not self._file.closed:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()

    def external_tensors(self) -> Iterator:
        """TensorProtos in the order added: pointing into the file (data_location EXTERNAL), small ones inline."""
        for name, data_type, dims, data in self.entries:
            if isinstance(data, bytes):
                yield TensorProto(name=name, data_type=data_type, dims=dims, raw_data=data)
                continue
            t = TensorProto(name=name, data_type=data_type, dims=dims, data_location=TensorProto.EXTERNAL)
            for key, value in (("location", self.location), ("offset", str(data[0])), ("length", str(data[1]))):
                entry = t.external_data.add()
                entry.key, entry.value = key, value
            yield t

    def write_inline(self, out) -> None:
        """Append every initializer to out (an open model.onnx holding the model without initializers) as one
        `graph { initializer: t }` record each, in the order added, copying the bytes from the file in chunks:
        the tensor's fields but raw_data are encoded by protobuf, raw_data (field 9) appended by hand (protobuf
        fields may come in any order)."""
        with open(self.path, "rb") as f:
            for name, data_type, dims, data in self.entries:
                head = TensorProto(name=name, data_type=data_type, dims=dims).SerializeToString()
                length = len(data) if isinstance(data, bytes) else data[1]
                raw = _key(RAW_DATA_FIELD) + _varint(length)
                tensor_len = len(head) + len(raw) + length
                graph_len = len(_key(INITIALIZER_FIELD)) + len(_varint(tensor_len)) + tensor_len
                out.write(_key(GRAPH_FIELD) + _varint(graph_len) + _key(INITIALIZER_FIELD) + _varint(tensor_len))
                out.write(head + raw)
                if isinstance(data, bytes):
                    out.write(data)
                    continue
                f.seek(data[0])
                left = length
                while left:
                    chunk = f.read(min(left, COPY_CHUNK))
                    out.write(chunk)
                    left -= len(chunk)


def fold_constants(model, weights: Mapping[str, np.ndarray], store: ONNXWeightStore) -> None:
    """Fold `model` (an onnx ModelProto traced with export_params=False: its weights are graph inputs named as in
    `weights`) in place: every node whose inputs are all constant is evaluated and removed, the weights leave the
    graph inputs, and every constant a remaining node reads is added to `store` (write_external sets the
    initializers from it)."""
    graph = model.graph
    plan = _FoldPlan(graph, {i.name for i in graph.input if i.name in weights})
    opsets = {o.domain or "": o.version for o in model.opset_import}
    values: dict[str, np.ndarray] = {}
    written: set[str] = set()

    def value(name: str) -> np.ndarray:
        if name not in values:
            if name in plan.weights:
                values[name] = np.asarray(weights[name])
            else:
                (values[name],) = ReferenceEvaluator(plan.constant_nodes[name], opsets=opsets).run(None, {})
        return values[name]

    def emit(name: str, v: np.ndarray) -> None:
        if name in plan.needed and name not in written:
            store.add(name, v)
            written.add(name)

    remaining = dict(plan.readers)  # constant -> folded nodes still to read it
    for node in plan.folded:
        outs = ReferenceEvaluator(node, opsets=opsets).run(None, {i: value(i) for i in node.input if i})
        for i in node.input:
            if i:
                remaining[i] -= 1
                if remaining[i] == 0:  # its last folding reader has run: written if a remaining node reads it
                    emit(i, values.pop(i))
        for o, v in zip(node.output, outs):
            emit(o, np.asarray(v))
            if remaining.get(o):
                values[o] = np.asarray(v)
    for name in sorted(plan.needed - written, key=_input_order(graph)):  # weights only remaining nodes read
        emit(name, value(name))
        values.pop(name)
    plan.rewrite(graph)


class _FoldPlan:
    """Which nodes of a graph fold (all inputs constant: weights, Constant nodes' outputs, folded outputs; no
    subgraph, no randomness), how many folded nodes read each constant, and which constants the nodes left
    read (the initializers; a Constant node a remaining node reads stays a Constant node)."""

    def __init__(self, graph, weights: set[str]):
        self.weights = weights
        self.constant_nodes = {o: n for n in graph.node if n.op_type == "Constant" for o in n.output}
        constant = weights | set(self.constant_nodes) | {""}
        self.folded = []
        for node in graph.node:
            if (node.op_type != "Constant" and node.op_type not in NOT_FOLDED and node.domain in ("", "ai.onnx")
                    and not any(a.g.node or a.graphs for a in node.attribute) and all(i in constant for i in node.input)):
                self.folded.append(node)
                constant.update(node.output)
        self.constant = constant
        folded_ids = {id(n) for n in self.folded}
        self.readers: dict[str, int] = {}
        for node in self.folded:
            for i in node.input:
                self.readers[i] = self.readers.get(i, 0) + 1
        self.kept = [n for n in graph.node if id(n) not in folded_ids]
        self.live = {i for n in self.kept for i in n.input} | {o.name for o in graph.output}
        self.needed = {c for c in constant if c and c in self.live and c not in self.constant_nodes}

    def rewrite(self, graph) -> None:
        """The graph without the folded nodes, the unread Constant nodes, the weight inputs and the value_info
        of constants."""
        kept = [n for n in self.kept if n.op_type != "Constant" or any(o in self.live for o in n.output)]
        inputs = [i for i in graph.input if i.name not in self.weights]
        info = [v for v in graph.value_info if v.name not in self.constant]
        for field, items in ((graph.node, kept), (graph.input, inputs), (graph.value_info, info)):
            del field[:]
            field.extend(items)


def _input_order(graph) -> Callable[[str], int]:
    order = {i.name: k for k, i in enumerate(graph.input)}
    return lambda name: order.get(name, len(order))


def write_external(model, store: ONNXWeightStore, path: Path) -> None:
    """model.onnx at path with the store's initializers pointing into the store's file (which stays where it is,
    named store.location beside path)."""
    store.close()
    del model.graph.initializer[:]
    model.graph.initializer.extend(store.external_tensors())
    _write(path, model.SerializeToString())


def move_inline(path: Path, store: ONNXWeightStore) -> None:
    """Rewrite the model.onnx write_external wrote at path with its initializers inside it, streamed from the
    store's file one chunk at a time, and delete that file."""
    model = onnx.load(os.fspath(path), load_external_data=False)
    del model.graph.initializer[:]
    partial = path.with_name(path.name + ".inline")
    with open(partial, "wb") as f:
        f.write(model.SerializeToString())
        store.write_inline(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)
    store.path.unlink()


def _write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _key(field: int) -> bytes:
    return _varint(field << 3 | 2)  # wire type 2: length-delimited


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)
