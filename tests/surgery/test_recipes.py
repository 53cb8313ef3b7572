"""Recipes: the shipped files, the schema's error messages, mixture_config, and the README's worked example."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner

from conftest import is_norm_or_embedding, max_diff, random_state, tiny_config, tokens_for
from bam_surgery.runtime import ForcedRouting, load_model
from bam_surgery.runtime.checkpoint import save_checkpoint
from bam_surgery.runtime.config import ConfigError, preset
from bam_surgery.cli.commands import cli
from bam_surgery.surgery.errors import RecipeError
from bam_surgery.surgery.recipe import KINDS, available_recipes, load_recipe, mixture_config, parse_recipe, validate_recipe

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "recipes" / "README.md").read_text()


def readme_example() -> str:
    return re.search(r"```yaml\n(.*?)```", README, re.S).group(1)


@pytest.mark.parametrize("name", ["bam", "bam-shared-kv", "btx", "upcycle"])
def test_shipped_recipes_load_and_start_with_their_command(name):
    assert name in available_recipes()
    recipe = load_recipe(name)
    assert recipe.name == name
    first = recipe.text.splitlines()[0]
    assert first.startswith(f"# bam-surgery merge --recipe {name} ")
    assert load_recipe(ROOT / "recipes" / f"{name}.yaml") == recipe.__class__(**{
        **recipe.__dict__, "path": str(ROOT / "recipes" / f"{name}.yaml")})


def test_shipped_recipes_build_what_the_paper_describes():
    dense = preset("paper-small")
    bam = mixture_config(load_recipe("bam"), dense, 4)
    assert (bam.ffn_experts, bam.attn_experts, bam.kv_mode, bam.attn_top_k) == (4, 4, "expert", None)
    # the FFN gates: the shipped defaults keep a merged model's function (two experts, gates summing to 1);
    # the paper's (top-1, p_i of the full softmax) are the options ffn_top_k=1, gate_norm=softmax
    assert (bam.ffn_top_k, bam.gate_norm) == (2, "topk_softmax")
    paper = mixture_config(load_recipe("bam"), dense, 4, ffn_top_k=1, gate_norm="softmax")
    assert (paper.ffn_top_k, paper.gate_norm) == (1, "softmax")
    shared = mixture_config(load_recipe("bam-shared-kv"), dense, 4)
    assert (shared.attn_experts, shared.kv_mode) == (4, "shared")
    btx = mixture_config(load_recipe("btx"), dense, 4, extra_ffn_experts=2, ffn_top_k=3)  # Table 7
    assert (btx.ffn_experts, btx.attn_experts, btx.ffn_top_k) == (6, 0, 3)
    up = mixture_config(load_recipe("upcycle"), dense, 1)
    assert (up.ffn_experts, up.attn_experts) == (4, 0)
    routed = mixture_config(load_recipe("bam"), dense, 4, attention_routing="top2", gate_norm="topk_softmax",
                            lb_coef=0.1, z_coef=0.0)
    assert (routed.attn_top_k, routed.gate_norm, routed.lb_coef, routed.z_coef) == (2, "topk_softmax", 0.1, 0.0)
    assert mixture_config(load_recipe("bam"), dense, 4, attention_routing="soft").attn_top_k is None


@pytest.mark.parametrize("recipe,n,options,field", [
    ("btx", 4, dict(attention_routing=2), "attn_top_k"),
    ("bam", 4, dict(ffn_top_k=5), "ffn_top_k"),
    ("bam", 4, dict(attention_routing="top5"), "attn_top_k"),
    ("bam", 1, {}, "ffn_experts"),
    ("upcycle", 1, dict(extra_ffn_experts=0), "ffn_experts"),
    ("bam", 4, dict(gate_norm="sparsemax"), "gate_norm"),
])
def test_mixture_config_errors_name_the_option(recipe, n, options, field):
    with pytest.raises(ConfigError, match=field):
        mixture_config(load_recipe(recipe), preset("tiny"), n, **options)


def _doc(**changes):
    doc = yaml.safe_load((ROOT / "recipes" / "bam.yaml").read_text())
    for key, value in changes.items():
        section, _, field = key.partition("__")
        if field:
            if value is None:
                doc[section].pop(field.replace("_dot_", "."))
            else:
                doc[section][field.replace("_dot_", ".")] = value
        elif value is None:
            doc.pop(section)
        else:
            doc[section] = value
    return doc


@pytest.mark.parametrize("changes,field,hint", [
    (dict(routing="soft"), "routing", "unknown field"),
    (dict(name=None), "name", "required"),
    (dict(description=""), "description", "required"),
    (dict(schema=2), "schema", "not supported"),
    (dict(tensors=None), "tensors", "required"),
    (dict(tensors__lm_head=None), "tensors.lm_head", "missing"),
    (dict(tensors__attn_dot_x="mean"), "tensors.attn.x", "unknown tensor kind"),
    (dict(tensors__embed="average"), "tensors.embed", "unknown op 'average'"),
    (dict(tensors__embed="stack"), "tensors.embed", "only attention and FFN"),
    (dict(tensors__attn_dot_o="mean"), "tensors.attn.o", "stack attn.q and attn.o together"),
    (dict(tensors__attn_dot_v="mean"), "tensors.attn.v", "stack attn.k and attn.v together"),
    (dict(tensors__ffn_dot_down="mean"), "tensors.ffn.down", "all of ffn.gate, ffn.up, ffn.down"),
    (dict(tensors__attn_dot_q="mean", tensors__attn_dot_o="mean"), "tensors.attn.k",
     "key/value experts exist only inside attention experts"),
    (dict(experts__min=-1), "experts.min", ">= 0"),
    (dict(experts__max=0), "experts.max", ">= experts.min"),
    (dict(experts__most=3), "experts.most", "unknown field"),
    (dict(defaults__ffn_top_k=0), "defaults.ffn_top_k", ">= 1"),
    (dict(defaults__gate_norm="sparsemax"), "defaults.gate_norm", "choose one of"),
    (dict(defaults__attention_routing="sometimes"), "defaults.attention_routing", "soft"),
    (dict(defaults__seed_expert="yes"), "defaults.seed_expert", "true or false"),
    (dict(defaults__alpha=0.1), "defaults.alpha", "unknown field"),
    (dict(routers__init="xavier"), "routers.init", "normal, zeros"),
    (dict(routers__std=-1), "routers.std", ">= 0"),
])
def test_recipe_errors_name_the_field_and_say_what_to_change(changes, field, hint):
    with pytest.raises(RecipeError) as err:
        validate_recipe(_doc(**changes), "my.yaml")
    msg = str(err.value)
    assert msg.startswith(f"recipe my.yaml: {field}: ") and hint in msg, msg
    assert "\n" not in msg


def test_recipe_level_consistency_checks():
    doc = _doc(tensors={**{k: "mean" for k in KINDS}})
    doc["defaults"]["extra_ffn_experts"] = 2
    with pytest.raises(RecipeError, match="defaults.extra_ffn_experts: needs FFN experts"):
        validate_recipe(doc, "x.yaml")
    doc["defaults"]["extra_ffn_experts"] = 0
    doc["defaults"]["attention_routing"] = "top2"
    with pytest.raises(RecipeError, match="defaults.attention_routing: the recipe has no attention experts"):
        validate_recipe(doc, "x.yaml")


def test_bad_yaml_and_unknown_names(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(RecipeError, match=f"recipe {bad}: not valid YAML"):
        load_recipe(bad)
    with pytest.raises(RecipeError, match="no such recipe; choose one of bam, bam-shared-kv, btx, btx-shared-expert, upcycle"):
        load_recipe("bamm")
    with pytest.raises(RecipeError, match="file not found"):
        load_recipe(tmp_path / "absent.yaml")
    # an invalid recipe stops the CLI before any input is opened (the seed here does not exist)
    result = CliRunner().invoke(cli, ["merge", "--recipe", str(bad), "--seed", "/nonexistent/seed.safetensors",
                                      "--out", str(tmp_path / "x.safetensors")])
    assert result.exit_code == 2 and "not valid YAML" in result.stderr and "nonexistent" not in result.stderr


def test_readme_worked_example_runs_end_to_end(tmp_path):
    text = readme_example()
    recipe = parse_recipe(text, "moa-only.yaml")
    assert text.splitlines()[0].startswith("# bam-surgery merge --recipe moa-only.yaml")
    cfg = tiny_config(block="parallel", norm="layernorm")
    seed = random_state(cfg, 0)
    gen = torch.Generator().manual_seed(1)
    paths = []
    for i in range(3):  # branches that differ in attention only (the FFN is what this recipe averages)
        state = {k: v if (i == 0 or is_norm_or_embedding(k) or ".ffn." in k)
                 else v + 0.1 * v.std() * torch.randn(v.shape, generator=gen) for k, v in seed.items()}
        paths.append(tmp_path / f"m{i}.safetensors")
        save_checkpoint(state, cfg, paths[-1])
    (tmp_path / "moa-only.yaml").write_text(text)
    out = tmp_path / "moa.safetensors"
    result = CliRunner().invoke(cli, ["merge", "--quiet", "--recipe", str(tmp_path / "moa-only.yaml"),
                                      "--seed", str(paths[0]), "--experts", f"{paths[1]},{paths[2]}",
                                      "--out", str(out)])
    assert result.exit_code == 0, result.output
    mix = load_model(out)
    assert (mix.config.ffn_experts, mix.config.attn_experts, mix.config.attn_top_k) == (0, 3, None)
    assert recipe.summary() == "FFN mean, attention experts (kv expert)"
    tokens = tokens_for(cfg)
    for i, p in enumerate(paths):
        with torch.no_grad():
            assert max_diff(mix(tokens, routing=ForcedRouting(expert=i)).logits, load_model(p)(tokens).logits) <= 1e-4

    # the error the README quotes, word for word
    broken = text.replace("attn.q: stack", "attn.q: mean").replace("attn.o: stack", "attn.o: mean")
    with pytest.raises(RecipeError) as err:
        parse_recipe(broken, "moa-only.yaml")
    assert f"bam-surgery: error: {err.value}" in README
