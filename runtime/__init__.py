"""Reference PyTorch runtime for dense and BAM mixture models. Imports nothing from the other layers.

    from runtime import load_model, ForcedRouting
    model = load_model("mix.safetensors")           # config from the file's metadata
    out = model(tokens)                              # out.logits [B, T, V]
    out = model(tokens, routing=ForcedRouting(expert=2))
"""
from __future__ import annotations

import os

import torch

from .checkpoint import CheckpointReader, load_checkpoint, save_checkpoint
from .config import PRESETS, ConfigError, ModelConfig, preset
from .model import ForcedRouting, Model, ModelOutput


def load_model(path: str | os.PathLike, device: str | torch.device = "cpu",
               dtype: torch.dtype | None = None) -> Model:
    """Rebuild a model from a canonical checkpoint (file or directory) alone."""
    cfg, state = load_checkpoint(path)
    with torch.device("meta"):
        model = Model(cfg)
    model.load_state_dict(state, assign=True)
    # non-persistent buffers (rotary frequencies) were created on meta: rebuild them
    for blk in model.layers:
        if blk.rotary is not None:
            blk.rotary.inv_freq = blk.rotary.__class__(cfg).inv_freq
    model = model.to(device)
    if dtype is not None:
        model = model.to(dtype)
    return model.eval()


def save_model(model: Model, path: str | os.PathLike, metadata: dict[str, str] | None = None,
               max_shard_bytes: int | None = None):
    return save_checkpoint(model.state_dict(), model.config, path, metadata, max_shard_bytes)


__all__ = ["CheckpointReader", "ConfigError", "ForcedRouting", "Model", "ModelConfig", "ModelOutput",
           "PRESETS", "load_checkpoint", "load_model", "preset", "save_checkpoint", "save_model"]
