"""Drop-Upcycling (--drop-ratio: Nakamura et al., ICLR 2025) and fine-grained upcycling (--ffn-granularity: He et
al. 2024), on the merge plan: r = 0 is today's merge bit for bit, r = 1 re-initializes every intermediate dimension,
each expert its own subset, the new values with the statistics of what they replace, seeded and recorded; a fresh
fine-grained mixture computes its coarse mixture (the dense seed for upcycle, within 1e-5 in fp32), for upcycle and
for a BTX of specialists, forced to a virtual group it is that specialist, and count-params counts the finer
experts."""
from __future__ import annotations

import json
import math

import pytest
import torch

from conftest import (MERGE_CONFIGS, branched_family, cli_error_line, max_diff, run_cli, save_family, tiny_config,
                      tokens_for)
from bam_surgery.runtime import model_from_reader
from bam_surgery.runtime.blocks import ForcedRouting
from bam_surgery.runtime.checkpoint import CheckpointReader, PROVENANCE_KEY
from bam_surgery.surgery.audit import audit
from bam_surgery.surgery.kernels import drop_subset
from bam_surgery.surgery.options import MergeOptions
from bam_surgery.surgery.plan import compile_plan
from bam_surgery.surgery.plan_reader import PlanReader
from bam_surgery.surgery.provenance import output_metadata
from bam_surgery.surgery.recipe import load_recipe

TOL = 1e-5
FFN = ("gate", "up", "down")


def _plan(paths, recipe="upcycle", **options):
    readers = [CheckpointReader(p) for p in paths]
    return compile_plan(load_recipe(recipe), readers, MergeOptions(**options))


def _state(plan) -> dict[str, torch.Tensor]:
    reader = PlanReader(plan, hash_inputs=False)
    return {name: reader.get(name) for name in reader.names()}


def _model(plan):
    return model_from_reader(PlanReader(plan, hash_inputs=False))


def _logits(model, x, routing=None):
    with torch.no_grad():
        return model(x, routing=routing).logits


@pytest.fixture(scope="module")
def seed_file(tmp_path_factory):
    """One dense seed, FFN width 256 (enough values for the statistics)."""
    cfg = tiny_config(ffn_hidden=256, block="sequential", norm="rmsnorm", n_kv_heads=2)
    return save_family(tmp_path_factory.mktemp("seed"), cfg, branched_family(cfg, 1))[0]


# ---- Drop-Upcycling ------------------------------------------------------------------------------------
def test_drop_ratio_zero_is_todays_merge_bit_for_bit(seed_file):
    today, zero = _plan([seed_file]), _plan([seed_file], drop_ratio=0.0, drop_seed=5)
    a, b = _state(today), _state(zero)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
    assert output_metadata(today, None) == output_metadata(zero, None)  # the provenance too: nothing new recorded


def _slot(state, layer: int, name: str, e: int) -> torch.Tensor:
    return state[f"layers.{layer}.ffn_experts.{name}.weight"][e]


def _changed_dims(seed_state, state, layer, e) -> dict[str, set[int]]:
    """Per FFN tensor of expert e: the intermediate dimensions that differ from the seed's."""
    out = {}
    for name in FFN:
        dense, expert = seed_state[f"layers.{layer}.ffn.{name}.weight"], _slot(state, layer, name, e)
        axis = 1 if name == "down" else 0
        same = (dense == expert).all(dim=1 - axis)
        out[name] = set(torch.nonzero(~same).flatten().tolist())
    return out


def test_drop_ratio_one_reinitializes_every_dimension_of_every_expert(seed_file):
    plan = _plan([seed_file], drop_ratio=1.0)
    state, seed = _state(plan), CheckpointReader(seed_file)
    seed_state = {n: seed.get(n) for n in seed.names()}
    F = plan.config.ffn_hidden
    for layer in range(plan.config.n_layers):
        for e in range(plan.config.ffn_experts):
            assert all(dims == set(range(F)) for dims in _changed_dims(seed_state, state, layer, e).values())


def test_half_the_dimensions_each_expert_its_own_subset_shared_by_gate_up_and_down(seed_file):
    plan = _plan([seed_file], drop_ratio=0.5, drop_seed=3)
    state, seed = _state(plan), CheckpointReader(seed_file)
    seed_state = {n: seed.get(n) for n in seed.names()}
    F = plan.config.ffn_hidden
    for layer in range(plan.config.n_layers):
        subsets = []
        for e in range(plan.config.ffn_experts):
            dims = _changed_dims(seed_state, state, layer, e)
            assert dims["gate"] == dims["up"] == dims["down"] and len(dims["up"]) == F // 2
            subsets.append(frozenset(dims["up"]))
        assert len(set(subsets)) == plan.config.ffn_experts  # a different subset per expert
    # the subsets of the two layers differ too, and the record says how they were made
    prov = json.loads(output_metadata(plan, None)[PROVENANCE_KEY])
    assert prov["options"]["drop_ratio"] == 0.5 and prov["options"]["drop_seed"] == 3
    assert prov["tensors"]["layers.0.ffn_experts.down.weight"]["drop"] == {"ratio": 0.5, "axis": 1}


def test_reinitialized_values_have_the_replaced_values_mean_and_std(seed_file):
    plan = _plan([seed_file], drop_ratio=0.5, drop_seed=1)
    state, seed = _state(plan), CheckpointReader(seed_file)
    F = plan.config.ffn_hidden
    for name in FFN:
        dense = seed.get(f"layers.0.ffn.{name}.weight").double()
        axis = 1 if name == "down" else 0
        for e in range(plan.config.ffn_experts):
            t = plan[f"layers.0.ffn_experts.{name}.weight"]
            idx = drop_subset(F, 0.5, t.drop.subsets[e])
            new = _slot(state, 0, name, e).double().index_select(axis, idx)
            old = dense.index_select(axis, idx)
            n = new.numel()  # 2048 values: the sample mean within 4 standard errors, the std within 10%
            assert abs(new.mean() - old.mean()) < 4 * old.std() / math.sqrt(n)
            assert abs(new.std() / old.std() - 1) < 0.1
            assert not torch.equal(new, old)


def test_drop_upcycling_is_seeded(seed_file):
    a, b = _state(_plan([seed_file], drop_ratio=0.5)), _state(_plan([seed_file], drop_ratio=0.5))
    c = _state(_plan([seed_file], drop_ratio=0.5, drop_seed=1))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["layers.0.ffn_experts.up.weight"], c["layers.0.ffn_experts.up.weight"])
    assert torch.equal(a["layers.0.attn.q.weight"], c["layers.0.attn.q.weight"])  # only the FFN experts change


def test_drop_applies_to_the_ffn_experts_of_every_recipe(tmp_path):
    cfg = MERGE_CONFIGS["gpt2"]  # biases: the up bias's dimensions are re-initialized with its rows
    paths = save_family(tmp_path, cfg, branched_family(cfg, 3))
    for recipe in ("btx", "bam", "bam-shared-kv", "btx-shared-expert"):
        plan = _plan(paths, recipe, drop_ratio=1.0)
        state = _state(plan)
        spec, e = CheckpointReader(paths[1]), plan.members.index(1)  # the expert slot of input 1
        up, bias = spec.get("layers.1.ffn.up.weight"), spec.get("layers.1.ffn.up.bias")
        assert (state["layers.1.ffn_experts.up.weight"][e] != up).all(), recipe
        assert (state["layers.1.ffn_experts.up.bias"][e] != bias).all(), recipe
        assert torch.equal(state["layers.1.ffn_experts.down.bias"][e], spec.get("layers.1.ffn.down.bias"))
        if recipe == "bam":
            assert torch.equal(state["layers.1.attn_experts.q.weight"][e], spec.get("layers.1.attn.q.weight"))
        if recipe == "btx-shared-expert":  # the shared expert is the seed's FFN, not an expert: kept
            seed = CheckpointReader(paths[0])
            assert torch.equal(state["layers.0.ffn_shared.up.weight"], seed.get("layers.0.ffn.up.weight"))


# ---- fine-grained upcycling ---------------------------------------------------------------------------
@pytest.mark.parametrize("shape", sorted(MERGE_CONFIGS))
@pytest.mark.parametrize("G", [2, 4])
def test_fine_grained_upcycle_computes_the_dense_seed(tmp_path, shape, G):
    cfg = MERGE_CONFIGS[shape]  # gpt2: biases in every FFN tensor, a non-gated GELU
    seed = save_family(tmp_path, cfg, branched_family(cfg, 1))[0]
    plan = _plan([seed], ffn_granularity=G)
    mix = plan.config
    assert (mix.ffn_experts, mix.ffn_top_k, mix.ffn_hidden) == (4 * G, 2 * G, cfg.ffn_hidden // G)
    x = tokens_for(cfg)
    dense = model_from_reader(CheckpointReader(seed))
    model = _model(plan)
    assert max_diff(_logits(model, x), _logits(dense, x)) <= TOL
    # the routers really route: several virtual groups chosen, always whole groups
    topk = _logits_routing(model, x)
    groups = topk // G
    assert all(sorted((row % G).tolist()) == sorted(list(range(G)) * 2) for row in topk)
    assert groups.unique().numel() > 2


def _logits_routing(model, x) -> torch.Tensor:
    with torch.no_grad():
        out = model(x)
    return out.routing["layers.0.ffn_router"].topk


def test_fine_grained_btx_computes_the_coarse_btx_and_forced_groups_are_the_specialists(tmp_path):
    cfg = MERGE_CONFIGS["llama"]
    paths = save_family(tmp_path, cfg, branched_family(cfg, 3, share_attention=True))
    G = 3
    coarse, fine = _plan(paths, "btx"), _plan(paths, "btx", ffn_granularity=G)
    assert (fine.config.ffn_experts, fine.config.ffn_top_k) == (3 * G, 2 * G)
    x = tokens_for(cfg)
    m_coarse, m_fine = _model(coarse), _model(fine)
    assert max_diff(_logits(m_fine, x), _logits(m_coarse, x)) <= TOL
    for e in range(3):  # routing forced to virtual group e: specialist e's FFN in the averaged trunk
        gates = torch.zeros(3 * G)
        gates[e * G:(e + 1) * G] = 1 / G
        forced = _logits(m_fine, x, ForcedRouting(ffn_gates=gates))
        assert max_diff(forced, _logits(m_coarse, x, ForcedRouting(expert=e))) <= TOL
        assert max_diff(forced, _logits(model_from_reader(CheckpointReader(paths[e])), x)) <= TOL
    # specialists that are all the seed: the dense seed
    same = _plan([paths[0]] * 3, "btx", ffn_granularity=G)
    assert max_diff(_logits(_model(same), x), _logits(model_from_reader(CheckpointReader(paths[0])), x)) <= TOL


def test_softmax_then_top_k_scales_by_n_g_over_k(tmp_path):
    """He et al.'s routing: gates from the full softmax, the top G*k kept unnormalized. The down projections are
    scaled by N G / k, which makes a uniform router (each expert 1/(N G), k whole groups chosen) the dense seed."""
    cfg = MERGE_CONFIGS["parallel"]
    seed = save_family(tmp_path, cfg, branched_family(cfg, 1))[0]
    G, N, k = 2, 4, 2
    plan = _plan([seed], ffn_granularity=G, gate_norm="softmax")
    prov = json.loads(output_metadata(plan, None)[PROVENANCE_KEY])
    assert prov["options"]["ffn_scale"] == N * G / k and prov["options"]["ffn_granularity"] == G
    gates = torch.zeros(N * G)
    gates[:k * G] = 1 / (N * G)  # what a uniform router's softmax-then-top-(G k) gives
    x = tokens_for(cfg)
    dense = model_from_reader(CheckpointReader(seed))
    assert max_diff(_logits(_model(plan), x, ForcedRouting(ffn_gates=gates)), _logits(dense, x)) <= TOL


def test_count_params_counts_the_finer_experts(seed_file):
    coarse, fine = _plan([seed_file]).config, _plan([seed_file], ffn_granularity=4).config
    a, b = audit(coarse), audit(fine)
    assert b.groups["ffn_experts"].total == a.groups["ffn_experts"].total
    assert b.groups["ffn_experts"].active == a.groups["ffn_experts"].active
    assert b.groups["routers"].total == 4 * a.groups["routers"].total


def test_count_params_takes_the_granularity_as_merge_does():
    """count-params --recipe upcycle --ffn-granularity 4: the mixture merge would build, 16 experts of F/4 at top-8;
    the FFN experts' counts are the coarse mixture's (the API's count_params takes it by name too)."""
    import bam_surgery as bs

    coarse = bs.count_params(preset="tiny", recipe="upcycle", experts=4)
    fine = bs.count_params(preset="tiny", recipe="upcycle", experts=4, ffn_granularity=4)
    assert (fine.config.ffn_experts, fine.config.ffn_top_k) == (16, 4 * coarse.config.ffn_top_k)
    assert fine.config.ffn_hidden * 4 == coarse.config.ffn_hidden
    for kind in ("total", "active"):
        assert getattr(fine.audit.groups["ffn_experts"], kind) == getattr(coarse.audit.groups["ffn_experts"], kind)
    out = run_cli("count-params", "--preset", "tiny", "--recipe", "upcycle", "--experts", "4", "--ffn-granularity",
                  "4").output
    assert "16 FFN experts, top-8" in out and f"{fine.audit.total:,}" in out
    line = cli_error_line("count-params", "--preset", "tiny", "--ffn-granularity", "4")
    assert "--ffn-granularity" in line and "--recipe" in line


def test_fine_grained_and_drop_together(seed_file):
    plan = _plan([seed_file], ffn_granularity=2, drop_ratio=1.0)
    state, seed = _state(plan), CheckpointReader(seed_file)
    half = plan.config.ffn_hidden
    up = seed.get("layers.0.ffn.up.weight")
    for e in range(plan.config.ffn_experts):  # every row of every fine-grained expert drawn anew
        part = up[(e % 2) * half:(e % 2 + 1) * half]
        assert (state["layers.0.ffn_experts.up.weight"][e] != part).all(dim=1).all()


def test_bad_granularity_and_drop_are_refused_in_one_line(tmp_path, seed_file):
    out = tmp_path / "out.safetensors"
    line = cli_error_line("merge", "--recipe", "upcycle", "--seed", seed_file, "--ffn-granularity", "3", "--out", out)
    assert "ffn_granularity" in line and "256" in line and "divisible" in line
    line = cli_error_line("merge", "--recipe", "upcycle", "--seed", seed_file, "--ffn-granularity", "256",
                          "--extra-ffn-experts", "4", "--out", out)
    assert "1280" in line and "1024" in line
    recipe = tmp_path / "dense-ffn.yaml"
    text = load_recipe("bam").text.replace("ffn.gate: stack", "ffn.gate: mean").replace(
        "ffn.up: stack", "ffn.up: mean").replace("ffn.down: stack", "ffn.down: mean").replace("name: bam", "name: moa")
    recipe.write_text(text)
    expert = tmp_path / "expert.safetensors"
    expert.write_bytes(seed_file.read_bytes())
    line = cli_error_line("merge", "--recipe", recipe, "--seed", seed_file, "--experts", expert, "--drop-ratio",
                          "0.5", "--out", out)
    assert "drop_ratio" in line and "no FFN experts" in line
    assert "--drop-ratio" in cli_error_line("merge", "--seed", seed_file, "--drop-ratio", "2", "--out", out)
    assert not out.exists()
