"""The table of what runs where (converters/targets.py) and its vocabulary (converters/carry.py): every target's column
names real config fields; a field a column does not name is carried at its default only; the refusals of the native
formats, llama.cpp and vLLM are their columns' rows; HF BAM's schema is generated from the model config."""
from __future__ import annotations

import dataclasses

import pytest

from conftest import tiny_config
from bam_surgery.converters.base import CapabilityError
from bam_surgery.converters.carry import MODEL_DEFAULTS, Column, anything, supported_values, values
from bam_surgery.converters.export import check_export
from bam_surgery.converters.hf.families import FAMILIES, NATIVE_MIXTURES
from bam_surgery.converters.hf_bam import export as hf_bam_export
from bam_surgery.converters.targets import columns, table
from bam_surgery.runtime.config import ModelConfig

FIELDS = [f.name for f in dataclasses.fields(ModelConfig)]


def _all_columns() -> list[Column]:
    out = []
    for col in columns().values():
        out += list(col.values()) if isinstance(col, dict) else [col]
    return out


def test_every_column_names_real_fields_and_the_table_covers_every_field():
    for col in _all_columns():
        assert col.read() <= set(FIELDS), (col.target, col.read() - set(FIELDS))
    rows = table()
    assert list(rows) == FIELDS
    targets = ["runtime", "hf", *[f.format_name for f in NATIVE_MIXTURES], "gguf", "onnx", "vllm"]
    assert all(list(cells) == targets for cells in rows.values())


def test_the_runtime_hf_bam_and_onnx_carry_every_value_the_config_takes():
    allowed = supported_values()
    assert allowed["attn_router"] == (None, "linear", "mlp", "attention", "expert_embedding")  # never key_store
    for target in ("runtime", "hf", "onnx"):
        col = columns()[target]
        assert col.read() == set(FIELDS)
        for field, values_ in allowed.items():
            assert col.cell(field) == ", ".join(map(str, values_)), (target, field)


def test_a_field_a_column_does_not_name_is_carried_at_its_default_only():
    col = Column("t", (values("activation", ("swiglu",), "SwiGLU", "activation {}"),
                       *anything(*(f for f in FIELDS if f not in ("activation", "nope_layers")))))
    assert col.problems(tiny_config(block="sequential")) == []
    cfg = tiny_config(block="sequential", n_layers=4, nope_layers=[3], activation="gelu")
    assert col.problems(cfg) == [("SwiGLU", "activation gelu"), ("nope_layers None", "nope_layers [3]")]
    assert col.cell("nope_layers") == "None only" and MODEL_DEFAULTS["nope_layers"] is None


def test_native_format_refusals_are_their_columns_rows():
    cfg = tiny_config(block="sequential", norm="rmsnorm", ffn_experts=2, activation="gelu", rope_interleaved=True)
    for f in NATIVE_MIXTURES:
        problems = f.config.column.problems(cfg)
        with pytest.raises(CapabilityError) as e:
            check_export(f.format_name, cfg, recipe="r")
        assert str(e.value).startswith(f"{f.format_name} export needs " + " and ".join(n for n, _ in problems))
        assert "SwiGLU FFNs" in str(e.value) and "interleaved RoPE" in str(e.value)


def test_every_native_mixture_and_gguf_row_comes_from_a_record():
    from bam_surgery.converters.gguf_table import ARCHS

    assert [f.format_name for f in NATIVE_MIXTURES] == ["mixtral", "qwen2_moe", "qwen3_moe", "flex_olmo", "qwen3_5_moe"]
    owners = {f.gguf.name for f in FAMILIES if f.gguf}
    assert set(ARCHS) == owners
    for row in ARCHS.values():
        assert row.hf_dense or row.hf_mixture


def test_the_hf_bam_schema_is_generated_from_the_model_config():
    """schema_bam.py's FIELDS and SUPPORTED are what schema_text makes from ModelConfig, byte for byte (the way the
    export ships blocks.py): regenerate with converters/hf_bam/export.py:write_schema."""
    text = hf_bam_export.SCHEMA_FILE.read_text(encoding="utf-8")
    assert text == hf_bam_export.schema_text(text), "schema_bam.py is out of date: run write_schema()"
