"""HF BAM export: tiny random mixtures, exported, loaded with transformers' remote-code path, compared with
bam-surgery's reference runtime (logits, loss, KV-cached greedy generation, padded batches). Offline."""
from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from bam_surgery.converters.hf_bam import (canonical_weight_name, check_hf_bam, config_from_hf_dict, export_hf_bam,
                               hf_weight_name)
from bam_surgery.converters.hf_bam import modeling_bam
from bam_surgery.converters.hf_bam.configuration_bam import SUPPORTED
from bam_surgery.converters.hf_bam.export import SHIPPED_FILES
from bam_surgery.runtime import Model, ModelConfig, save_model
from bam_surgery.runtime.checkpoint import CheckpointReader
from bam_surgery.runtime.reader import Reader
from bam_surgery.runtime.layout import tensor_shapes

TOL = 1e-4
V = 64
BASE = dict(vocab_size=V, d_model=32, n_layers=2, n_heads=4, ffn_hidden=48, max_positions=64)
# Each variant turns on a different set of features; together they cover every block style, norm,
# position scheme, activation, routing mode, gate normalization and KV mode.
VARIANTS = {
    "bam_expert_kv": dict(block="parallel", norm="layernorm", activation="swiglu", rotary_fraction=0.5,
                          n_kv_heads=2, attn_experts=3, ffn_experts=3, ffn_top_k=2, gate_norm="softmax",
                          tie_embeddings=True, lm_head_bias=True, logit_scale=0.5),
    "bam_shared_kv": dict(block="sequential", norm="rmsnorm", activation="gelu_tanh", rope_interleaved=True,
                          n_kv_heads=1, qkv_bias=True, o_bias=True, ffn_bias=True, attn_experts=2,
                          kv_mode="shared", ffn_experts=2, ffn_top_k=1, gate_norm="topk_softmax"),
    "topk_attention": dict(block="parallel_two_norms", norm="layernorm", norm_bias=True, activation="relu",
                           head_dim=12, attn_experts=3, attn_top_k=1, ffn_experts=4, ffn_top_k=2,
                           gate_norm="topk_softmax"),
    "btx": dict(block="sequential", norm="rmsnorm", activation="swiglu", n_kv_heads=2, ffn_experts=4,
                ffn_top_k=2, gate_norm="topk_softmax"),
    "sequential_learned": dict(block="sequential", norm="layernorm", norm_bias=True, activation="gelu",
                               position="learned", attn_experts=2, ffn_experts=2, ffn_top_k=1,
                               tie_embeddings=True),
    "dense": dict(block="parallel", norm="rmsnorm", activation="silu", position="none", lm_head_bias=True),
    # a shared FFN expert beside routed ones (recipe btx-shared-expert), with BAM attention experts and FFN biases
    "shared_expert": dict(block="parallel", norm="layernorm", activation="gelu", ffn_bias=True, attn_experts=2,
                          ffn_experts=3, ffn_top_k=1, ffn_shared_hidden=24),
    # router kinds (runtime/routers.py, shipped as routers.py)
    "router_mlp": dict(block="sequential", norm="rmsnorm", activation="swiglu", n_kv_heads=2, attn_experts=2,
                       ffn_experts=3, ffn_top_k=2, router="mlp", router_hidden=24),
    "router_attention": dict(block="parallel", norm="layernorm", activation="gelu", attn_experts=3, attn_top_k=2,
                             ffn_experts=3, ffn_top_k=1, gate_norm="topk_softmax", router="attention"),
    "router_expert_embedding": dict(block="parallel_two_norms", norm="layernorm", activation="swiglu",
                                    attn_experts=2, kv_mode="shared", ffn_experts=3, ffn_top_k=2,
                                    router="expert_embedding", attn_router="attention"),
    # SoME: key-store router (query network, cosine over unit keys / temperature), no final norm
    "key_store": dict(block="sequential", norm="layernorm", norm_bias=True, activation="gelu", qkv_bias=True,
                      o_bias=True, ffn_bias=True, lm_head_bias=True, final_norm=False, ffn_experts=6, ffn_top_k=3,
                      gate_norm="topk_softmax", router="key_store", router_temperature=0.1),
    # the families of 2024-25: Qwen3's per-head QK-norm with YaRN, OLMo 2's post-norms and full-width QK-norm with
    # shared K/V, Phi-3's longrope (original length 16: generation crosses it), SmolLM3's layer without RoPE with
    # Llama 3's scaled RoPE
    "qwen3_yarn": dict(block="sequential", norm="rmsnorm", activation="swiglu", n_kv_heads=2, head_dim=16,
                       qk_norm="head", attn_experts=3, ffn_experts=3, ffn_top_k=2, gate_norm="topk_softmax",
                       scaled_rope=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16)),
    "olmo2_shared_kv": dict(block="sequential", norm="rmsnorm", activation="swiglu", n_kv_heads=2, qk_norm="full",
                            norm_position="post", attn_experts=2, kv_mode="shared", ffn_experts=2, ffn_top_k=1),
    "phi3_longrope": dict(block="sequential", norm="rmsnorm", activation="swiglu", attn_experts=2, ffn_experts=3,
                          ffn_top_k=2, gate_norm="topk_softmax",
                          scaled_rope=dict(rope_type="longrope", original_max_position_embeddings=16,
                                           short_factor=[1.0, 1.1, 1.2, 1.3], long_factor=[1.0, 2.0, 4.0, 8.0])),
    # sliding windows of 3 (generation and the padded batches run past them): Gemma 3's local layers with their own
    # RoPE base, sandwich (1 + w) norms, scaled embeddings, GeGLU, query_pre_attn_scalar; Gemma 2's soft-capping
    "gemma3_window": dict(block="sequential", norm="rmsnorm", activation="geglu_tanh", n_kv_heads=2, head_dim=16,
                          qk_norm="head", norm_position="sandwich", norm_unit_offset=True, scale_embeddings=True,
                          attn_scale_dim=24, attn_window=3, attn_window_layers=[0], window_rope_theta=100.0,
                          attn_experts=2, ffn_experts=2, ffn_top_k=1, tie_embeddings=True),
    "gemma2_softcap": dict(block="sequential", norm="rmsnorm", activation="geglu_tanh", norm_position="sandwich",
                           norm_unit_offset=True, scale_embeddings=True, attn_window=3, attn_softcap=5.0,
                           final_softcap=3.0, attn_experts=2, kv_mode="shared", ffn_experts=3, ffn_top_k=2,
                           gate_norm="topk_softmax"),
    "smollm3_llama3": dict(block="sequential", norm="rmsnorm", activation="swiglu", n_kv_heads=2, nope_layers=[1],
                           attn_experts=2, ffn_experts=2, ffn_top_k=1,
                           scaled_rope=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                            high_freq_factor=4.0, original_max_position_embeddings=16)),
    # the families of 2026: Qwen3.5's Gated DeltaNet layers as DeltaNet experts (recipe bam) and dense (btx) beside
    # its gated attention; Gemma 4's global layers (their own head size, one kv head, K = V, proportional RoPE), the
    # last two layers reading the first two's K/V (double-wide MLPs there), per-layer inputs, shared K/V experts
    "qwen3_5_bam": dict(block="sequential", norm="rmsnorm", activation="swiglu", n_kv_heads=2, head_dim=16,
                        rotary_fraction=0.25, qk_norm="head", norm_unit_offset=True, attn_output_gate=True,
                        linear_layers=[0], linear_key_heads=2, linear_value_heads=4, linear_key_dim=8,
                        linear_value_dim=8, linear_conv=4, attn_experts=2, linear_experts=2, ffn_experts=2,
                        ffn_top_k=1),
    "qwen3_5_btx": dict(block="sequential", norm="rmsnorm", activation="swiglu", n_kv_heads=2, head_dim=16,
                        rotary_fraction=0.25, qk_norm="head", norm_unit_offset=True, attn_output_gate=True,
                        linear_layers=[1], linear_key_heads=2, linear_value_heads=2, linear_key_dim=8,
                        linear_value_dim=16, linear_conv=3, ffn_experts=3, ffn_top_k=2, gate_norm="topk_softmax"),
    "gemma4_shared_kv": dict(n_layers=4, block="sequential", norm="rmsnorm", activation="geglu_tanh", n_kv_heads=2,
                             head_dim=8, qk_norm="head", norm_position="sandwich", scale_embeddings=True,
                             attn_scale_dim=1, attn_window=3, attn_window_layers=[0, 2], window_rope_theta=100.0,
                             scaled_rope=dict(rope_type="proportional", partial_rotary_factor=0.25),
                             global_head_dim=16, global_kv_heads=1, global_k_eq_v=True, v_norm=True,
                             kv_shared_layers=2, kv_shared_ffn_hidden=96, per_layer_dim=4, layer_scale=True,
                             final_softcap=30.0, tie_embeddings=True, attn_experts=2, kv_mode="shared",
                             ffn_experts=2, ffn_top_k=1),
    # the families of 2026: Granite's multipliers and attention scale with Ministral 3's queries scaled by position
    # (every 4 positions: generation crosses two periods); EXAONE 4's post-norms and per-head QK-norm with RoPE in
    # its sliding layer only
    "granite_ministral3": dict(block="sequential", norm="rmsnorm", activation="swiglu", n_kv_heads=2,
                               embedding_multiplier=12.0, residual_multiplier=0.22, attn_scale=0.0625,
                               logit_scale=0.125, attn_temperature=0.5, attn_temperature_length=4, attn_experts=2,
                               ffn_experts=3, ffn_top_k=2, gate_norm="topk_softmax"),
    "exaone4_window": dict(block="sequential", norm="rmsnorm", activation="swiglu", n_kv_heads=2, head_dim=16,
                           qk_norm="head", norm_position="post", attn_window=3, attn_window_layers=[0],
                           nope_layers=[1], attn_experts=2, kv_mode="shared", ffn_experts=2, ffn_top_k=1),
}


def random_model(variant: str, seed: int) -> Model:
    """Random weights large enough for spread-out logits; routers scaled up so routing is far from uniform."""
    model = Model(ModelConfig(**{**BASE, **VARIANTS[variant]}, name=variant))
    model.reset_parameters(std=0.2, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("log_temperature"):  # cosine logits over tau 0.05: far from uniform
                p.fill_(math.log(0.05))
            elif "router" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            elif name.endswith("norm.weight") or (name.endswith(".bias") and p.dim() == 1 and "norm" in name):
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)
    return model.eval()


def runtime_greedy(model: Model, prompt: torch.Tensor, n: int) -> torch.Tensor:
    """Greedy continuation from the reference runtime, recomputing the whole sequence each step (no cache)."""
    seq = prompt
    with torch.no_grad():
        for _ in range(n):
            seq = torch.cat([seq, model(seq).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return seq[:, prompt.shape[1]:]


def load_hf(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def exported(tmp_path_factory, hf_modules):
    """variant -> (runtime model, export dir, HF model); built once per variant."""
    built: dict[str, tuple] = {}

    def get(variant: str):
        if variant not in built:
            root = tmp_path_factory.mktemp(variant)
            model = random_model(variant, seed=list(VARIANTS).index(variant))
            save_model(model, root / "canonical.safetensors")
            with CheckpointReader(root / "canonical.safetensors") as reader:
                out = export_hf_bam(reader, root / "hf", max_shard_bytes=40_000 if variant == "btx" else None)
            built[variant] = (model, out, load_hf(out))
        return built[variant]

    return get


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_and_loss_match_runtime(exported, variant):
    model, _, hf = exported(variant)
    tokens = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(7))
    labels = tokens.clone()
    labels[0, 3:6] = -100
    with torch.no_grad():
        ref = model(tokens[:, :-1], targets=labels[:, 1:])
        ours = model(tokens).logits
        out = hf(tokens, labels=labels)
    assert (out.logits - ours).abs().max().item() <= TOL
    assert abs(out.loss.item() - ref.nll.item()) <= TOL
    # routing is not trivial: gates far from uniform, and different tokens prefer different experts
    if model.config.is_mixture:
        with torch.no_grad():
            probs = [r.probs for r in model(tokens).routing.values()]
        assert max(p.max().item() for p in probs) > 0.8
        assert all(len(set(p.argmax(-1).tolist())) > 1 for p in probs)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_generate_with_cache_matches_runtime(exported, variant):
    model, _, hf = exported(variant)
    prompt = torch.randint(0, V, (1, 7), generator=torch.Generator().manual_seed(11))
    seen_lengths = []
    hook = hf.model.register_forward_pre_hook(lambda mod, args: seen_lengths.append(args[0].shape[1]))
    try:
        with torch.no_grad():
            generated = hf.generate(prompt, max_new_tokens=5, do_sample=False)
    finally:
        hook.remove()
    assert seen_lengths == [7, 1, 1, 1, 1]  # prefill once, then one token per step: the KV cache is in use
    assert torch.equal(generated[:, 7:], runtime_greedy(model, prompt, 5))

    # cached decoding step by step gives the runtime's full-sequence logits
    seq = torch.cat([prompt, generated[:, 7:]], dim=1)
    with torch.no_grad():
        full = model(seq).logits
        out = hf(seq[:, :5], use_cache=True)
        steps = [out.logits]
        for t in range(5, seq.shape[1]):
            out = hf(seq[:, t:t + 1], past_key_values=out.past_key_values, use_cache=True)
            steps.append(out.logits)
    assert (torch.cat(steps, dim=1) - full).abs().max().item() <= TOL


@pytest.mark.parametrize("variant", ["bam_expert_kv", "topk_attention", "sequential_learned", "btx", "olmo2_shared_kv",
                                     "phi3_longrope", "gemma3_window", "gemma2_softcap", "qwen3_5_bam",
                                     "gemma4_shared_kv", "granite_ministral3"])
def test_left_padded_batch(exported, variant):
    model, _, hf = exported(variant)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, V, (1, n), generator=gen) for n in (4, 9)]
    pad = 0
    width = max(p.shape[1] for p in prompts)
    ids = torch.stack([torch.cat([torch.full((width - p.shape[1],), pad), p[0]]) for p in prompts])
    mask = torch.stack([torch.cat([torch.zeros(width - p.shape[1]), torch.ones(p.shape[1])]) for p in prompts]).long()
    with torch.no_grad():
        logits = hf(ids, attention_mask=mask).logits
        generated = hf.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=pad)
        for row, p in enumerate(prompts):
            n = p.shape[1]
            assert (logits[row, width - n:] - model(p).logits[0]).abs().max().item() <= TOL
            assert torch.equal(generated[row, width:], runtime_greedy(model, p, 5)[0])


def test_weight_names_and_tied_embeddings(exported):
    model, out, hf = exported("bam_expert_kv")
    cfg = model.config
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        stored = set(f.keys())
        assert f.metadata()["format"] == "pt"
    assert stored == {hf_weight_name(n) for n in tensor_shapes(cfg)}
    assert "lm_head.weight" not in stored and "lm_head.bias" in stored
    assert hf.lm_head.weight is hf.model.embed.weight
    # every HF parameter maps back to a canonical tensor with the same values (the tied head to embed.weight)
    state = model.state_dict()
    for name, value in hf.state_dict().items():
        canonical = canonical_weight_name(name)
        source = "embed.weight" if canonical == "lm_head.weight" else canonical
        assert torch.equal(value, state[source]), name
    assert {canonical_weight_name(hf_weight_name(n)) for n in state} == set(state)
    config = json.loads((out / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_bam.BamForCausalLM"
    assert {k: config[k] for k in cfg.to_dict()} == cfg.to_dict()
    assert config_from_hf_dict(config) == cfg
    assert hf.config.tie_word_embeddings is True and hf.config.attn_experts == 3


def test_sharded_export(exported):
    model, out, hf = exported("btx")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((out / s).exists() for s in shards)
    assert set(index["weight_map"]) == {hf_weight_name(n) for n in tensor_shapes(model.config)}
    assert not (out / "model.safetensors").exists()


def save_word_tokenizer(folder: Path) -> None:
    """A word-level tokenizer of V tokens saved in `folder`: <unk>, <pad>, </s> (ids 0, 1, 2), words w3 .. w{V-1}."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<pad>", "</s>"]
    vocab = {t: i for i, t in enumerate(specials)} | {f"w{i}": i for i in range(len(specials), V)}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>", pad_token="<pad>", eos_token="</s>"
                            ).save_pretrained(folder)


def test_tokenizer_card_and_pipeline(tmp_path, hf_modules):
    from transformers import AutoTokenizer, pipeline

    save_word_tokenizer(tmp_path / "tok")
    model = random_model("bam_shared_kv", seed=3)
    save_model(model, tmp_path / "canonical")
    card = "# tiny BAM\n\nExported by bam-surgery.\n"
    with CheckpointReader(tmp_path / "canonical") as reader:
        out = export_hf_bam(reader, tmp_path / "hf", tokenizer_files=sorted((tmp_path / "tok").iterdir()),
                            model_card=card, generation={"eos_token_id": 2, "pad_token_id": 1})
    assert (out / "README.md").read_text() == card
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == 2
    tok = AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    assert tok("w5 w9 w12 w40")["input_ids"] == [5, 9, 12, 40]
    generate = pipeline("text-generation", model=str(out), tokenizer=tok, trust_remote_code=True,
                        dtype=torch.float32)
    text = generate("w5 w9 w12 w40", max_new_tokens=4, do_sample=False, return_full_text=False)[0]["generated_text"]
    expected = runtime_greedy(model, torch.tensor([[5, 9, 12, 40]]), 4)[0].tolist()
    if 2 in expected:  # generation stops at eos
        expected = expected[: expected.index(2) + 1]
    assert text.split() == [f"w{i}" for i in expected if i > 2]


def test_rejects_unsupported_config_before_writing(tmp_path):
    cfg = ModelConfig(**BASE, attn_experts=2)
    cfg.router = "cosine"  # a router kind modeling_bam.py does not implement
    with pytest.raises(ValueError, match="router='cosine'") as err:
        check_hf_bam(cfg)
    assert "\n" not in str(err.value)

    @dataclasses.dataclass
    class FutureConfig(ModelConfig):
        attn_window: int = 0  # a field the modeling code would silently ignore

    with pytest.raises(ValueError, match="attn_window"):
        check_hf_bam(FutureConfig(**BASE))

    class Reader:  # a reader whose config the export must refuse
        config, path = cfg, tmp_path / "in.safetensors"

    with pytest.raises(ValueError, match="cosine"):
        export_hf_bam(Reader(), tmp_path / "out")
    assert not (tmp_path / "out").exists()


class EditedReader(Reader):
    """Wraps a reader, hiding or reshaping one tensor, to stand for a damaged checkpoint."""

    def __init__(self, reader, drop: str | None = None, reshape: str | None = None):
        self.inner, self.drop, self.reshape = reader, drop, reshape
        self.config, self.path, self.metadata = reader.config, reader.path, reader.metadata

    def names(self):
        return [n for n in self.inner.names() if n != self.drop]

    def shape(self, n):
        return (1,) if n == self.reshape else self.inner.shape(n)

    def dtype(self, n):
        return self.inner.dtype(n)

    def get(self, n):
        return self.inner.get(n)


def test_rejects_damaged_checkpoint_without_output(tmp_path):
    model = random_model("btx", seed=1)
    save_model(model, tmp_path / "c.safetensors")
    tensor = "layers.1.ffn_experts.up.weight"
    with CheckpointReader(tmp_path / "c.safetensors") as reader:
        with pytest.raises(ValueError, match=f"c.safetensors: tensor {tensor} is missing"):
            export_hf_bam(EditedReader(reader, drop=tensor), tmp_path / "out")
        with pytest.raises(ValueError, match=rf"tensor {tensor} has shape \[1\]"):
            export_hf_bam(EditedReader(reader, reshape=tensor), tmp_path / "out")
        with pytest.raises(ValueError, match="tokenizer file not found"):
            export_hf_bam(reader, tmp_path / "out", tokenizer_files=[tmp_path / "nope.json"])
        with pytest.raises(ValueError, match="may not be named config.json"):
            (tmp_path / "config.json").write_text("{}")
            export_hf_bam(reader, tmp_path / "out", tokenizer_files=[tmp_path / "config.json"])
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_supported_table_matches_modeling_code():
    assert set(modeling_bam.ACTIVATIONS) == set(SUPPORTED["activation"])
    from bam_surgery.runtime import config as runtime_config

    # everything the runtime accepts today is exportable
    for fld, runtime_values in [("activation", runtime_config.ACTIVATIONS), ("norm", runtime_config.NORMS),
                                ("position", runtime_config.POSITIONS), ("block", runtime_config.BLOCKS),
                                ("gate_norm", runtime_config.GATE_NORMS), ("kv_mode", runtime_config.KV_MODES),
                                ("router", runtime_config.ROUTERS)]:
        assert set(runtime_values) <= set(SUPPORTED[fld]), fld


def test_remote_code_imports_only_torch_and_transformers():
    import ast

    allowed = {"torch", "transformers", "math", "os", "dataclasses", "typing", "warnings", "__future__"}
    for name, source in SHIPPED_FILES.items():
        tree = ast.parse(source.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                roots = {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: must be a sibling shipped in the same folder
                    assert f"{node.module}.py" in SHIPPED_FILES, f"{name} imports .{node.module}"
                    continue
                roots = {node.module.split(".")[0]}
            else:
                continue
            assert roots <= allowed, f"{name} imports {roots - allowed}"


def test_export_ships_the_runtimes_model_math(exported):
    """One copy of the model math: the export's blocks_bam.py is runtime/blocks.py byte for byte, the loaded
    HF model's blocks come from that shipped file, and modeling_bam.py defines none of the math itself."""
    import ast

    from bam_surgery.runtime import blocks

    _, out, hf = exported("bam_shared_kv")
    assert (out / "blocks_bam.py").read_bytes() == Path(blocks.__file__).read_bytes()
    assert {p.name for p in out.glob("*.py")} == set(SHIPPED_FILES)
    block_module = type(hf.model.layers[0]).__module__
    assert block_module.endswith(".blocks_bam") and block_module.startswith("transformers_modules.")
    assert type(hf.model.layers[0]) is not blocks.Block  # the shipped copy, not the installed package
    tree = ast.parse((Path(modeling_bam.__file__)).read_text())
    defined = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    math = {n.name for n in ast.walk(ast.parse(Path(blocks.__file__).read_text()))
            if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.col_offset == 0}
    assert not defined & math, defined & math
    assert not defined & {"attention", "feed_forward", "route", "apply_rotary", "attend"}


@pytest.mark.parametrize("changes", [{}, {"n_kv_heads": 2}, {"head_dim": 16, "rotary_fraction": 0.25},
                                     {"n_heads": 8, "rotary_fraction": 0.4}, {"router": "mlp"},
                                     {"attn_experts": 2, "router": "mlp", "attn_router": "attention"}])
def test_bam_config_derives_what_model_config_derives(changes):
    """BamConfig restates ModelConfig's derived rules (n_kv_heads and head_dim when None, rotary_dim, the router
    kinds): it ships standalone and the runtime cannot import converters (issue 21, item 5). This keeps the two
    from drifting."""
    from bam_surgery.converters.hf_bam.configuration_bam import BamConfig

    ours = ModelConfig(**{**BASE, **changes})
    theirs = BamConfig(**{**BASE, **changes})
    for rule in ("n_kv_heads", "head_dim", "rotary_dim", "ffn_router_kind", "attn_router_kind"):
        assert getattr(theirs, rule) == getattr(ours, rule), rule
