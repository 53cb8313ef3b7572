"""The `qwen2_moe` format: FFN-expert mixtures of Llama/Mistral/Qwen2-family models (no QK-norm) as HF Qwen2-MoE,
loaded natively (`Qwen2MoeForCausalLM`, no remote code) by transformers, vLLM and, as GGUF `qwen2moe`, llama.cpp:
BTX and upcycled mixtures with or without q/k/v biases (every Qwen2 and Qwen2.5 model has them, which Mixtral
cannot carry), in either gate normalization, and mixtures with a shared expert (recipe btx-shared-expert).

On disk (what `Qwen2MoeForCausalLM.save_pretrained` writes):

    model.layers.{i}.mlp.gate.weight                          [E, D]   router
    model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight        routed expert e
    model.layers.{i}.mlp.shared_expert.{gate,up,down}_proj.weight      the shared expert
    model.layers.{i}.mlp.shared_expert_gate.weight            [1, D]   its gate: sigmoid(x . w)
    model.layers.{i}.self_attn.{q,k,v}_proj.bias                       always (zeros for a model without)

The weight table is in hf/architectures.py, the config.json map and the capability check in
hf/qwen2_moe_config.py. Qwen2-MoE always has q/k/v biases and always computes its shared expert: every client
builds it from `shared_expert_intermediate_size` (transformers' Qwen2MoeSparseMoeBlock adds
sigmoid(x . w) * shared_expert(x) unconditionally, llama.cpp's qwen2moe reads a width of 0 as the FFN's width, and
only vLLM skips a width of 0). So what a model lacks is written as zeros (`qwen2_moe_view`): zero q/k/v biases, and
for a mixture without a shared expert a shared expert of ZERO_SHARED_HIDDEN hidden units whose weights are all zero.
Its down projection being zero, the shared expert's output is exactly 0 for every token whatever its gate (1/2 for
a zero gate weight; llama.cpp's gate, computed as silu(y) / y, is kept off 0 / 0 by the GGUF export's
SHEXP_GATE_EPS), and adding 0 leaves the routed experts' output bit for bit: the mixture's own function.
"""
from __future__ import annotations

from pathlib import Path

import torch

from bam_surgery.runtime.config import ModelConfig
from bam_surgery.runtime.dtypes import main_dtype
from bam_surgery.runtime.layout import tensor_shapes
from bam_surgery.runtime.reader import Reader

from .hf.qwen2_moe_config import MODEL_TYPE
from .mixtral import NativeMixtureExporter

# The width of the all-zero shared expert a mixture without one is written with: any width computes 0; 32 keeps its
# down projection's rows one q8_0 block wide in GGUF and splits over vLLM's tensor-parallel ranks (up to 32).
ZERO_SHARED_HIDDEN = 32


class WithZeros(Reader):
    """`inner` seen as the model `config`, whose tensors `inner` lacks are zeros (a bias in its weight's dtype, any
    other tensor in the model's main dtype). The rest passes through."""

    def __init__(self, inner: Reader, config: ModelConfig):
        self.inner, self.config = inner, config
        self.metadata = getattr(inner, "metadata", {})
        self.path, self.source_dir, self.hf_config = inner.path, inner.source_dir, inner.hf_config
        shapes = tensor_shapes(config)
        self._added = {n: s for n, s in shapes.items() if n not in inner}
        self._names = [n for n in shapes if n in inner or n in self._added]
        self._names += [n for n in inner.names() if n not in shapes]
        self._main = main_dtype((n, inner.shape(n), inner.dtype(n)) for n in inner.names())

    @property
    def added(self) -> list[str]:
        """The tensors written as zeros."""
        return list(self._added)

    def names(self) -> list[str]:
        return list(self._names)

    def __contains__(self, name: str) -> bool:
        return name in self.inner or name in self._added

    def shape(self, name: str) -> tuple[int, ...]:
        return self.inner.shape(name) if name in self.inner else tuple(self._added[name])

    def dtype(self, name: str) -> torch.dtype:
        if name in self.inner:
            return self.inner.dtype(name)
        weight = name.removesuffix(".bias") + ".weight"
        return self.inner.dtype(weight) if name.endswith(".bias") and weight in self.inner else self._main

    def get(self, name: str) -> torch.Tensor:
        if name in self.inner:
            return self.inner.get(name)
        return torch.zeros(self.shape(name), dtype=self.dtype(name))

    def file_of(self, name: str) -> Path | None:
        return self.inner.file_of(name) if name in self.inner else None

    def files(self) -> list[Path]:
        return self.inner.files()

    def tokenizer_files(self) -> list[Path]:
        return self.inner.tokenizer_files()

    def check_unchanged(self) -> None:
        self.inner.check_unchanged()


def qwen2_moe_config(cfg: ModelConfig) -> ModelConfig:
    """The config Qwen2-MoE writes for a mixture: q/k/v biases, and a shared expert (ZERO_SHARED_HIDDEN wide when the
    mixture has none)."""
    return cfg.replace(qkv_bias=True, ffn_shared_hidden=cfg.ffn_shared_hidden or ZERO_SHARED_HIDDEN)


def qwen2_moe_view(reader: Reader) -> Reader:
    """`reader` as Qwen2-MoE holds it: zero q/k/v biases where it has none, an all-zero shared expert where it has
    none (the module docstring says why both compute the mixture's own function)."""
    wanted = qwen2_moe_config(reader.config)
    return reader if wanted == reader.config else WithZeros(reader, wanted)


def zeros_note(reader: Reader) -> str:
    """For model cards: what a view added as zeros ('' for none)."""
    if not isinstance(reader, WithZeros):
        return ""
    parts = []
    if any(n.endswith(".bias") for n in reader.added):
        parts.append("q/k/v biases written as zeros")
    if any(".ffn_shared" in n for n in reader.added):
        parts.append(f"a shared expert of {ZERO_SHARED_HIDDEN} hidden units written as zeros (it adds exactly 0: "
                     "the mixture has none)")
    return "; ".join(parts)


class Qwen2MoeExporter(NativeMixtureExporter):
    name, model_type = "qwen2_moe", MODEL_TYPE
    summary = "HF Qwen2-MoE directory, btx/upcycle/btx-shared-expert of Llama/Qwen2-family inputs (q/k/v biases too)"

    def source(self, reader: Reader) -> Reader:
        return qwen2_moe_view(reader)
