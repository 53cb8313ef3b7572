"""PyTorch runtime for dense and BAM mixture models. Imports nothing from the other layers.

    from bam_surgery.runtime import load_model, generate, ForcedRouting
    model = load_model("mix.safetensors")           # config from the file's metadata
    out = model(tokens)                              # out.logits [B, T, V]
    out = model(tokens, routing=ForcedRouting(expert=2))
    new = generate(model, tokens, max_new_tokens=20)  # greedy continuation with the KV cache

The package itself imports nothing (PEP 562): its names below load their module when first asked for, so the
leaf modules (errors, jsonfile, text, sizes, cache, locks, shards' index reading, config) import without torch;
the console entry (cli/launch.py) reads a merge's shard index through runtime.shards before torch is imported.
"""
from __future__ import annotations

import importlib

# name -> the module (of this package) that defines it
_NAMES = {
    "CheckpointError": "errors", "CheckpointReader": "checkpoint", "load_checkpoint": "checkpoint",
    "save_checkpoint": "checkpoint", "PRESETS": "config", "ConfigError": "config", "ModelConfig": "config",
    "preset": "config", "ModelKVCache": "blocks", "generate": "generation", "ForcedRouting": "model",
    "Model": "model", "ModelOutput": "model", "FLOAT_DTYPES": "dtypes", "Reader": "reader",
    "StateReader": "reader", "check_layout": "reader", "load_model": "loading", "model_from_reader": "loading",
    "save_model": "loading",
}

__all__ = ["CheckpointError", "CheckpointReader", "ConfigError", "ForcedRouting", "Model", "ModelConfig", "ModelKVCache",
           "ModelOutput", "PRESETS", "Reader", "StateReader", "check_layout", "generate", "load_checkpoint", "load_model", "model_from_reader",
           "preset", "save_checkpoint", "save_model"]


def __getattr__(name: str):
    module = _NAMES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # found once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_NAMES))
