"""What the vLLM model implements (converters/vllm_bam/support.py), checked without vLLM: one entry per config
field of the HF BAM export, so a field added to the export is refused by vLLM until it is decided there; every
value the export supports is either served or refused in one line; the plugin's entry point is declared and
importing the plugin imports neither vLLM nor its model module (tests/compat/test_vllm.py runs the model)."""
from __future__ import annotations

import re

import ast
import subprocess
import sys

import pytest

from conftest import ROOT, setup_keyword, tiny_config
from bam_surgery.converters.base import CapabilityError
from bam_surgery.converters.hf_bam import schema_bam
from bam_surgery.converters.vllm_bam import MODEL_CLASS, register, support


def test_every_listed_field_is_an_export_field():
    assert set(support.SUPPORTED) <= set(schema_bam.FIELDS)
    for field, values in support.SUPPORTED.items():  # nothing listed that the export cannot hold
        if values is not support.ANY and field in schema_bam.SUPPORTED:
            assert set(values) <= set(schema_bam.SUPPORTED[field]), field


def test_a_field_the_vllm_model_does_not_list_is_served_at_its_default_only(monkeypatch):
    monkeypatch.setitem(schema_bam.FIELDS, "future_field", False)
    cfg = tiny_config()
    cfg.future_field = False
    support.check_vllm(cfg)
    cfg.future_field = True
    with pytest.raises(CapabilityError, match=re.escape("future_field=True (it runs False)")):
        support.check_vllm(cfg)


@pytest.mark.parametrize("overrides, needle", [
    (dict(qk_norm="head"), "qk_norm='head' (it runs none)"),
    (dict(scaled_rope=dict(rope_type="linear", factor=2.0)), "scaled_rope={'rope_type': 'linear'"),
    (dict(attn_window=4), "attn_window=4"),
    (dict(norm_position="sandwich", norm_unit_offset=True), "norm_position='sandwich'"),
    # the families of 2026: Qwen3.5's Gated DeltaNet layers (as DeltaNet experts too) and gated attention, Gemma 4's
    # per-layer geometry, shared K/V layers and per-layer inputs
    (dict(linear_layers=[0], linear_key_heads=1, linear_value_heads=2, linear_key_dim=4, linear_value_dim=4,
          linear_conv=4, linear_experts=2, attn_experts=2), "linear_layers=[0]"),
    (dict(attn_output_gate=True), "attn_output_gate=True"),
    (dict(global_head_dim=16, global_kv_heads=2, attn_window=4, attn_window_layers=[0], window_rope_theta=1e4),
     "global_head_dim=16"),
    (dict(n_layers=4, kv_shared_layers=2, per_layer_dim=4, v_norm=True, layer_scale=True), "kv_shared_layers=2"),
])
def test_the_newer_families_features_are_refused_until_implemented(overrides, needle):
    with pytest.raises(CapabilityError, match=re.escape(needle)):
        support.check_vllm(tiny_config(**overrides))


@pytest.mark.parametrize("overrides, needle", [
    ({"ffn_experts": 2, "activation": "relu"}, "FFN experts with activation relu"),
    ({"ffn_experts": 2, "activation": "relu", "router": "key_store"}, "FFN experts with activation relu"),
])
def test_refusals_are_one_line(overrides, needle):
    with pytest.raises(CapabilityError) as err:
        support.check_vllm(tiny_config(**overrides))
    assert needle in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("overrides", [{}, {"attn_experts": 2, "ffn_experts": 3, "ffn_top_k": 2},
                                       {"attn_experts": 3, "attn_top_k": 2, "kv_mode": "shared", "router": "mlp",
                                        "position": "learned", "block": "parallel", "activation": "relu"},
                                       {"ffn_experts": 3, "activation": "gelu_tanh", "ffn_bias": True},
                                       {"ffn_experts": 2, "ffn_shared_hidden": 8, "router": "key_store",
                                        "attn_experts": 2, "attn_router": "expert_embedding"}])
def test_served_configs_pass(overrides):
    support.check_vllm(tiny_config(**overrides))


def test_entry_point_and_lazy_registration():
    entry = setup_keyword("entry_points")["vllm.general_plugins"]
    assert entry == ["bam_surgery = bam_surgery.converters.vllm_bam:register"]
    assert callable(register) and MODEL_CLASS == "bam_surgery.converters.vllm_bam.model:BamForCausalLM"
    code = ("import sys, bam_surgery.converters.vllm_bam; "
            "print(sorted(m for m in sys.modules if m.startswith('vllm') or m.endswith('vllm_bam.model')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    model = ast.parse((ROOT / "converters" / "vllm_bam" / "model.py").read_text())
    assert any(isinstance(n, ast.ClassDef) and n.name == "BamForCausalLM" for n in model.body)
