"""One options object from the command line to the plan (issue 21, item 4): `merge`'s click parameters are
exactly MergeArgs' fields, MergeArgs.plan_options fills every MergeOptions field, and MergeOptions.mixture
every MixtureOptions field; each table of allowed values comes from its Literal alias."""
from __future__ import annotations

import dataclasses
from typing import get_args

from bam_surgery.cli.commands import ROUTER_INITS, MergeArgs, merge
from bam_surgery.runtime import blocks, layout
from bam_surgery.surgery import plan, recipe
from bam_surgery.train import config as train_config


def _fields(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def test_merge_gets_its_options_as_one_dataclass():
    assert {p.name for p in merge.params} - {"help"} == _fields(MergeArgs)


def _args(*argv: str) -> MergeArgs:
    """MergeArgs as click parses `merge --seed seed.safetensors --out mix ARGV...`."""
    return MergeArgs(**merge.make_context("merge", ["--seed", "seed.safetensors", "--out", "mix", *argv]).params)


def test_plan_options_come_from_the_options_of_the_same_names():
    args = _args("--weights", "1,2", "--router-init", "profile", "--router", "mlp", "--gate-norm", "topk_softmax",
                 "--ffn-top-k", "2", "--attention-routing", "top2", "--router-seed", "7", "--allow-nonfinite")
    options = args.plan_options()
    assert options.weights == (1.0, 2.0) and options.warm_start == "profile"
    for name in _fields(plan.MergeOptions) - {"weights", "warm_start"}:
        assert getattr(options, name) == getattr(args, name), name
    assert _args().plan_options() == plan.MergeOptions(router_seed=0)  # defaults: the recipe's


def test_the_mixture_options_are_the_merge_options_that_shape_the_config():
    options = plan.MergeOptions(ffn_top_k=2, attention_routing="top2", extra_ffn_experts=1, gate_norm="softmax",
                                lb_coef=0.1, z_coef=0.2, router="mlp", ffn_router="linear", attn_router="attention",
                                router_hidden=8, router_temperature=0.5)
    mixture = options.mixture()
    assert all(getattr(mixture, name) is not None for name in _fields(recipe.MixtureOptions))
    assert mixture.attn_top_k == "top2"


def test_every_table_of_values_is_its_literal_alias():
    assert blocks.IMPLS == get_args(blocks.Impl) and blocks.EXPERT_KERNELS == get_args(blocks.ExpertKernel)
    assert set(get_args(blocks.FFNKernel)) == {*blocks.EXPERT_KERNELS, "dense"}
    assert layout.MISMATCH_KINDS == get_args(layout.MismatchKind)
    assert recipe.OPS == get_args(recipe.Op) and recipe.SHARED_KV_RULES == get_args(recipe.SharedKVRule)
    assert recipe.WARM_STARTS == get_args(recipe.WarmStart) and ROUTER_INITS == ("random", *recipe.WARM_STARTS)
    from bam_surgery.surgery.kernels import OP_TABLE
    assert set(plan.PLAN_OPS) == {*OP_TABLE, "calibrated"}
    assert train_config.CHOICES == {"schedule": get_args(train_config.Schedule),
                                    "precision": get_args(train_config.Precision),
                                    "device": get_args(train_config.Device),
                                    "strategy": get_args(train_config.Strategy)}
