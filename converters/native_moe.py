"""The native mixture formats (`mixtral`, `qwen2_moe`, `qwen3_moe`, `flex_olmo`): a mixture as a native HF MoE
architecture, loaded with no remote code, one exporter per record of converters/hf/families.py NATIVE_MIXTURES (its
weight table, its config map's capability check; the folder as hf/writer.py:export_native_mixture writes it).

A format whose architecture always has q/k/v biases (a shared-expert mixture's: `qwen2_moe`) writes a model without
them through `WithZeroQKVBias`, a reader view that adds zero biases, so the architecture computes exactly the same
function.
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

_QKV_WEIGHT = re.compile(r"^(layers\.\d+\.attn\.[qkv])\.weight$")


class WithZeroQKVBias(Reader):
    """A reader seen with q/k/v biases: the config says qkv_bias, and each missing bias is zeros in its
    weight's dtype ([out] of the weight's [out, in]). Everything else passes through."""

    def __init__(self, inner: Reader):
        self.inner = inner
        self.config: ModelConfig = inner.config.replace(qkv_bias=True)
        self.metadata = getattr(inner, "metadata", {})
        self.path, self.source_dir, self.hf_config = inner.path, inner.source_dir, inner.hf_config
        self._bias = {f"{m.group(1)}.bias": n for n in inner.names() if (m := _QKV_WEIGHT.match(n))}

    def names(self) -> list[str]:
        out = []
        for n in self.inner.names():
            out.append(n)
            m = _QKV_WEIGHT.match(n)
            if m and f"{m.group(1)}.bias" not in self.inner:
                out.append(f"{m.group(1)}.bias")
        return out

    def __contains__(self, name: str) -> bool:
        return name in self.inner or name in self._bias

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self.inner:
            return self.inner.shape(name)
        return (self.inner.shape(self._bias[name])[0],)

    def dtype(self, name: str) -> torch.dtype:
        return self.inner.dtype(name if name in self.inner else self._bias[name])

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


class NativeMixtureExporter(Exporter):
    """A mixture as the native HF MoE architecture of a family record."""

    Options = CastOptions

    def __init__(self, family: Family):
        self.family, self.name, self.summary = family, family.model_type, family.summary

    def check(self, cfg: ModelConfig, *, recipe: str | None = None, architecture: str | None = None) -> None:
        self.family.config.check(cfg, recipe)

    def source(self, reader: Reader) -> Reader:
        """The reader as the architecture holds it: with zero q/k/v biases where it always has them."""
        return WithZeroQKVBias(reader) if self.family.config.qkv_bias_always and not reader.config.qkv_bias else reader

    def write(self, reader: Reader, out: Path, options: ExportOptions) -> Path:
        self.check(reader.config, recipe=options.recipe)
        return export_native_mixture(self.source(reader), out, self.family, options)
