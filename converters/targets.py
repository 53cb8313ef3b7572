"""The table of what runs where: for every model-config field, the values each target carries.

Each target declares its own column (converters/carry.py says what a column is) in its own module, and refuses from
it in one line; this module only assembles them, for docs/families.md ("What runs where") and the tests that hold
the table whole:

    runtime      the config's types (runtime/config.py ModelConfig: carry.runtime_column)
    hf           the HF BAM remote code (converters/hf_bam/export.py COLUMN, from schema_bam.py, generated from
                 ModelConfig)
    mixtral ...  each native mixture format (converters/hf/moe_family.py, one per record of hf/families.py
                 NATIVE_MIXTURES: the trunk of the record, the format's gating and biases)
    gguf         each llama.cpp architecture (converters/gguf_export.py arch_column, from gguf_table.ARCHS)
    onnx         the ONNX graph (converters/onnx_export.py COLUMN: the runtime's math, traced)
    vllm         the vLLM plugin (converters/vllm_bam/support.py COLUMN)

A target that implements a new value or field changes its own declaration only.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping

from bam_surgery.runtime.config import ModelConfig

from .carry import Column, runtime_column
from .gguf_export import arch_column
from .gguf_table import ARCHS
from .hf.families import NATIVE_MIXTURES
from .hf_bam.export import COLUMN as HF_BAM
from .onnx_export import COLUMN as ONNX
from .vllm_bam.support import COLUMN as VLLM


def columns() -> dict[str, Column | Mapping[str, Column]]:
    """target -> its column (gguf: llama.cpp architecture -> its column), in the table's order."""
    return {"runtime": runtime_column("runtime"), "hf": HF_BAM,
            **{f.format_name: f.config.column for f in NATIVE_MIXTURES},
            "gguf": {arch: arch_column(arch) for arch in ARCHS}, "onnx": ONNX, "vllm": VLLM}


def table() -> dict[str, dict[str, str]]:
    """field -> target -> what the target carries of it, in words (every ModelConfig field, in its order)."""
    cols = columns()
    out: dict[str, dict[str, str]] = {}
    for f in dataclasses.fields(ModelConfig):
        out[f.name] = {target: (_grouped(col, f.name) if isinstance(col, Mapping) else col.cell(f.name))
                       for target, col in cols.items()}
    return out


def _grouped(cols: Mapping[str, Column], field: str) -> str:
    """One cell over several columns (llama.cpp's architectures): each distinct cell with the columns that have it."""
    cells: dict[str, list[str]] = {}
    for name, col in cols.items():
        cells.setdefault(col.cell(field), []).append(name)
    if len(cells) == 1:
        return next(iter(cells))
    return "; ".join(f"{cell} ({', '.join(names)})" for cell, names in cells.items())
