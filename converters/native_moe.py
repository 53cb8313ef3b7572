"""The native mixture formats (`mixtral`, `qwen2_moe`, `qwen3_moe`, `flex_olmo`, `qwen3_5_moe`): a mixture as a native HF MoE
architecture, loaded with no remote code, one exporter per record of converters/hf/families.py NATIVE_MIXTURES (its
weight table, its config map's capability check; the folder as hf/writer.py:export_native_mixture writes it).

A format whose architecture always has a tensor the model lacks holds it as zeros (`WithZeros`, a reader view), so
the architecture computes exactly the same function: q/k/v biases (`qwen2_moe`: `with_zero_qkv_bias`), a shared
expert (`qwen2_moe` and `qwen3_5_moe` always compute one: `with_zero_shared_expert`, ZERO_SHARED_HIDDEN wide).
transformers' Qwen2MoeSparseMoeBlock adds sigmoid(x . w) * shared_expert(x) unconditionally and llama.cpp's qwen2moe
reads a width of 0 as the FFN's width, so a mixture without a shared expert (a BTX of Qwen2 models, which Mixtral
cannot carry for their q/k/v biases) gets one whose weights are all zero: its down projection being zero, its output
is exactly 0 for every token whatever its gate (1/2 for a zero gate weight; llama.cpp's gate, computed as silu(y) / y,
is kept off 0 / 0 by the GGUF export's SHEXP_GATE_EPS), and adding 0 leaves the routed experts' output bit for bit.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch

from bam_surgery.runtime.config import ModelConfig
from bam_surgery.runtime.reader import Reader

from .base import CastOptions, ExportOptions, Exporter
from .hf.family import Family
from .hf.writer import export_native_mixture

# The width of the all-zero shared expert a mixture without one is written with: any width computes 0; 32 keeps its
# down projection's rows one q8_0 block wide in GGUF and splits over vLLM's tensor-parallel ranks (up to 32).
ZERO_SHARED_HIDDEN = 32

_QKV_WEIGHT = re.compile(r"^(layers\.\d+\.attn\.[qkv])\.weight$")


class WithZeros(Reader):
    """A reader seen with more tensors, all zeros: `config` is the view's config, `added` the new tensors' names
    with their shapes and dtypes, each placed right after the inner tensor it follows (`after`, in names()). A
    native format that always has a tensor the model lacks holds it as zeros, computing exactly the same function.
    Everything else passes through."""

    def __init__(self, inner: Reader, config: ModelConfig, added: dict[str, tuple[tuple[int, ...], torch.dtype, str]]):
        self.inner, self.config, self._added = inner, config, added
        self.metadata = getattr(inner, "metadata", {})
        self.path, self.source_dir, self.hf_config = inner.path, inner.source_dir, inner.hf_config

    def names(self) -> list[str]:
        follows: dict[str, list[str]] = {}
        for name, (_, _, after) in self._added.items():
            follows.setdefault(after, []).append(name)
        return [m for n in self.inner.names() for m in (n, *follows.get(n, ()))]

    def names_added(self) -> list[str]:
        """The tensors this view adds as zeros."""
        return list(self._added)

    def __contains__(self, name: str) -> bool:
        return name in self.inner or name in self._added

    def shape(self, name: str) -> tuple[int, ...]:
        return self.inner.shape(name) if name in self.inner else self._added[name][0]

    def dtype(self, name: str) -> torch.dtype:
        return self.inner.dtype(name) if name in self.inner else self._added[name][1]

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


def with_zero_qkv_bias(inner: Reader) -> WithZeros:
    """A reader seen with q/k/v biases: the config says qkv_bias, and each missing bias is zeros in its weight's
    dtype ([out] of the weight's [out, in])."""
    added = {f"{m.group(1)}.bias": ((inner.shape(n)[0],), inner.dtype(n), n) for n in inner.names()
             if (m := _QKV_WEIGHT.match(n)) and f"{m.group(1)}.bias" not in inner}
    return WithZeros(inner, inner.config.replace(qkv_bias=True), added)


def with_zero_shared_expert(inner: Reader) -> WithZeros:
    """A mixture seen with a shared expert of ZERO_SHARED_HIDDEN hidden units, every weight zero (its output is
    exactly 0)."""
    cfg, dtype, width = inner.config, inner.dtype("embed.weight"), ZERO_SHARED_HIDDEN
    added = {}
    for i in range(cfg.n_layers):
        after = f"layers.{i}.ffn_experts.down.weight"
        for name, shape in (("gate", (width, cfg.d_model)), ("up", (width, cfg.d_model)),
                            ("down", (cfg.d_model, width))):
            added[f"layers.{i}.ffn_shared.{name}.weight"] = (shape, dtype, after)
        added[f"layers.{i}.ffn_shared_gate.weight"] = ((1, cfg.d_model), dtype, after)
    return WithZeros(inner, cfg.replace(ffn_shared_hidden=width), added)


def as_held(reader: Reader, qkv_bias_always: bool, zero_shared_expert: bool) -> Reader:
    """The reader as an architecture holds it: with zero q/k/v biases where it always has them, a zero shared expert
    where it always has one."""
    if qkv_bias_always and not reader.config.qkv_bias:
        reader = with_zero_qkv_bias(reader)
    if zero_shared_expert and not reader.config.ffn_shared_hidden:
        reader = with_zero_shared_expert(reader)
    return reader


def zeros_note(reader: Reader) -> str:
    """For model cards: what as_held's views added as zeros ('' for none)."""
    added: list[str] = []
    while isinstance(reader, WithZeros):
        added += reader.names_added()
        reader = reader.inner
    parts = []
    if any(n.endswith(".bias") for n in added):
        parts.append("q/k/v biases written as zeros")
    if any(".ffn_shared" in n for n in added):
        parts.append(f"a shared expert of {ZERO_SHARED_HIDDEN} hidden units written as zeros (it adds exactly 0: "
                     "the mixture has none)")
    return "; ".join(parts)


class NativeMixtureExporter(Exporter):
    """A mixture as the native HF MoE architecture of a family record."""

    Options = CastOptions

    def __init__(self, family: Family):
        self.family, self.name, self.summary = family, family.format_name, family.summary

    def check(self, cfg: ModelConfig, *, recipe: str | None = None, architecture: str | None = None) -> None:
        self.family.config.check(cfg, recipe)

    def source(self, reader: Reader) -> Reader:
        """The reader as the architecture holds it (as_held)."""
        config = self.family.config
        return as_held(reader, config.qkv_bias_always, config.zero_shared_expert)

    def write(self, reader: Reader, out: Path, options: ExportOptions) -> Path:
        self.check(reader.config, recipe=options.recipe)
        return export_native_mixture(self.source(reader), out, self.family, options)
