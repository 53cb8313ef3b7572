"""PyTorch runtime for dense and BAM mixture models. Imports nothing from the other layers.

    from bam_surgery.runtime import load_model, generate, ForcedRouting
    model = load_model("mix.safetensors")           # config from the file's metadata
    out = model(tokens)                              # out.logits [B, T, V]
    out = model(tokens, routing=ForcedRouting(expert=2))
    new = generate(model, tokens, max_new_tokens=20)  # greedy continuation with the KV cache
"""
from __future__ import annotations

import os

import torch

from .checkpoint import CheckpointError, CheckpointReader, load_checkpoint, save_checkpoint
from .config import PRESETS, ConfigError, ModelConfig, preset
from .blocks import ModelKVCache
from .generation import generate
from .model import ForcedRouting, Model, ModelOutput
from .dtypes import FLOAT_DTYPES
from .reader import Reader, StateReader, check_layout


def load_model(path: str | os.PathLike, device: str | torch.device = "cpu",
               dtype: torch.dtype | None = None) -> Model:
    """Rebuild a model from a canonical checkpoint (file or directory) alone."""
    with CheckpointReader(path) as reader:
        return model_from_reader(reader, device, dtype)


def model_from_reader(reader: Reader, device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> Model:
    """The model of any reader (canonical names), checked against its config's layout first (errors
    name the file and tensor, instead of load_state_dict's message); weights cast to dtype if given.
    In eval mode. Weights stored as integers (int32, ...) are refused by name (they were a load_state_dict
    traceback in generate and export-onnx)."""
    check_layout(reader, dtypes=FLOAT_DTYPES)
    cfg, state = reader.config, {name: reader.get(name) for name in reader.names()}
    with torch.device("meta"):
        model = Model(cfg)
    model.load_state_dict(state, assign=True)
    model = model.to(device)
    if dtype is not None:
        model = model.to(dtype)
    return model.eval()


def save_model(model: Model, path: str | os.PathLike, metadata: dict[str, str] | None = None,
               max_shard_bytes: int | None = None):
    return save_checkpoint(model.state_dict(), model.config, path, metadata, max_shard_bytes)


__all__ = ["CheckpointError", "CheckpointReader", "ConfigError", "ForcedRouting", "Model", "ModelConfig", "ModelKVCache",
           "ModelOutput", "PRESETS", "Reader", "StateReader", "check_layout", "generate", "load_checkpoint", "load_model", "model_from_reader",
           "preset", "save_checkpoint", "save_model"]
