"""ModelConfig: JSON round trip, field validation (errors name the field), presets, derived sizes."""
from __future__ import annotations

import json

import pytest

from conftest import TINY, tiny_config
from bam_surgery.runtime.config import PRESETS, ConfigError, ModelConfig, preset


@pytest.mark.parametrize("overrides", [
    dict(),
    dict(n_kv_heads=1, activation="gelu_tanh", norm="layernorm", norm_bias=True, position="learned"),
    dict(block="parallel_two_norms", rotary_fraction=0.5, rope_interleaved=True, logit_scale=0.0625),
    dict(ffn_experts=4, ffn_top_k=2, attn_experts=3, attn_top_k=1, kv_mode="shared", gate_norm="topk_softmax",
         lb_coef=0.02, z_coef=0.0, name="mix"),
])
def test_json_round_trip(overrides):
    cfg = tiny_config(**overrides)
    again = ModelConfig.from_json(cfg.to_json())
    assert again == cfg
    assert again.to_json() == cfg.to_json()
    assert json.loads(cfg.to_json()) == cfg.to_dict()


def test_from_dict_rejects_unknown_field():
    d = tiny_config().to_dict()
    d["n_expert"] = 4  # typo of ffn_experts
    with pytest.raises(ConfigError, match="n_expert"):
        ModelConfig.from_dict(d)


@pytest.mark.parametrize("field", ["vocab_size", "d_model", "n_layers", "n_heads", "ffn_hidden"])
def test_from_json_rejects_missing_field(field):
    d = tiny_config().to_dict()
    del d[field]
    with pytest.raises(ConfigError, match=f"{field}: required"):
        ModelConfig.from_json(json.dumps(d))


@pytest.mark.parametrize("field, value", [
    ("d_model", "32"), ("n_heads", 4.0), ("vocab_size", True), ("lb_coef", "0.1"), ("rotary_fraction", None),
    ("norm_bias", "yes"), ("tie_embeddings", 1), ("norm_eps", "1e-5"), ("attn_top_k", "2"), ("name", 3),
    ("activation", None),
])
def test_from_json_rejects_wrongly_typed_values(field, value):
    d = tiny_config().to_dict()
    d[field] = value
    with pytest.raises(ConfigError, match=f"{field}: expected"):
        ModelConfig.from_json(json.dumps(d))


def test_ints_are_accepted_where_floats_belong():
    d = tiny_config().to_dict()
    d.update(rope_theta=500000, norm_eps=1, logit_scale=2, lb_coef=0, rotary_fraction=1)
    assert ModelConfig.from_json(json.dumps(d)).rope_theta == 500000


def test_optional_fields_take_defaults_when_absent():
    cfg = ModelConfig.from_dict(dict(TINY))
    assert cfg.n_kv_heads == cfg.n_heads == 4 and cfg.head_dim == 8 and cfg.ffn_experts == 0


@pytest.mark.parametrize("overrides, field", [
    (dict(d_model=30, n_heads=4), "d_model"),
    (dict(n_heads=4, n_kv_heads=3), "n_kv_heads"),
    (dict(ffn_experts=4, ffn_top_k=5), "ffn_top_k"),
    (dict(ffn_experts=4, ffn_top_k=0), "ffn_top_k"),
    (dict(attn_experts=3, attn_top_k=4), "attn_top_k"),
    (dict(attn_top_k=1), "attn_top_k"),  # top-k attention routing without attention experts
    (dict(ffn_experts=1), "ffn_experts"),
    (dict(attn_experts=1), "attn_experts"),
    (dict(ffn_experts=-2), "ffn_experts"),
    (dict(activation="geglu"), "activation"),
    (dict(norm="batchnorm"), "norm"),
    (dict(norm="rmsnorm", norm_bias=True), "norm_bias"),
    (dict(block="moe"), "block"),
    (dict(position="alibi"), "position"),
    (dict(gate_norm="sigmoid"), "gate_norm"),
    (dict(kv_mode="grouped"), "kv_mode"),
    (dict(router="cosine"), "router"),
    (dict(ffn_experts=4, attn_router="mlp"), "attn_router"),
    (dict(router_hidden=0), "router_hidden"),
    (dict(router_temperature=0.0), "router_temperature"),
    (dict(rotary_fraction=0.0), "rotary_fraction"),
    (dict(rotary_fraction=0.125), "rotary_fraction"),  # head_dim 8 * 0.125 = 1 rotary dim: odd
    (dict(vocab_size=0), "vocab_size"),
    (dict(n_layers=True), "n_layers"),  # bools are not sizes
    (dict(ffn_hidden=2.5), "ffn_hidden"),
    (dict(max_positions=-1), "max_positions"),
    (dict(norm_eps=0.0), "norm_eps"),
    (dict(lb_coef=-0.1), "lb_coef"),
    (dict(z_coef=-1.0), "z_coef"),
    (dict(logit_scale=0.0), "logit_scale"),
])
def test_inconsistent_config_is_rejected_naming_the_field(overrides, field):
    with pytest.raises(ConfigError, match=field):
        tiny_config(**overrides)


def test_top_k_is_only_checked_for_mixtures():
    # a dense config keeps the default ffn_top_k=1 without complaint, and head_dim may be explicit
    cfg = tiny_config(d_model=30, n_heads=4, head_dim=8)
    assert cfg.q_dim == 32 and cfg.kv_dim == 32


def test_from_dict_validates_too():
    d = tiny_config().to_dict()
    d["activation"] = "mish"
    with pytest.raises(ConfigError, match="activation"):
        ModelConfig.from_dict(d)


def test_derived_sizes():
    cfg = tiny_config(n_kv_heads=2, rotary_fraction=0.5, block="parallel")
    assert (cfg.head_dim, cfg.q_dim, cfg.kv_dim, cfg.rotary_dim) == (8, 32, 16, 4)
    assert not cfg.has_ffn_norm and cfg.gated_ffn and not cfg.is_mixture
    assert tiny_config(block="parallel_two_norms").has_ffn_norm
    mix = cfg.replace(ffn_experts=4, ffn_top_k=2, attn_experts=4, attn_top_k=1, kv_mode="shared")
    assert mix.is_mixture
    assert mix.dense() == cfg


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_build_and_round_trip(name):
    cfg = preset(name)
    assert cfg.name == name
    assert ModelConfig.from_json(cfg.to_json()) == cfg
    assert "source" in PRESETS[name]


def test_paper_presets_match_table_4():
    small, large = preset("paper-small"), preset("paper-large")
    # Table 4's "FFN dimension" is the fused gate+up width 2F.
    assert (small.d_model, small.n_layers, small.n_heads, 2 * small.ffn_hidden) == (1024, 6, 8, 4096)
    assert (large.d_model, large.n_layers, large.n_heads, large.n_kv_heads, large.head_dim) == (2304, 18, 18, 6, 128)
    assert small.block == large.block == "parallel"


def test_preset_overrides_and_unknown_preset():
    cfg = preset("tiny", ffn_experts=4, attn_experts=4)
    assert cfg.is_mixture and cfg.d_model == PRESETS["tiny"]["d_model"]
    with pytest.raises(ConfigError, match="preset"):
        preset("paper-medium")
    with pytest.raises(ConfigError, match="ffn_top_k"):
        preset("tiny", ffn_experts=2, ffn_top_k=3)


def test_hf_bam_fields_are_model_config_fields():
    """Issue 21, item 5: the HF remote code's field table (converters/hf_bam/schema_bam.py, shipped standalone
    into every export, so it cannot import ModelConfig) lists ModelConfig's fields in their order with their
    defaults. The one intended difference: the five sizes ModelConfig requires get the tiny preset's values there
    (a BamConfig() needs some; an export always writes every field)."""
    import dataclasses

    from bam_surgery.converters.hf_bam.schema_bam import FIELDS

    fields = dataclasses.fields(ModelConfig)
    assert list(FIELDS) == [f.name for f in fields]
    tiny = preset("tiny")
    for f in fields:
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        want = getattr(tiny, f.name) if required else f.default
        assert FIELDS[f.name] == want and type(FIELDS[f.name]) is type(want), (f.name, FIELDS[f.name], want)
