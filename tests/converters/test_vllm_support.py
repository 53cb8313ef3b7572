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


LONGROPE = dict(rope_type="longrope", original_max_position_embeddings=32, short_factor=[1.0] * 4,
                long_factor=[4.0] * 4)
@pytest.mark.parametrize("overrides, needle", [
    # Gemma 4's proportional RoPE (the plugin computes the five other types)
    (dict(scaled_rope=dict(rope_type="proportional", partial_rotary_factor=0.25)),
     "scaled_rope of type proportional (it runs linear, dynamic, yarn, longrope, llama3)"),
    # the families of 2026: Qwen3.5's Gated DeltaNet layers (as DeltaNet experts too) and gated attention, Gemma 4's
    # per-layer geometry, shared K/V layers and per-layer inputs
    (dict(linear_layers=[0], linear_key_heads=1, linear_value_heads=2, linear_key_dim=4, linear_value_dim=4,
          linear_conv=4, linear_experts=2, attn_experts=2), "linear_layers=[0]"),
    (dict(attn_output_gate=True), "attn_output_gate=True"),
    (dict(global_head_dim=16, global_kv_heads=2, attn_window=4, attn_window_layers=[0], window_rope_theta=1e4),
     "global_head_dim=16"),
    (dict(n_layers=4, kv_shared_layers=2, per_layer_dim=4, v_norm=True, layer_scale=True), "kv_shared_layers=2"),
])
def test_the_2026_families_own_layers_are_refused_until_implemented(overrides, needle):
    with pytest.raises(CapabilityError, match=re.escape(needle)):
        support.check_vllm(tiny_config(**overrides))


@pytest.mark.parametrize("overrides, needle", [
    ({"ffn_experts": 2, "activation": "relu"}, "FFN experts with activation relu"),
    ({"ffn_experts": 2, "activation": "relu", "router": "key_store"}, "FFN experts with activation relu"),
    ({"scaled_rope": LONGROPE, "rope_interleaved": True}, "longrope with rope_interleaved"),
])
def test_refusals_are_one_line(overrides, needle):
    with pytest.raises(CapabilityError) as err:
        support.check_vllm(tiny_config(**overrides))
    assert needle in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("scaled_rope, served, refused", [
    # longrope: the short factors up to the original length (vLLM would take the long ones past it)
    (LONGROPE, 32, "scaled_rope longrope at max_model_len 33, past original_max_position_embeddings=32 (vLLM then "
                   "rotates every position with the long factors"),
    # dynamic NTK: plain RoPE up to max_positions
    (dict(rope_type="dynamic", factor=2.0), 64, "scaled_rope dynamic at max_model_len 65, past max_positions=64"),
    # YaRN: vLLM's table covers original x factor positions (factor derived from max_positions when left out)
    (dict(rope_type="yarn", original_max_position_embeddings=8, factor=4.0), 32,
     "scaled_rope yarn at max_model_len 33, past original_max_position_embeddings x factor=32"),
    (dict(rope_type="yarn", original_max_position_embeddings=8), 64, "past original_max_position_embeddings x "
                                                                     "factor=64"),
])
def test_scaled_rope_is_served_up_to_the_length_vllm_computes_it_as_the_runtime(scaled_rope, served, refused):
    cfg = tiny_config(scaled_rope=scaled_rope, head_dim=8, max_positions=64)
    support.check_vllm(cfg, served)
    support.check_vllm(cfg)  # the length unknown (before the engine has one)
    with pytest.raises(CapabilityError) as err:
        support.check_vllm(cfg, served + 1)
    assert refused in str(err.value) and f"serve with --max-model-len {served} or less" in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("overrides", [{}, {"attn_experts": 2, "ffn_experts": 3, "ffn_top_k": 2},
                                       {"attn_experts": 3, "attn_top_k": 2, "kv_mode": "shared", "router": "mlp",
                                        "position": "learned", "block": "parallel", "activation": "relu"},
                                       {"ffn_experts": 3, "activation": "gelu_tanh", "ffn_bias": True},
                                       {"ffn_experts": 2, "ffn_shared_hidden": 8, "router": "key_store",
                                        "attn_experts": 2, "attn_router": "expert_embedding"},
                                       # every trunk feature of the newer families, with experts
                                       {"attn_experts": 2, "ffn_experts": 2, "activation": "geglu_tanh",
                                        "qk_norm": "head", "norm_position": "sandwich", "norm_unit_offset": True,
                                        "scale_embeddings": True, "attn_window": 4, "attn_window_layers": [0],
                                        "window_rope_theta": 100.0, "attn_scale_dim": 12, "attn_softcap": 50.0,
                                        "final_softcap": 30.0, "scaled_rope": dict(rope_type="linear", factor=8.0)},
                                       {"attn_experts": 2, "kv_mode": "shared", "qk_norm": "full",
                                        "norm_position": "post", "nope_layers": [1],
                                        "scaled_rope": dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                            high_freq_factor=4.0,
                                                            original_max_position_embeddings=16)},
                                       # Granite's multipliers and attention scale, Ministral 3's query temperature
                                       {"attn_experts": 2, "ffn_experts": 2, "embedding_multiplier": 12.0,
                                        "residual_multiplier": 0.22, "attn_scale": 0.0625, "attn_temperature": 0.1,
                                        "attn_temperature_length": 16}])
def test_served_configs_pass(overrides):
    support.check_vllm(tiny_config(**overrides), 64)


# the fields of the 2026 families' own layers (Qwen3.5's Gated DeltaNet and gated attention, Gemma 4's per-layer
# geometry, shared K/V layers and per-layer inputs), which the plugin refuses
OWN_LAYERS = ("linear_layers", "attn_output_gate", "global_head_dim", "global_kv_heads", "global_k_eq_v", "v_norm",
              "kv_shared_layers", "per_layer_dim", "layer_scale", "linear_experts", "scaled_rope of type proportional")


def test_every_familys_mixtures_are_served():
    """The vLLM column of docs/families.md: the mixture of every family the tool reads by every shipped recipe is
    served (a dense model is vLLM's own architecture), but where a family has the 2026 layers the plugin lacks, and
    then for those fields alone."""
    from conftest import doc_generator

    gen = doc_generator("gen_families")
    prefix = "bam-surgery's vLLM model does not implement "
    refused = {key: verdicts[gen.VLLM] for key, verdicts in gen.cells().items()
               if verdicts[gen.VLLM] not in (None, gen.DENSE)}
    assert {family for family, _ in refused} <= {"qwen3_5_text", "gemma4_text"}, refused
    for key, why in refused.items():
        assert why.startswith(prefix), key
        assert all(part.startswith(OWN_LAYERS) for part in why[len(prefix):].split("; ")), (key, why)


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
