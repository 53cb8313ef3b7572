"""Hugging Face import and export against transformers (the independent reference).

For each architecture: a tiny random transformers model is saved with save_pretrained, opened with
open_checkpoint, loaded into runtime.model.Model and compared with the HF forward in fp32 (max abs
logits diff <= 1e-4; both compute the same fp32 ops in a different order, ~1e-6 apart, while a
wrong reshape or flag moves logits by >1e-2). Exporting back reproduces the HF safetensors file
exactly (same keys, torch.equal), and transformers loads the exported directory to the same logits.
Also: config defaults equal the transformers config-class defaults, every spec covers every dense
ModelConfig field, reshape ops invert exactly, and bad inputs fail with one-line errors.
"""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

transformers = pytest.importorskip("transformers")

from conftest import FAMILY_CASES, export_carries, random_hf_model  # noqa: E402
from bam_surgery.converters import open_checkpoint  # noqa: E402
from bam_surgery.converters.hf import ARCHITECTURES, CapabilityError, HFCheckpointReader, save_hf  # noqa: E402
from bam_surgery.converters.hf import config_map as cm  # noqa: E402
from bam_surgery.converters.hf import ops  # noqa: E402
from bam_surgery.runtime.checkpoint import CheckpointError  # noqa: E402
from bam_surgery.runtime.config import ModelConfig, preset  # noqa: E402
from bam_surgery.runtime.layout import tensor_shapes  # noqa: E402
from bam_surgery.runtime.model import Model  # noqa: E402

TOL = 1e-4
SMALL = dict(vocab_size=100, num_hidden_layers=2)

# name -> (config class, kwargs). GQA where the architecture has it, partial rotary where it has it,
# tie flags explicit; variants exercise the optional bias / tie / block paths.
CASES = {
    "llama": ("LlamaConfig", dict(SMALL, hidden_size=32, intermediate_size=48, num_attention_heads=4,
                                  num_key_value_heads=2, tie_word_embeddings=False)),
    "llama-bias-tied": ("LlamaConfig", dict(SMALL, hidden_size=32, intermediate_size=48, num_attention_heads=4,
                                            num_key_value_heads=1, attention_bias=True, mlp_bias=True,
                                            tie_word_embeddings=True, rope_theta=500.0)),
    "mistral": ("MistralConfig", dict(SMALL, hidden_size=32, intermediate_size=48, num_attention_heads=4,
                                      num_key_value_heads=2, tie_word_embeddings=False, sliding_window=4096)),
    "qwen2": ("Qwen2Config", dict(SMALL, hidden_size=32, intermediate_size=48, num_attention_heads=4,
                                  num_key_value_heads=2, tie_word_embeddings=True)),
    "gpt_neox": ("GPTNeoXConfig", dict(SMALL, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                       rotary_pct=0.5, tie_word_embeddings=False, use_parallel_residual=True)),
    "gpt_neox-sequential": ("GPTNeoXConfig", dict(SMALL, hidden_size=32, intermediate_size=64,
                                                  num_attention_heads=4, rotary_pct=0.25, hidden_act="gelu_new",
                                                  tie_word_embeddings=False, use_parallel_residual=False)),
    "gpt2": ("GPT2Config", dict(vocab_size=100, n_layer=2, n_embd=32, n_head=4, n_positions=32,
                                tie_word_embeddings=True)),
    "gpt2-untied": ("GPT2Config", dict(vocab_size=100, n_layer=2, n_embd=32, n_head=4, n_positions=32, n_inner=48,
                                       activation_function="gelu", tie_word_embeddings=False)),
    "cohere": ("CohereConfig", dict(SMALL, hidden_size=32, intermediate_size=48, num_attention_heads=4,
                                    num_key_value_heads=2, logit_scale=0.5, tie_word_embeddings=True,
                                    pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    "phi": ("PhiConfig", dict(SMALL, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                              num_key_value_heads=2, partial_rotary_factor=0.5, tie_word_embeddings=False)),
    **FAMILY_CASES,
}


def hf_model(case: str, seed: int = 0):
    return random_hf_model(*CASES[case], seed=seed)


def tokens(vocab: int, length: int = 12) -> torch.Tensor:
    return torch.randint(0, vocab, (2, length), generator=torch.Generator().manual_seed(7))


def canonical_model(reader) -> Model:
    model = Model(reader.config)
    model.load_state_dict({n: reader.get(n) for n in reader.names()})
    return model.eval()


def safetensors_state(path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def save_cases(tmp_path_factory, cases) -> dict:
    """{case: (the transformers model, its folder)}: each case saved once with save_pretrained."""
    out = {}
    for case in cases:
        d = tmp_path_factory.mktemp(case)
        model = hf_model(case)
        model.save_pretrained(d)
        out[case] = (model, d)
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Each case saved once (module-scoped to keep the file fast)."""
    return save_cases(tmp_path_factory, CASES)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(saved, case):
    hf, d = saved[case]
    reader = open_checkpoint(str(d))
    assert isinstance(reader, HFCheckpointReader)
    assert reader.config.name == hf.config.model_type
    x = tokens(reader.config.vocab_size)
    with torch.no_grad():
        ours = canonical_model(reader)(x).logits
        ref = hf(x).logits
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() <= TOL


@pytest.mark.parametrize("case", list(CASES))
def test_export_reproduces_hf_state_dict_and_loads_in_transformers(saved, tmp_path, case):
    hf, d = saved[case]
    reader = open_checkpoint(str(d))
    out = save_hf(reader, tmp_path / "out", hf.config.model_type, **export_carries(reader))
    original, exported = safetensors_state(d / "model.safetensors"), safetensors_state(out / "model.safetensors")
    assert sorted(exported) == sorted(original)
    for k in original:
        assert exported[k].dtype == original[k].dtype and torch.equal(exported[k], original[k]), k
    # config.json from the inverse config map: same ModelConfig, and transformers rebuilds the same model
    assert HFCheckpointReader(out).config == reader.config
    again = transformers.AutoModelForCausalLM.from_pretrained(out).float().eval()
    x = tokens(reader.config.vocab_size)
    with torch.no_grad():
        assert torch.equal(again(x).logits, hf(x).logits)


def test_lazy_shapes_without_reading_data(saved):
    _, d = saved["gpt_neox"]
    reader = HFCheckpointReader(d)
    cfg = reader.config
    assert reader.shape("layers.1.attn.q.weight") == (cfg.q_dim, cfg.d_model)
    assert reader.shape("layers.1.attn.v.bias") == (cfg.kv_dim,)
    assert reader.dtype("embed.weight") == torch.float32
    assert reader.file_of("layers.0.attn.k.weight") == d / "model.safetensors"
    assert reader.hf_name_of("layers.0.attn.k.weight") == ("gpt_neox.layers.0.attention.query_key_value.weight",)
    assert reader.hf_name_of("lm_head.weight") == ("embed_out.weight",)
    assert reader.metadata["model_type"] == "gpt_neox"


def test_tied_embeddings_have_no_lm_head(saved):
    for case in ("gpt2", "qwen2", "cohere", "llama-bias-tied"):
        reader = open_checkpoint(str(saved[case][1]))
        assert reader.config.tie_embeddings and "lm_head.weight" not in reader.names(), case


def test_sharded_checkpoint_and_sharded_export(saved, tmp_path):
    hf, _ = saved["llama"]
    src = tmp_path / "sharded"
    hf.save_pretrained(src, max_shard_size="20KB")
    assert (src / "model.safetensors.index.json").is_file()
    reader = open_checkpoint(str(src))
    assert len(reader.files()) > 1
    x = tokens(100)
    with torch.no_grad():
        assert (canonical_model(reader)(x).logits - hf(x).logits).abs().max().item() <= TOL
    out = save_hf(reader, tmp_path / "out", "llama", max_shard_bytes=20_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    again = transformers.AutoModelForCausalLM.from_pretrained(out).float().eval()
    with torch.no_grad():
        assert torch.equal(again(x).logits, hf(x).logits)


def test_legacy_names_base_model_keys_and_dropped_buffers(saved, tmp_path):
    """Older checkpoints: GPT-2 saved from the base model (no `transformer.` prefix) with causal-mask
    buffers; NeoX with `lm_head` for `embed_out`, a rotary buffer and a transformers 4 config. All accepted, buffers dropped."""
    hf, d = saved["gpt2-untied"]
    state = safetensors_state(d / "model.safetensors")
    legacy = {k.removeprefix("transformer."): v for k, v in state.items()}
    legacy["h.0.attn.bias"] = torch.tril(torch.ones(1, 1, 32, 32))
    legacy["h.1.attn.masked_bias"] = torch.tensor(-1e4)
    (tmp_path / "gpt2").mkdir()
    save_file(legacy, tmp_path / "gpt2" / "model.safetensors", {"format": "pt"})
    (tmp_path / "gpt2" / "config.json").write_text((d / "config.json").read_text())
    x = tokens(100)
    with torch.no_grad():
        diff = (canonical_model(open_checkpoint(str(tmp_path / "gpt2")))(x).logits - hf(x).logits).abs().max()
    assert diff.item() <= TOL

    hf, d = saved["gpt_neox"]
    state = safetensors_state(d / "model.safetensors")
    state["lm_head.weight"] = state.pop("embed_out.weight")  # transformers 5's in-memory spelling
    state["gpt_neox.layers.0.attention.rotary_emb.inv_freq"] = torch.ones(2)
    (tmp_path / "neox").mkdir()
    save_file(state, tmp_path / "neox" / "model.safetensors", {"format": "pt"})
    old_cfg = {k: v for k, v in json.loads((d / "config.json").read_text()).items() if k != "rope_parameters"}
    old_cfg.update(rotary_pct=0.5, rotary_emb_base=10000)  # transformers 4 spelling
    (tmp_path / "neox" / "config.json").write_text(json.dumps(old_cfg))
    reader = open_checkpoint(str(tmp_path / "neox"))
    assert reader.config.rotary_fraction == 0.5
    with torch.no_grad():
        assert (canonical_model(reader)(x).logits - hf(x).logits).abs().max().item() <= TOL


# ---- errors ---------------------------------------------------------------------------------
def _copy_with(saved_dir, tmp_path, mutate_state=None, mutate_config=None):
    state = safetensors_state(saved_dir / "model.safetensors")
    cfg = json.loads((saved_dir / "config.json").read_text())
    if mutate_state:
        mutate_state(state)
    if mutate_config:
        mutate_config(cfg)
    d = tmp_path / "ckpt"
    d.mkdir()
    save_file(state, d / "model.safetensors", {"format": "pt"})
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_unknown_key_is_an_error(saved, tmp_path):
    d = _copy_with(saved["llama"][1], tmp_path, mutate_state=lambda s: s.update({"model.extra.weight": torch.ones(3)}))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor model\.extra\.weight is not part of the llama"):
        open_checkpoint(str(d))


def test_missing_key_is_an_error(saved, tmp_path):
    d = _copy_with(saved["llama"][1], tmp_path, mutate_state=lambda s: s.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"tensor model\.layers\.1\.mlp\.up_proj\.weight is missing"):
        open_checkpoint(str(d))


def test_tensor_the_config_rules_out_is_an_error(saved, tmp_path):
    # qwen2 has q/k/v biases; read as llama (no attention_bias) they are not consumed
    d = _copy_with(saved["qwen2"][1], tmp_path, mutate_config=lambda c: c.update(model_type="llama"))
    with pytest.raises(CheckpointError, match=r"_proj\.bias is present but config\.json implies the model has no layers\.0\.attn\.[qkv]\.bias"):
        open_checkpoint(str(d))


def test_shape_disagreeing_with_config_is_an_error(saved, tmp_path):
    d = _copy_with(saved["llama"][1], tmp_path, mutate_config=lambda c: c.update(intermediate_size=40))
    with pytest.raises(CheckpointError, match=r"gate_proj\.weight has shape \[48, 32\], which gives "
                                               r"layers\.0\.ffn\.gate\.weight \[48, 32\]; config\.json implies \[40, 32\]"):
        open_checkpoint(str(d))


def test_unknown_model_type_is_a_capability_error(saved, tmp_path):
    d = _copy_with(saved["llama"][1], tmp_path, mutate_config=lambda c: c.update(model_type="mamba"))
    with pytest.raises(CapabilityError, match=r"config\.json: model_type='mamba' is not supported \(supported: cohere"):
        open_checkpoint(str(d))


@pytest.mark.parametrize("case,change,message", [
    ("cohere", dict(use_qk_norm=True), r"use_qk_norm=True is not supported"),
    ("phi", dict(qk_layernorm=True), r"qk_layernorm=True is not supported"),
    ("llama", dict(rope_parameters={"rope_type": "axial", "rope_theta": 1e4, "factor": 8.0}),
     r"rope_parameters: rope_type='axial' is not supported \(supported: default, linear, dynamic, yarn"),
    ("llama", dict(rope_scaling={"type": "xpos", "factor": 2.0}), r"rope_scaling: rope_type='xpos' is not supported"),
    ("gpt2", dict(scale_attn_by_inverse_layer_idx=True), r"scale_attn_by_inverse_layer_idx=True"),
    ("llama", dict(hidden_act="gelu"), r"gated FFN is supported only with SiLU"),
    ("qwen2", dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e4},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e6}}),
     r"rope_parameters differ between layer types"),
])
def test_unsupported_hf_options_are_capability_errors(saved, tmp_path, case, change, message):
    d = _copy_with(saved[case][1], tmp_path, mutate_config=lambda c: c.update(change))
    with pytest.raises(CapabilityError, match=message):
        open_checkpoint(str(d))


def test_export_capability_errors_before_any_io(tmp_path):
    paper_like = preset("tiny")  # parallel block, layernorm: not a llama
    state = {n: torch.zeros(s) for n, s in tensor_shapes(paper_like).items()}
    with pytest.raises(CapabilityError, match=r"cannot export to llama: it needs norm='rmsnorm'"):
        save_hf(state, tmp_path / "out", "llama", config=paper_like)
    mixture = paper_like.replace(ffn_experts=2)
    with pytest.raises(CapabilityError, match=r"cannot export to cohere: the model is a mixture"):
        save_hf({}, tmp_path / "out", "cohere", config=mixture)
    with pytest.raises(CapabilityError, match=r"cannot export to gpt_neox: it needs n_kv_heads = n_heads"):
        save_hf({}, tmp_path / "out", "gpt_neox",
                config=ModelConfig(vocab_size=8, d_model=16, n_layers=1, n_heads=4, n_kv_heads=2, ffn_hidden=8,
                                   activation="gelu", norm="layernorm", norm_bias=True, qkv_bias=True, o_bias=True,
                                   ffn_bias=True))
    assert not (tmp_path / "out").exists()


# ---- config map: defaults and coverage --------------------------------------------------------
CONFIG_CLASS = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config",
                "gpt_neox": "GPTNeoXConfig", "gpt2": "GPT2Config", "cohere": "CohereConfig", "phi": "PhiConfig",
                "qwen3": "Qwen3Config", "phi3": "Phi3Config", "olmo2": "Olmo2Config", "smollm3": "SmolLM3Config",
                "gemma2": "Gemma2Config", "gemma3_text": "Gemma3TextConfig", "olmo3": "Olmo3Config",
                "qwen3_5_text": "Qwen3_5TextConfig", "gemma4_text": "Gemma4TextConfig", "granite": "GraniteConfig",
                "ministral3": "Ministral3Config", "exaone4": "Exaone4Config"}
DENSE_FIELDS = {f.name for f in dataclasses.fields(ModelConfig)} - {
    "name", "ffn_experts", "ffn_top_k", "gate_norm", "ffn_shared_hidden", "attn_experts", "attn_top_k", "kv_mode", "router",
    "attn_router", "router_hidden", "router_temperature", "linear_experts", "key_store_alpha", "key_store_beta", "key_store_delta",
    "key_store_theta_percentile", "key_store_ema_decay",
    "lb_coef", "z_coef"}


DENSE_ARCHITECTURES = [m for m, a in ARCHITECTURES.items() if not a.mixture]


@pytest.mark.parametrize("model_type", DENSE_ARCHITECTURES)
def test_spec_covers_every_dense_field(model_type):
    assert ARCHITECTURES[model_type].config.covered() == DENSE_FIELDS


@pytest.mark.parametrize("model_type", DENSE_ARCHITECTURES)
def test_minimal_config_json_reads_like_the_class_defaults(model_type):
    """A config.json with only the size keys means the transformers class defaults for the rest."""
    spec = ARCHITECTURES[model_type].config
    cls = getattr(transformers, CONFIG_CLASS[model_type])
    sizes = (dict(vocab_size=100, n_embd=32, n_layer=2, n_head=4) if model_type == "gpt2" else
             dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
                  num_key_value_heads=4))
    full = cls(**sizes).to_dict()
    if model_type == "gpt_neox":  # its hub configs omit num_key_value_heads; the class rejects it as a kwarg
        full.pop("num_key_value_heads", None)
    from_full, _ = cm.hf_to_model_config(full, spec)
    from_minimal, _ = cm.hf_to_model_config({"model_type": model_type, **sizes}, spec)
    assert from_minimal == from_full


@pytest.mark.parametrize("case", list(CASES))
def test_config_map_round_trips(saved, case):
    hf, d = saved[case]
    reader = HFCheckpointReader(d)
    spec = reader.table.config
    written = cm.model_config_to_hf(reader.config, spec, hf.config.model_type)
    assert cm.hf_to_model_config(written, spec, name=reader.config.name)[0] == reader.config


def test_rope_spellings_across_transformers_versions():
    sizes = dict(model_type="qwen2", vocab_size=8, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                 intermediate_size=8)
    theta = {"rope_type": "default", "rope_theta": 5e5}
    spellings = [dict(rope_theta=5e5), dict(rope_theta=5e5, rope_scaling=None), dict(rope_parameters=theta),
                 dict(rope_parameters={"full_attention": theta, "sliding_attention": theta})]
    configs = [cm.hf_to_model_config({**sizes, **s}, ARCHITECTURES["qwen2"].config)[0] for s in spellings]
    assert all(c == configs[0] for c in configs) and configs[0].rope_theta == 5e5


def test_sliding_windows_are_modelled(saved):
    """Mistral's window applies to every layer, Qwen2's from max_window_layers on, Gemma's where layer_types say;
    read as the canonical window (test_hf_families.py holds the logits past it), with no note of an approximation."""
    mistral = open_checkpoint(str(saved["mistral"][1]))
    assert (mistral.config.attn_window, mistral.config.attn_window_layers) == (4096, None)
    assert "notes" not in mistral.metadata or "sliding" not in str(mistral.metadata["notes"])
    qwen2 = open_checkpoint(str(saved["qwen2-window"][1]))
    assert (qwen2.config.attn_window, qwen2.config.attn_window_layers) == (5, [1])
    gemma3 = open_checkpoint(str(saved["gemma3"][1]))
    assert (gemma3.config.attn_window, gemma3.config.attn_window_layers) == (5, [0, 2])
    assert (gemma3.config.window_rope_theta, gemma3.config.rope_theta) == (10000.0, 1000000.0)


# ---- reshape ops --------------------------------------------------------------------------------
def test_reshape_ops_invert_exactly_on_labelled_tensors():
    cfg = ModelConfig(vocab_size=8, d_model=12, n_layers=1, n_heads=3, n_kv_heads=1, ffn_hidden=8)  # Dh 4
    fused = torch.arange((cfg.q_dim + 2 * cfg.kv_dim) * 12).reshape(-1, 12)
    q, k, v = ops.SPLIT_QKV.forward([fused], cfg)
    assert q.shape == (12, 12) and k.shape == v.shape == (4, 12) and torch.equal(k[0], fused[12])
    conv = fused.t().contiguous()  # GPT-2 Conv1D layout [D, 3D]
    assert all(torch.equal(a, b) for a, b in zip(ops.CONV1D_SPLIT_QKV.forward([conv], cfg), (q, k, v)))
    assert torch.equal(ops.CONV1D_SPLIT_QKV.inverse(ops.CONV1D_SPLIT_QKV.forward([conv], cfg), cfg)[0], conv)

    mha = cfg.replace(n_kv_heads=3)
    per_head = torch.arange(3 * 3 * 4 * 2).reshape(36, 2)  # rows: head0 (q4,k4,v4), head1 (...), ...
    q, k, v = ops.SPLIT_QKV_PER_HEAD.forward([per_head], mha)
    assert torch.equal(q[4:8], per_head[12:16]) and torch.equal(k[0:4], per_head[4:8]) and torch.equal(v[8:], per_head[32:])
    assert torch.equal(ops.SPLIT_QKV_PER_HEAD.inverse([q, k, v], mha)[0], per_head)
    bias = torch.arange(36)
    assert torch.equal(ops.SPLIT_QKV_PER_HEAD.inverse(ops.SPLIT_QKV_PER_HEAD.forward([bias], mha), mha)[0], bias)
    with pytest.raises(ValueError, match="n_kv_heads == n_heads"):
        ops.SPLIT_QKV_PER_HEAD.forward([per_head], cfg)

    experts = [torch.full((2, 3), e) for e in range(4)]
    stacked = ops.STACK.forward(experts, cfg)[0]
    assert stacked.shape == (4, 2, 3) and all(torch.equal(a, b) for a, b in zip(ops.STACK.inverse([stacked], cfg), experts))
    assert ops.TRANSPOSE.forward_shapes([(3, 5)], cfg) == [(5, 3)]
    assert ops.CONV1D_SPLIT_QKV.inverse_shapes([(12, 12), (4, 12), (4, 12)], cfg) == [(12, 20)]
