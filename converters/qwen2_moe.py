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
`WithZeroQKVBias`, a reader view that adds zero biases, so Qwen2-MoE computes exactly the same function.
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


class Qwen2MoeExporter(NativeMixtureExporter):
    name, model_type = "qwen2_moe", MODEL_TYPE
    summary = "HF Qwen2-MoE directory, btx-shared-expert of Llama-family inputs"

    def source(self, reader: Reader) -> Reader:
        """Qwen2-MoE always has q/k/v biases: a model without them is seen through WithZeroQKVBias."""
        return reader if reader.config.qkv_bias else WithZeroQKVBias(reader)
