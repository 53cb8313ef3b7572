"""A model from a checkpoint, and back: load_model (a canonical checkpoint), model_from_reader (any reader),
save_model. `bam_surgery.load` (app/load.py) is the door for every other kind of checkpoint (GGUF, an HF folder or
hub id, a run folder) and brings the tokenizer too."""
from __future__ import annotations

import os

import torch

from .checkpoint import CheckpointReader, save_checkpoint
from .dtypes import FLOAT_DTYPES
from .model import Model
from .reader import Reader, check_layout


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
