"""The native mixture formats (`mixtral`, `qwen2_moe`, `qwen3_moe`, `flex_olmo`): a mixture as a native HF MoE
architecture, loaded with no remote code, one exporter per record of converters/hf/families.py NATIVE_MIXTURES (its
weight table, its config map's capability check; the folder as hf/writer.py:export_native_mixture writes it).

An architecture that always has q/k/v biases or always computes a shared expert (Qwen2-MoE: transformers'
Qwen2MoeSparseMoeBlock adds sigmoid(x . w) * shared_expert(x) unconditionally, llama.cpp's qwen2moe reads a width of 0
as the FFN's width, only vLLM skips a width of 0) writes what a model lacks as zeros (`architecture_view`, through
`WithZeros`, a reader view): zero q/k/v biases, and for a mixture without a shared expert (a BTX of Qwen2 models, which
Mixtral cannot carry for their biases) a shared expert of ZERO_SHARED_HIDDEN hidden units whose weights are all zero.
Its down projection being zero, the shared expert's output is exactly 0 for every token whatever its gate (1/2 for a
zero gate weight; llama.cpp's gate, computed as silu(y) / y, is kept off 0 / 0 by the GGUF export's SHEXP_GATE_EPS),
and adding 0 leaves the routed experts' output bit for bit: the architecture computes the mixture's own function.
"""
from __future__ import annotations

from pathlib import Path

import torch

from bam_surgery.runtime.config import ModelConfig
from bam_surgery.runtime.dtypes import main_dtype
from bam_surgery.runtime.layout import tensor_shapes
from bam_surgery.runtime.reader import Reader

from .base import CastOptions, ExportOptions, Exporter
from .hf.family import Family
from .hf.writer import export_native_mixture

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


def architecture_config(cfg: ModelConfig, qkv_bias: bool, shared_expert: bool) -> ModelConfig:
    """The config an architecture that always has q/k/v biases (`qkv_bias`) or a shared expert (`shared_expert`)
    writes for a mixture: those, ZERO_SHARED_HIDDEN wide where the mixture has no shared expert."""
    return cfg.replace(qkv_bias=cfg.qkv_bias or qkv_bias,
                       ffn_shared_hidden=cfg.ffn_shared_hidden or (ZERO_SHARED_HIDDEN if shared_expert else 0))


def architecture_view(reader: Reader, qkv_bias: bool, shared_expert: bool) -> Reader:
    """`reader` as such an architecture holds it: zero q/k/v biases and an all-zero shared expert where it has none
    (the module docstring says why it computes the mixture's own function)."""
    wanted = architecture_config(reader.config, qkv_bias, shared_expert)
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


class NativeMixtureExporter(Exporter):
    """A mixture as the native HF MoE architecture of a family record."""

    Options = CastOptions

    def __init__(self, family: Family):
        self.family, self.name, self.summary = family, family.model_type, family.summary

    def check(self, cfg: ModelConfig, *, recipe: str | None = None, architecture: str | None = None) -> None:
        self.family.config.check(cfg, recipe)

    def source(self, reader: Reader) -> Reader:
        """The reader as the architecture holds it: zeros where it always has q/k/v biases or a shared expert."""
        return architecture_view(reader, self.family.config.qkv_bias_always, self.family.config.shared_expert)

    def write(self, reader: Reader, out: Path, options: ExportOptions) -> Path:
        self.check(reader.config, recipe=options.recipe)
        return export_native_mixture(self.source(reader), out, self.family, options)
