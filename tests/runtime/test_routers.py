"""Router kinds (runtime/routers.py) through config, recipe, merge, count-params and the HF BAM export, and the
warm starts of expert embeddings (surgery/warm_start.py). The kinds' math against the float64 reference and
fused == reference live in test_model.py / test_fused.py (ROUTER_KIND_MIXTURES); the HF BAM variants per kind
in test_hf_bam_export.py."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from conftest import error_line, max_diff, random_state, tiny_config
from bam_surgery.converters.hf_bam import export_hf_bam
from bam_surgery.converters.hf_bam.configuration_bam import SUPPORTED
from bam_surgery.runtime import config as config_module
from bam_surgery.runtime import load_model
from bam_surgery.runtime.checkpoint import CheckpointReader, save_checkpoint
from bam_surgery.runtime.config import ROUTERS, ConfigError, ModelConfig
from bam_surgery.runtime.layout import buffer_names, tensor_shapes
from bam_surgery.runtime.model import Model
from bam_surgery.runtime.routers import ROUTER_KINDS, LinearRouter, RouterTensor
from bam_surgery.surgery.audit import audit
from bam_surgery.cli.commands import cli
from bam_surgery.surgery.errors import RecipeError
from bam_surgery.surgery.recipe import load_recipe, mixture_config, parse_recipe

KINDS = list(ROUTER_KINDS)


def run(*args: str):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


# ---- the registry and the config -----------------------------------------------------------
def test_registry_config_and_remote_code_list_the_same_kinds():
    assert set(ROUTERS) == set(ROUTER_KINDS)
    assert set(SUPPORTED["router"]) == set(ROUTERS)
    attention_kinds = {k for k in ROUTERS if ROUTER_KINDS[k].routes_attention}
    assert set(SUPPORTED["attn_router"]) == {None, *attention_kinds} and "key_store" not in attention_kinds


def test_old_config_with_router_linear_loads_and_linear_configs_keep_their_bytes():
    old = {**tiny_config().to_dict(), "router": "linear"}
    for new_field in ("attn_router", "router_hidden", "router_temperature"):
        assert new_field not in old  # written only when set
    cfg = ModelConfig.from_dict(old)
    assert (cfg.ffn_router_kind, cfg.attn_router_kind) == ("linear", "linear")
    assert ModelConfig.from_json(cfg.to_json()) == cfg
    mixed = tiny_config(ffn_experts=2, attn_experts=2, router="mlp", attn_router="expert_embedding",
                        router_hidden=8, router_temperature=0.25)
    assert json.loads(mixed.to_json())["attn_router"] == "expert_embedding"
    assert ModelConfig.from_json(mixed.to_json()) == mixed
    assert (mixed.ffn_router_kind, mixed.attn_router_kind) == ("mlp", "expert_embedding")


@pytest.mark.parametrize("kind", KINDS)
def test_router_tensors_give_names_shapes_and_fresh_init(kind):
    attn_kind = kind if ROUTER_KINDS[kind].routes_attention else "linear"  # key_store: FFN routers only
    cfg = tiny_config(ffn_experts=3, attn_experts=2, router=kind, router_temperature=0.3,
                      attn_router=None if attn_kind == kind else attn_kind)
    model = Model(cfg)
    sd = model.state_dict()
    for group, E, group_kind in (("ffn", 3, kind), ("attn", 2, attn_kind)):
        specs = ROUTER_KINDS[group_kind].tensors(cfg, E)
        names = [f"layers.1.{group}_router.{t.name}" for t in specs]
        assert [n for n in sd if n.startswith(f"layers.1.{group}_router.")] == names
        for t, n in zip(specs, names):
            assert tuple(sd[n].shape) == t.shape == tensor_shapes(cfg)[n]
            if t.init == "log_temperature":
                assert torch.allclose(sd[n], torch.full(t.shape, math.log(0.3)))
            if t.init == "zeros":
                assert not sd[n].any()
    x = torch.randn(5, cfg.d_model)
    assert model.layers[0].ffn_router(x).shape == (5, 3)


def test_router_hidden_sets_the_mlp_and_attention_widths():
    mlp = tiny_config(ffn_experts=2, router="mlp")
    assert tensor_shapes(mlp)["layers.0.ffn_router.hidden.weight"] == (2 * mlp.d_model, mlp.d_model)
    att = tiny_config(ffn_experts=2, router="attention")
    assert tensor_shapes(att)["layers.0.ffn_router.query.weight"] == (att.head_dim, att.d_model)
    att16 = att.replace(router_hidden=16)
    assert tensor_shapes(att16)["layers.0.ffn_router.key.weight"] == (16, att.d_model)


def test_expert_embedding_router_is_cosine_over_temperature():
    cfg = tiny_config(ffn_experts=3, router="expert_embedding", router_temperature=0.5)
    router = Model(cfg).layers[0].ffn_router
    x = torch.randn(4, cfg.d_model)
    with torch.no_grad():
        router.embeddings.weight.copy_(torch.stack([x[0] * 3.0, -x[1], x[2] + x[3]]))
        logits = router(x)
    assert logits[0, 0].item() == pytest.approx(1 / 0.5, abs=1e-5)  # cos = 1, scale-free
    assert logits[1, 1].item() == pytest.approx(-1 / 0.5, abs=1e-5)  # cos(x, -x) = -1
    assert logits.abs().max().item() <= 2.0 + 1e-5


class _BufferRouter(LinearRouter):
    """A test-only kind with a buffer (as a key store holds its keys)."""

    kind = "linear_with_keys"

    def __init__(self, cfg, n_experts):
        super().__init__(cfg, n_experts)
        self.register_buffer("keys", torch.zeros(n_experts, cfg.d_model))
        self.steps = 0

    @classmethod
    def tensors(cls, cfg, n_experts):
        return [*super().tensors(cfg, n_experts), RouterTensor("keys", (n_experts, cfg.d_model), "zeros", True)]

    def after_step(self):
        self.steps += 1


def test_buffers_are_counted_apart_and_after_step_reaches_every_router(monkeypatch):
    monkeypatch.setitem(ROUTER_KINDS, _BufferRouter.kind, _BufferRouter)
    monkeypatch.setattr(config_module, "ROUTERS", (*ROUTERS, _BufferRouter.kind))
    cfg = tiny_config(ffn_experts=4, router=_BufferRouter.kind)
    assert buffer_names(cfg) == {f"layers.{i}.ffn_router.keys" for i in range(cfg.n_layers)}
    a, linear = audit(cfg), audit(cfg.replace(router="linear"))
    assert (a.total, a.active) == (linear.total, linear.active)  # buffers are not parameters
    assert (a.buffers.tensors, a.buffers.total) == (cfg.n_layers, cfg.n_layers * 4 * cfg.d_model)
    assert a.to_dict()["buffers"] == {"tensors": 2, "total": 2 * 4 * cfg.d_model}
    model = Model(cfg)
    assert set(model.state_dict()) == set(tensor_shapes(cfg))
    model.after_step()
    assert [r.steps for r in model.routers().values()] == [1] * cfg.n_layers


# ---- recipes ----------------------------------------------------------------------------------
RECIPE = """
schema: 1
name: moe-mlp
description: FFN experts with MLP routers.
routers: {init: normal, std: 0.02, kind: mlp, attn_kind: expert_embedding, hidden: 8, temperature: 0.2}
tensors: {embed: mean, pos_embed: mean, attn_norm: mean, ffn_norm: mean, attn.q: stack, attn.k: stack,
          attn.v: stack, attn.o: stack, ffn.gate: stack, ffn.up: stack, ffn.down: stack, final_norm: mean,
          lm_head: mean}
"""


def test_recipe_selects_router_kinds_and_the_cli_overrides_them():
    recipe = parse_recipe(RECIPE)
    cfg = mixture_config(recipe, tiny_config(), 2)
    assert (cfg.ffn_router_kind, cfg.attn_router_kind, cfg.router_hidden, cfg.router_temperature) == (
        "mlp", "expert_embedding", 8, 0.2)
    cfg = mixture_config(recipe, tiny_config(), 2, router="linear", router_hidden=None)
    assert (cfg.ffn_router_kind, cfg.attn_router_kind) == ("linear", "linear")
    btx = mixture_config(load_recipe("btx"), tiny_config(), 2, router="attention")  # --router: every router
    assert (btx.router, btx.attn_router) == ("attention", None)
    with pytest.raises(ConfigError, match="attn_router: recipe btx has no attention experts"):
        mixture_config(load_recipe("btx"), tiny_config(), 2, attn_router="mlp")
    with pytest.raises(ConfigError, match="router_hidden: applies to mlp and attention"):
        mixture_config(load_recipe("bam"), tiny_config(), 2, router_hidden=8)


@pytest.mark.parametrize("change, field", [("kind: cosine", "routers.kind"), ("ffn_kind: 3", "routers.ffn_kind"),
                                           ("hidden: 0", "routers.hidden"), ("temperature: -1", "routers.temperature")])
def test_recipe_router_fields_are_validated(change, field):
    text = RECIPE.replace("kind: mlp, attn_kind: expert_embedding, hidden: 8, temperature: 0.2", change)
    with pytest.raises(RecipeError, match=field.replace(".", r"\.")):
        parse_recipe(text)


# ---- merge -> canonical -> runtime -> HF BAM export, per kind --------------------------------
def write_family(root: Path, n: int = 3, **overrides) -> list[str]:
    """A seed and n-1 branches (seed + noise on attention and FFN), canonical files; returns NAME=PATH specs."""
    cfg = tiny_config(vocab_size=256, max_positions=64, **overrides)
    seed = random_state(cfg, 3)
    gen = torch.Generator().manual_seed(9)
    names = ["general", "code", "law"][:n]
    specs = []
    for i, name in enumerate(names):
        state = {k: v + (0.3 * torch.randn(v.shape, generator=gen) * v.std() if i and (".attn." in k or ".ffn." in k)
                         else 0) for k, v in seed.items()}
        save_checkpoint(state, cfg, root / f"{name}.safetensors")
        specs.append(f"{name}={root / f'{name}.safetensors'}")
    return specs


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    root = tmp_path_factory.mktemp("family")
    return root, write_family(root)


@pytest.mark.parametrize("kind", KINDS)
def test_merge_canonical_runtime_and_hf_export_agree(family, kind, tmp_path, hf_modules):
    from transformers import AutoModelForCausalLM

    root, (seed, *experts) = family
    out = tmp_path / "mix.safetensors"
    attn_kind = kind if ROUTER_KINDS[kind].routes_attention else "linear"  # key_store: FFN routers only
    res = run("merge", "--seed", seed, "--experts", ",".join(experts), "--router", kind, "--attn-router", attn_kind,
              "--attention-routing", "top2", "--ffn-top-k", "2", "--dtype", "float32", "--out", str(out), "--quiet")
    assert res.exit_code == 0, res.output
    model = load_model(out)
    assert (model.config.ffn_router_kind, model.config.attn_router_kind) == (kind, attn_kind)
    with CheckpointReader(out) as reader:
        provenance = json.loads(reader.metadata["bam_provenance"]) if "bam_provenance" in reader.metadata else None
        hf_dir = export_hf_bam(reader, tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, trust_remote_code=True, dtype=torch.float32).eval()
    tokens = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(tokens).logits, hf(tokens).logits
    assert max_diff(ours, theirs) <= 1e-4
    assert provenance is None or "router_warm_start" not in json.dumps(provenance)


def test_count_params_shows_each_kind(family, tmp_path):
    root, (seed, *experts) = family
    counts = {}
    for kind in KINDS:
        attn_kind = kind if ROUTER_KINDS[kind].routes_attention else "linear"
        res = run("merge", "--seed", seed, "--experts", ",".join(experts), "--router", kind, "--attn-router", attn_kind,
                  "--dry-run")
        assert res.exit_code == 0, res.output
        routers_row = [line for line in res.output.splitlines() if line.startswith("routers ")]
        counts[kind] = int(routers_row[-1].split()[2].replace(",", ""))
    D, E, L, Dh = 32, 3, 2, 8
    assert counts == {"linear": 2 * L * E * D, "mlp": 2 * L * (2 * D * D + 2 * D + E * 2 * D),
                      "attention": 2 * L * (2 * Dh * D + E * D), "expert_embedding": 2 * L * (E * D + 1),
                      # key store: query network D -> 2D -> D (FFN routers; keys and usage are buffers, not
                      # counted here), linear attention routers
                      "key_store": L * (2 * D * D + 2 * D + D * 2 * D + D) + L * E * D}


# ---- bad input ---------------------------------------------------------------------------------
def test_bad_router_input_is_one_line_exit_2(family, tmp_path):
    root, (seed, *experts) = family
    base = ("merge", "--seed", seed, "--experts", ",".join(experts), "--out", str(tmp_path / "m.safetensors"))
    error_line(run(*base, "--router", "cosine"), "--router", "cosine")
    error_line(run(*base, "--router", "expert_embedding", "--router-init", "domain-mean"),
                          "--router-init domain-mean", "--calibration")
    error_line(run(*base, "--router-init", "profile", "--calibration", f"code={root}"),
                          "expert_embedding")  # warm starts set expert embeddings: linear routers have none
    error_line(run(*base, "--calibration", f"code={root}"), "--calibration")
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    error_line(run(*base, "--router", "expert_embedding", "--router-init", "domain-mean",
                              "--calibration", f"general={empty},code={empty},law={empty}",
                              "--token-cache", str(tmp_path / "cache")), "no text")
    text = tmp_path / "code.txt"
    text.write_text("def f(x): return x\n" * 20)
    error_line(run(*base, "--router", "expert_embedding", "--router-init", "domain-mean",
                              "--calibration", f"general={text},code={text}", "--token-cache",
                              str(tmp_path / "cache")), "no domain named 'law'")
    assert not (tmp_path / "m.safetensors").exists()


# ---- warm starts ---------------------------------------------------------------------------------
SEPARABLE = {"general": "mn", "code": "ab", "law": "yz"}  # each domain's text uses its own two bytes


def separable_corpus(root: Path) -> str:
    specs = []
    for name, letters in SEPARABLE.items():
        path = root / f"{name}.txt"
        path.write_text(letters * 300)
        specs.append(f"{name}={path}")
    return ",".join(specs)


def profile_family(root: Path) -> list[str]:
    """Dense models that differ only in an output bias favouring their own domain's bytes: on each domain's
    text, that domain's model has the lowest loss at every position."""
    cfg = tiny_config(vocab_size=256, max_positions=64, lm_head_bias=True)
    seed = random_state(cfg, 5)
    specs = []
    for name, letters in SEPARABLE.items():
        state = dict(seed, **{"lm_head.bias": torch.zeros(256)})
        state["lm_head.bias"][[ord(c) for c in letters]] = 8.0
        save_checkpoint(state, cfg, root / f"{name}.safetensors")
        specs.append(f"{name}={root / f'{name}.safetensors'}")
    return specs


def routed_experts(model, text: str) -> dict[str, set[int]]:
    """Router name -> the top-1 experts the router picks over the tokens of `text`."""
    tokens = torch.tensor([[ord(c) for c in text]])
    with torch.no_grad():
        return {n: set(r.probs.argmax(-1).tolist()) for n, r in model(tokens).routing.items()}


@pytest.mark.parametrize("init", ["domain-mean", "profile"])
def test_warm_start_routes_each_domain_to_its_own_expert_and_is_deterministic(tmp_path, init):
    corpus = separable_corpus(tmp_path)
    seed, *experts = profile_family(tmp_path)
    outs = []
    for i in range(2):
        out = tmp_path / f"mix{i}.safetensors"
        res = run("merge", "--seed", seed, "--experts", ",".join(experts), "--router", "expert_embedding",
                  "--router-init", init, "--calibration", corpus, "--calibration-tokens", "300",
                  "--token-cache", str(tmp_path / "cache"), "--out", str(out))
        assert res.exit_code == 0, res.output
        assert "calibration: 900 tokens (general 300, code 300, law 300)" in res.output
        outs.append(out)
    assert outs[0].read_bytes() == outs[1].read_bytes()
    model = load_model(outs[0])
    for e, letters in enumerate(SEPARABLE.values()):  # expert order: seed (general), code, law
        routed = routed_experts(model, letters * 20)
        assert routed and all(experts == {e} for experts in routed.values()), (letters, routed)
    with CheckpointReader(outs[0]) as reader:
        assert f'"init": "{init}"' in json.dumps(json.loads(reader.metadata["bam_provenance"]))


def test_random_expert_embeddings_do_not_separate_the_domains(tmp_path):
    """Control for the test above: without a warm start the same merge does not route by domain."""
    seed, *experts = profile_family(tmp_path)
    out = tmp_path / "mix.safetensors"
    res = run("merge", "--seed", seed, "--experts", ",".join(experts), "--router", "expert_embedding",
              "--out", str(out), "--quiet")
    assert res.exit_code == 0, res.output
    model = load_model(out)
    by_domain = [routed_experts(model, letters * 20) for letters in SEPARABLE.values()]
    assert not all(all(experts == {e} for experts in routed.values()) for e, routed in enumerate(by_domain))


def test_count_params_of_a_recipe_mixture_with_another_router_kind():
    res = run("count-params", "--preset", "paper-small", "--recipe", "bam", "--experts", "4", "--router", "mlp",
              "--json")
    assert res.exit_code == 0, res.output
    body = json.loads(res.output)
    D, E, L = 1024, 4, 6
    per_router = 2 * D * D + 2 * D + E * 2 * D  # hidden.weight, hidden.bias, out.weight
    assert body["groups"]["routers"] == {"tensors": 2 * L * 3, "total": 2 * L * per_router,
                                         "active": 2 * L * per_router}
    assert body["buffers"] == {"tensors": 0, "total": 0}
    error_line(run("count-params", "--preset", "paper-small", "--router", "mlp"), "--router")


# ---- calibration reads what it uses (issue 20, item 6) ------------------------------------------------
def test_calibration_reads_no_further_than_the_tokens_it_needs(tmp_path):
    """Each domain's file holds its text, then more documents, then bytes that are not UTF-8 (standing for
    the rest of a huge or hostile file): the warm start reads only as far as its first --calibration-tokens
    tokens, so the bad bytes are never reached; the token cache is not written (it holds whole splits)."""
    import gzip

    from bam_surgery.train.data import DOC_SEPARATOR

    specs = []
    for name, letters in SEPARABLE.items():
        path = tmp_path / f"{name}.txt.gz"
        with gzip.open(path, "wb") as f:  # past the first 4 MiB read: 6 MB of other documents, then the bad bytes
            f.write((letters * 300 + DOC_SEPARATOR + ("x" * 1000 + DOC_SEPARATOR) * 6000).encode() + b"\xff" * 1000)
        specs.append(f"{name}={path}")
    seed, *experts = profile_family(tmp_path)
    res = run("merge", "--seed", seed, "--experts", ",".join(experts), "--router", "expert_embedding",
              "--router-init", "domain-mean", "--calibration", ",".join(specs), "--calibration-tokens", "300",
              "--token-cache", str(tmp_path / "cache"), "--out", str(tmp_path / "mix.safetensors"))
    assert res.exit_code == 0, res.output
    assert "calibration: 900 tokens (general 300, code 300, law 300)" in res.output
    assert not any((tmp_path / "cache").glob("*.bin"))


def test_a_calibration_decompression_bomb_is_one_line(tmp_path):
    import gzip

    from bam_surgery.train.data import MAX_DOCUMENT_CHARS

    bomb = tmp_path / "bomb.txt.gz"
    with gzip.open(bomb, "wb", compresslevel=1) as f:
        for _ in range(20):
            f.write(b"ab" * (1 << 19))
    seed, *experts = profile_family(tmp_path)
    res = run("merge", "--seed", seed, "--experts", ",".join(experts), "--router", "expert_embedding",
              "--router-init", "domain-mean", "--calibration", f"general={bomb},code={bomb},law={bomb}",
              "--token-cache", str(tmp_path / "cache"), "--out", str(tmp_path / "mix.safetensors"))
    error_line(res, str(bomb), f"more than {MAX_DOCUMENT_CHARS:,} characters")
