"""Mixtral export: logits against transformers' MixtralForCausalLM, BTX-of-identical-Llamas identity,
capability errors, import(export(x)) round trip, and nothing left behind on failure."""
from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors import safe_open

from conftest import load_hf_native
from bam_surgery.converters.hf.architectures import ARCHITECTURES, bind
from bam_surgery.converters.hf.ops import STACK
from bam_surgery.converters.mixtral import CapabilityError, check_mixtral, export_mixtral, import_mixtral, load_state
from bam_surgery.runtime import save_model
from bam_surgery.runtime.checkpoint import CheckpointError, CheckpointReader, save_checkpoint
from bam_surgery.runtime.config import ModelConfig
from bam_surgery.runtime.layout import tensor_shapes
from bam_surgery.runtime.model import Model

transformers = pytest.importorskip("transformers")

TOL = 1e-4


def mixture_config(**overrides) -> ModelConfig:
    """A tiny BTX-like mixture of a Llama-shaped model: GQA, explicit head_dim, 4 FFN experts, top-2."""
    fields = dict(vocab_size=97, d_model=48, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_hidden=40,
                  activation="swiglu", norm="rmsnorm", norm_eps=1e-6, position="rope", rope_theta=5000.0,
                  block="sequential", max_positions=64, tie_embeddings=False,
                  ffn_experts=4, ffn_top_k=2, gate_norm="topk_softmax", name="btx-tiny")
    fields.update(overrides)
    return ModelConfig(**fields)


def random_model(cfg: ModelConfig, seed: int = 0) -> Model:
    """Every parameter random (norms too, so swapped norm names would show in the logits)."""
    torch.manual_seed(seed)
    model = Model(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    return model.eval()


def hf_mixtral(path):
    return load_hf_native("MixtralForCausalLM", path)


def tokens(cfg: ModelConfig, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (2, 13), generator=torch.Generator().manual_seed(seed))


# ---- (a) a random mixture: our runtime vs transformers' Mixtral ----------------------------
@pytest.mark.parametrize("tie", [False, True])
def test_export_matches_transformers_mixtral(tmp_path, tie):
    cfg = mixture_config(tie_embeddings=tie)
    model = random_model(cfg)
    save_model(model, tmp_path / "mix.safetensors")
    out = export_mixtral(CheckpointReader(tmp_path / "mix.safetensors"), tmp_path / "hf",
                         max_shard_bytes=40_000, generation_config={"bos_token_id": 1, "eos_token_id": 2})
    assert len(list(out.glob("model-*.safetensors"))) > 1  # sharded, experts split across shards
    hf = hf_mixtral(out)
    assert hf.config.rope_parameters["rope_theta"] == cfg.rope_theta
    assert hf.config.head_dim == cfg.head_dim and hf.config.eos_token_id == 2

    x = tokens(cfg)
    with torch.no_grad():
        ours, theirs = model(x).logits, hf(x).logits
    # the router must actually pick different experts for different tokens
    probs = next(iter(model(x).routing.values())).probs
    assert probs.topk(2, -1).indices.unique().numel() == cfg.ffn_experts
    assert (ours - theirs).abs().max().item() <= TOL

    # what we wrote is exactly what save_pretrained writes for the same model
    hf.save_pretrained(tmp_path / "resaved")
    with safe_open(str(tmp_path / "resaved" / "model.safetensors"), "pt") as f:
        resaved = {k: f.get_tensor(k) for k in f.keys()}
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(resaved)
    for key, file in index["weight_map"].items():
        with safe_open(str(out / file), "pt") as f:
            assert torch.equal(f.get_tensor(key), resaved[key]), key


# ---- (b) N identical Llamas stacked into a BTX mixture reproduce the dense Llama ----------
# transformers Llama name -> canonical name (a local map: the project's Llama importer is tested elsewhere)
LLAMA_TO_CANONICAL = {
    "model.embed_tokens.weight": "embed.weight",
    "model.norm.weight": "final_norm.weight",
    "lm_head.weight": "lm_head.weight",
    "model.layers.{i}.input_layernorm.weight": "layers.{i}.attn_norm.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "layers.{i}.ffn_norm.weight",
    "model.layers.{i}.self_attn.q_proj.weight": "layers.{i}.attn.q.weight",
    "model.layers.{i}.self_attn.k_proj.weight": "layers.{i}.attn.k.weight",
    "model.layers.{i}.self_attn.v_proj.weight": "layers.{i}.attn.v.weight",
    "model.layers.{i}.self_attn.o_proj.weight": "layers.{i}.attn.o.weight",
    "model.layers.{i}.mlp.gate_proj.weight": "layers.{i}.ffn.gate.weight",
    "model.layers.{i}.mlp.up_proj.weight": "layers.{i}.ffn.up.weight",
    "model.layers.{i}.mlp.down_proj.weight": "layers.{i}.ffn.down.weight",
}


def llama_to_canonical(key: str, n_layers: int) -> str:
    for i in range(n_layers):
        for theirs, ours in LLAMA_TO_CANONICAL.items():
            if theirs.format(i=i) == key:
                return ours.format(i=i)
    raise KeyError(key)


def test_identical_llama_experts_reproduce_dense_llama(tmp_path):
    n_copies = 3
    llama_cfg = transformers.LlamaConfig(
        vocab_size=89, hidden_size=32, intermediate_size=56, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=64, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    torch.manual_seed(3)
    llama = transformers.LlamaForCausalLM(llama_cfg).eval()
    with torch.no_grad():
        for name, p in llama.named_parameters():
            p.copy_((1.0 + 0.3 * torch.randn_like(p)) if "norm" in name else 0.15 * torch.randn_like(p))
    llama.save_pretrained(tmp_path / "llama")
    with safe_open(str(tmp_path / "llama" / "model.safetensors"), "pt") as f:
        dense = {llama_to_canonical(k, 2): f.get_tensor(k) for k in f.keys()}

    cfg = ModelConfig(vocab_size=89, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=56,
                      norm_eps=1e-5, rope_theta=10000.0, max_positions=64,
                      ffn_experts=n_copies, ffn_top_k=2, gate_norm="topk_softmax")
    mixture = {}
    for name, t in dense.items():
        if ".ffn." in name:  # the FFN of each copy becomes one expert
            mixture[name.replace(".ffn.", ".ffn_experts.")] = torch.stack([t] * n_copies)
        else:
            mixture[name] = t
    for i in range(cfg.n_layers):
        mixture[f"layers.{i}.ffn_router.weight"] = torch.randn(n_copies, cfg.d_model)
    mixture = {k: mixture[k] for k in tensor_shapes(cfg)}  # canonical order; KeyError if anything is missing
    save_checkpoint(mixture, cfg, tmp_path / "btx.safetensors")

    out = export_mixtral(CheckpointReader(tmp_path / "btx.safetensors"), tmp_path / "hf")
    x = tokens(cfg)
    with torch.no_grad():
        dense_logits, mixtral_logits = llama(x).logits, hf_mixtral(out)(x).logits
    assert (dense_logits - mixtral_logits).abs().max().item() <= TOL


# ---- (c) capability errors, before any I/O --------------------------------------------------
@pytest.mark.parametrize("overrides, recipe, words", [
    (dict(attn_experts=4), "bam", ["recipe bam", "dense attention", "4 attention experts"]),
    (dict(activation="gelu"), None, ["SwiGLU", "activation gelu"]),
    (dict(gate_norm="softmax", ffn_top_k=2), None, ["topk_softmax", "top-2 of 4"]),
    (dict(gate_norm="softmax", ffn_top_k=1), None, ["topk_softmax", "top-1 of 4"]),
    (dict(block="parallel"), None, ["sequential blocks"]),
    (dict(norm="layernorm"), None, ["RMSNorm"]),
    (dict(rope_interleaved=True), None, ["half-split RoPE"]),
    (dict(rotary_fraction=0.5), None, ["whole head"]),
    (dict(qkv_bias=True), None, ["q/k/v biases"]),
    (dict(logit_scale=0.5), None, ["unscaled logits"]),
    (dict(ffn_experts=0), None, ["FFN experts"]),
])
def test_capability_errors(tmp_path, overrides, recipe, words):
    cfg = mixture_config(**overrides)
    with pytest.raises(CapabilityError) as err:
        check_mixtral(cfg, recipe)
    message = str(err.value)
    assert "\n" not in message and message.startswith("mixtral export needs")
    for w in words:
        assert w in message, message


def test_capability_error_writes_nothing(tmp_path):
    cfg = mixture_config(activation="gelu")
    save_model(random_model(cfg), tmp_path / "gelu.safetensors")
    with pytest.raises(CapabilityError, match="SwiGLU"):
        export_mixtral(CheckpointReader(tmp_path / "gelu.safetensors"), tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gelu.safetensors"]


def test_softmax_gates_over_all_experts_are_exportable():
    # top-k == E: the top-k probabilities already sum to 1, so renormalizing changes nothing
    check_mixtral(mixture_config(gate_norm="softmax", ffn_top_k=4))


# ---- (d) round trip and the name table -------------------------------------------------------
def test_name_table_round_trips():
    """The Mixtral table bound to a config: every canonical tensor once, in layout order; expert e's
    tensors at slot e of the stacked tensor; every Mixtral name once; stack and unstack invert."""
    cfg = mixture_config()
    binding = bind(ARCHITECTURES["mixtral"], cfg)
    assert [c for row in binding.active for c in row.canonical] == list(tensor_shapes(cfg))
    hf_names = [n for row in binding.active for n in row.hf]
    assert len(set(hf_names)) == len(hf_names) == 2 * (2 + 4 + 1 + 3 * 4) + 3  # per layer: 2 norms, q k v o,
    for row in binding.active:                                                # router, 3x4 experts
        if row.op is STACK:
            assert [int(n.split(".experts.")[1].split(".")[0]) for n in row.hf] == list(range(cfg.ffn_experts))
            stacked = torch.arange(cfg.ffn_experts * 6.0).reshape(cfg.ffn_experts, 2, 3)
            assert torch.equal(STACK.forward(STACK.inverse([stacked], cfg), cfg)[0], stacked)
    assert "model.layers.0.mlp.experts.gate_up_proj" not in binding.known()


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_import_of_export_round_trips(tmp_path, dtype):
    cfg = mixture_config(tie_embeddings=True)
    save_model(random_model(cfg, seed=5), tmp_path / "mix.safetensors")
    source = CheckpointReader(tmp_path / "mix.safetensors")
    export_mixtral(source, tmp_path / "hf", max_shard_bytes=30_000, dtype=dtype,
                   tokenizer_files=[_tokenizer_file(tmp_path)], model_card="# tiny btx\n")
    back = import_mixtral(tmp_path / "hf")
    assert sorted(back.names()) == sorted(source.names())
    for name in source.names():
        want = source.get(name) if dtype is None else source.get(name).to(dtype)
        got = back.get(name)
        assert got.dtype == want.dtype and torch.equal(got, want), name
    # everything Mixtral's config carries comes back; z-loss has no Mixtral field
    assert back.config == cfg.replace(z_coef=0.0, name=back.config.name)
    hf_cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf_cfg["dtype"] == ("float32" if dtype is None else "bfloat16")
    assert (tmp_path / "hf" / "tokenizer.json").read_text() == '{"model": "tiny"}'
    assert (tmp_path / "hf" / "README.md").read_text() == "# tiny btx\n"
    _, state = load_state(back)
    with torch.no_grad():  # the imported state drives the runtime like the original
        reloaded = Model(back.config)
        reloaded.load_state_dict(state)


def _tokenizer_file(tmp_path):
    p = tmp_path / "tok" / "tokenizer.json"
    p.parent.mkdir()
    p.write_text('{"model": "tiny"}')
    return p


def test_import_rejects_bad_directories(tmp_path):
    from safetensors.torch import save_file

    cfg = mixture_config()
    save_model(random_model(cfg), tmp_path / "mix.safetensors")
    out = export_mixtral(CheckpointReader(tmp_path / "mix.safetensors"), tmp_path / "hf")
    shard = out / "model-00001-of-00001.safetensors"
    with safe_open(str(shard), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    good_config = json.loads((out / "config.json").read_text())

    good_index = json.loads((out / "model.safetensors.index.json").read_text())

    def rewrite(tensors=tensors, index=True, **config_changes):
        save_file(tensors, str(shard), metadata={"format": "pt"})
        (out / "config.json").write_text(json.dumps({**good_config, **config_changes}))
        weight_map = {k: shard.name for k in tensors} if index else good_index["weight_map"]
        (out / "model.safetensors.index.json").write_text(json.dumps({**good_index, "weight_map": weight_map}))

    missing = "model.layers.1.block_sparse_moe.experts.2.w3.weight"
    rewrite({k: v for k, v in tensors.items() if k != missing})
    with pytest.raises(CheckpointError, match=re.escape(f"tensor {missing} is missing")):
        import_mixtral(out)
    fused = "model.layers.0.mlp.experts.gate_up_proj"
    rewrite({**tensors, fused: torch.zeros(4, 80, 48)}, index=False)
    with pytest.raises(CheckpointError, match=re.escape(f"{shard}: tensor {fused} is not listed in the index")):
        import_mixtral(out)
    rewrite({**tensors, fused: torch.zeros(4, 80, 48)})
    with pytest.raises(CheckpointError, match=re.escape(f"{shard}: tensor {fused} is not part of the mixtral mapping")):
        import_mixtral(out)
    rewrite(num_local_experts=5)
    with pytest.raises(CheckpointError, match=r"block_sparse_moe\.gate\.weight has shape \[4, 48\], which gives "
                                              r"layers\.0\.ffn_router\.weight \[4, 48\]; config\.json implies \[5, 48\]"):
        import_mixtral(out)
    rewrite(num_hidden_layers=1)
    with pytest.raises(CheckpointError, match=r"tensor model\.layers\.1\..* is not part of the mixtral mapping"):
        import_mixtral(out)
    rewrite(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0})  # scaled RoPE is read
    assert import_mixtral(out).config.scaled_rope == {"rope_type": "yarn", "factor": 2.0,
                                                      "original_max_position_embeddings": 64}
    rewrite(rope_parameters={"rope_type": "mrope", "rope_theta": 1e4})
    with pytest.raises(CapabilityError, match="config.json: rope_parameters: rope_type='mrope' is not supported"):
        import_mixtral(out)
    expert = "model.layers.0.block_sparse_moe.experts.1.w1.weight"
    rewrite({**tensors, expert: tensors[expert].to(torch.bfloat16)})
    with pytest.raises(CheckpointError, match="mixed dtypes"):
        import_mixtral(out)
    rewrite()
    assert import_mixtral(out).config.ffn_experts == 4


# ---- failure mid-way leaves nothing ------------------------------------------------------------
def test_failed_export_leaves_nothing(tmp_path):
    cfg = mixture_config()
    save_model(random_model(cfg), tmp_path / "mix.safetensors")
    reader = CheckpointReader(tmp_path / "mix.safetensors")
    real_get, calls = reader.get, []

    def failing_get(name):
        calls.append(name)
        if len(calls) == 3:
            raise OSError(f"simulated read error on {name}")
        return real_get(name)

    reader.get = failing_get
    with pytest.raises(OSError, match="simulated"):
        export_mixtral(reader, tmp_path / "hf", max_shard_bytes=30_000)
    assert len(calls) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mix.safetensors"]

    # an existing export at the target survives a failed re-export untouched
    reader.get = real_get
    export_mixtral(reader, tmp_path / "hf")
    before = sorted(p.name for p in (tmp_path / "hf").iterdir())
    calls.clear()
    reader.get = failing_get
    with pytest.raises(OSError):
        export_mixtral(reader, tmp_path / "hf")
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "mix.safetensors"]
