"""One declaration of the merge options (issue 30): `merge`'s click parameters are MergeArgs' own fields plus one
flag per MergeOptions field (surgery/options.py), built from it; click hands the command one MergeOptions; the
pipeline's mixture keys and their command line come from the same fields; each table of allowed values comes
from its Literal alias."""
from __future__ import annotations

import dataclasses
from typing import get_args

from bam_surgery.cli.commands import MergeArgs, merge
from bam_surgery.cli.options import command_args
from bam_surgery.pipeline.schema import MERGE_OPTIONS
from bam_surgery.runtime import blocks, layout
from bam_surgery.surgery import options as merge_options
from bam_surgery.surgery import plan, recipe
from bam_surgery.surgery.options import FIELDS, MergeOptions, recipe_value
from bam_surgery.train import config as train_config


def _fields(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def test_merge_gets_its_options_as_one_dataclass():
    assert {p.name for p in merge.params} - {"help"} == (_fields(MergeArgs) - {"options"}) | _fields(MergeOptions)
    flags = {p.name: p.opts + p.secondary_opts for p in merge.params}
    for name, f in FIELDS.items():
        assert f.metadata["flag"].split("/") == flags[name], name
        assert f.metadata["help"].strip(), name


def _args(*argv: str) -> MergeArgs:
    """MergeArgs as click parses `merge --seed seed.safetensors --out mix ARGV...` and hands it to the command."""
    return command_args(MergeArgs, merge.make_context("merge", ["--seed", "seed.safetensors", "--out", "mix",
                                                                *argv]).params)


def test_the_options_come_from_the_flags_of_the_same_names():
    args = _args("--weights", "1,2", "--router-init", "profile", "--router", "mlp", "--gate-norm", "topk_softmax",
                 "--ffn-top-k", "2", "--attention-routing", "top2", "--router-seed", "7", "--allow-nonfinite",
                 "--no-seed-expert")
    options = args.options
    assert options.weights == (1.0, 2.0) and options.warm_start == "profile" and options.router == "mlp"
    assert (options.gate_norm, options.ffn_top_k, options.attention_routing) == ("topk_softmax", 2, "top2")
    assert options.router_seed == 7 and options.allow_nonfinite and options.seed_expert is False
    assert _args().options == MergeOptions()  # defaults: the recipe's (router-init random: no warm start)


def test_the_recipe_defaults_are_read_through_the_recipe_keys():
    bam = recipe.load_recipe("bam")
    for name, f in FIELDS.items():
        if f.metadata["recipe"]:
            assert MergeOptions().resolved(name, bam) == recipe_value(bam, f.metadata["recipe"]), name
    assert MergeOptions(ffn_top_k=3).resolved("ffn_top_k", bam) == 3
    # a recipe's defaults: section holds exactly the options whose recipe key is defaults.NAME
    assert set(recipe.DEFAULTS) == {f.metadata["recipe"].split(".", 1)[1] for f in FIELDS.values()
                                    if (f.metadata["recipe"] or "").startswith("defaults.")}
    assert recipe_value(bam, "defaults.ffn_top_k") == bam.defaults["ffn_top_k"]
    assert recipe_value(bam, "routers.std") == bam.router_std


def test_the_pipeline_keys_and_their_command_line_come_from_the_fields():
    assert MERGE_OPTIONS == {n: f.metadata["yaml"] for n, f in FIELDS.items() if f.metadata["yaml"]}
    assert {"router", "ffn_router", "attn_router", "router_hidden", "router_temperature"} <= set(MERGE_OPTIONS)
    assert merge_options.command_args({"ffn_top_k": 2, "seed_expert": False, "weights": [1, 2], "router": "mlp",
                         "allow_nonfinite": True}) == [
        "--ffn-top-k", "2", "--no-seed-expert", "--weights", "1.0,2.0", "--router", "mlp", "--allow-nonfinite"]


def test_every_table_of_values_is_its_literal_alias():
    assert blocks.IMPLS == get_args(blocks.Impl) and blocks.EXPERT_KERNELS == get_args(blocks.ExpertKernel)
    assert set(get_args(blocks.FFNKernel)) == {*blocks.EXPERT_KERNELS, "dense"}
    assert layout.MISMATCH_KINDS == get_args(layout.MismatchKind)
    assert recipe.OPS == get_args(recipe.Op)
    assert merge_options.SHARED_KV_RULES == get_args(merge_options.SharedKVRule)
    assert merge_options.WARM_STARTS == get_args(merge_options.WarmStart)
    assert merge_options.ROUTER_INITS == ("random", *merge_options.WARM_STARTS)
    from bam_surgery.surgery.kernels import OP_TABLE
    assert set(plan.PLAN_OPS) == {*OP_TABLE, "calibrated"}
    assert train_config.CHOICES == {"schedule": get_args(train_config.Schedule),
                                    "precision": get_args(train_config.Precision),
                                    "device": get_args(train_config.Device),
                                    "strategy": get_args(train_config.Strategy),
                                    "compile": get_args(train_config.Compile),
                                    "optimizer_state": get_args(train_config.StateDtype)}
