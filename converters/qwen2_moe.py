"""The `qwen2_moe` format: FFN-expert mixtures with a shared expert (recipe btx-shared-expert) of
Llama/Mistral/Qwen2-family models as HF Qwen2-MoE, loaded natively (`Qwen2MoeForCausalLM`, no remote code).

On disk (what `Qwen2MoeForCausalLM.save_pretrained` writes):

    model.layers.{i}.mlp.gate.weight                          [E, D]   router
    model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight        routed expert e
    model.layers.{i}.mlp.shared_expert.{gate,up,down}_proj.weight      the shared expert
    model.layers.{i}.mlp.shared_expert_gate.weight            [1, D]   its gate: sigmoid(x . w)
    model.layers.{i}.self_attn.{q,k,v}_proj.bias                       always (zeros for a model without)

The weight table is in hf/architectures.py, the config.json map and the capability check in
hf/qwen2_moe_config.py. Qwen2-MoE always has q/k/v biases: a model without them is written through
`with_zero_qkv_bias`, a reader view that adds zero biases, so Qwen2-MoE computes exactly the same function.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch

from bam_surgery.runtime.config import ModelConfig
from bam_surgery.runtime.reader import Reader

from .hf.qwen2_moe_config import MODEL_TYPE
from .mixtral import NativeMixtureExporter

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


class Qwen2MoeExporter(NativeMixtureExporter):
    name, model_type = "qwen2_moe", MODEL_TYPE
    summary = "HF Qwen2-MoE directory, btx-shared-expert of Llama-family inputs"

    def source(self, reader: Reader) -> Reader:
        """Qwen2-MoE always has q/k/v biases: a model without them is seen through with_zero_qkv_bias."""
        return reader if reader.config.qkv_bias else with_zero_qkv_bias(reader)
