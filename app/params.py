"""The header-only use cases: count-params (total and active parameters by group) and inspect.

    count = count_params("mix.safetensors")                      # a checkpoint, from its header
    count = count_params(preset_name="paper-small", recipe="bam", experts=4, convention="paper")
    count = count_params(preset_name="tiny", recipe="btx", experts=4, options=MergeOptions(ffn_top_k=2))
    render_audit(count.audit, count.source)

A recipe's mixture is counted with the merge's own options (surgery/options.py:MergeOptions, the fields that
change what is counted: routing, experts, routers), read as the merge reads them, so a count says what a merge with
the same flags writes; the paper's convention takes the paper's routing (surgery/audit.py:PAPER_ROUTING: top-1
FFN, softmax gates, soft attention) where the options leave it to the recipe. Option combinations that cannot be
are runtime.errors.UsageError (the CLI shows them as click shows its own usage errors); a checkpoint whose tensors
disagree with its config is refused, naming the first mismatch.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from bam_surgery.runtime.config import ConfigError, ModelConfig, preset, preset_trainable
from bam_surgery.runtime.errors import UsageError, UserError, one_line
from bam_surgery.surgery.audit import PAPER_ROUTING, Audit, audit, audit_checkpoint
from bam_surgery.surgery.errors import BamSurgeryError
from bam_surgery.surgery.inspect import Inspection, describe_kind, inspect_checkpoint, render_audit
from bam_surgery.surgery.options import FIELDS, MergeOptions
from bam_surgery.surgery.recipe import Recipe, load_recipe, mixture_config, parse_attention_routing
from bam_surgery.train.config import split_patterns

from .inputs import open_input

# the merge options count-params takes (MergeOptions fields marked `counts`); a checkpoint is re-routed by these
COUNTED = tuple(name for name, f in FIELDS.items() if f.metadata["counts"])
REROUTE = ("ffn_top_k", "attention_routing")
PAPER_WORDS = {"ffn_top_k": "top-1 FFN routing", "gate_norm": "softmax gates", "attention_routing": "soft attention"}


@dataclass(frozen=True)
class ParamCount:
    source: str  # what was counted, as the table's title says it: the checkpoint, or "preset NAME" (+ recipe)
    config: ModelConfig  # the counted model's config (the mixture's, with a recipe)
    audit: Audit

    def table(self) -> str:
        """The count as `bam-surgery count-params` prints it (surgery/inspect.py:render_audit)."""
        return render_audit(self.audit, self.source)

    def to_dict(self) -> dict[str, Any]:
        """What `count-params --json` prints."""
        return dict(source=self.source, kind=describe_kind(self.config), **self.audit.to_dict())


def count_params(ckpt: str | None = None, *, preset_name: str | None = None, recipe: str | None = None,
                 experts: int | None = None, options: MergeOptions | None = None, trainable: str | None = None,
                 convention: str = "exact", allow_pickle: bool = False) -> ParamCount:
    """Parameters of a checkpoint (its header only) or a preset; with `recipe` and `experts`, of the mixture the
    recipe would build from it with the merge's `options` (the COUNTED fields; --convention paper: the paper's
    routing where they are left to the recipe). A checkpoint without a recipe is re-routed by options.ffn_top_k /
    attention_routing (the active count only). trainable: train's --trainable PATTERNS (default: the preset's own,
    else every parameter)."""
    options = options or MergeOptions()
    _check_what_to_count(ckpt, preset_name, recipe, experts, options)
    if trainable is not None:
        patterns = split_patterns(trainable)
        if not patterns:
            raise UsageError("Invalid value for --trainable: no patterns: give at least one (e.g. '*')")
    else:
        patterns = preset_trainable(preset_name) if preset_name else ["*"]
    if ckpt:
        with open_input(ckpt, allow_pickle) as reader:
            a = audit_checkpoint(reader, convention, trainable=patterns)
        _refuse_mismatches(ckpt, a)
        base, source = reader.config, ckpt
    else:
        base, source = preset(preset_name), f"preset {preset_name}"
    if recipe:
        cfg, paper = _mixture_from_recipe(recipe, base, experts, options, convention)
        source += f" + recipe {recipe}, {experts} experts"
        if paper:  # the paper's routing where the options left it to the recipe, said
            source += ", the paper's " + " and ".join(PAPER_WORDS[name] for name in paper)
    else:
        cfg = _apply_routing(base, options)
    if not ckpt or cfg is not base:
        # a preset, a mixture that does not exist yet, or a re-routed checkpoint: its layout was
        # checked above, so the config's shapes are the checkpoint's shapes
        a = audit(cfg, convention, trainable=patterns)
    return ParamCount(source, cfg, a)


def inspect(ckpt: str, allow_pickle: bool = False) -> Inspection:
    """A checkpoint's config, tensor groups and provenance, from its header."""
    with open_input(ckpt, allow_pickle) as reader:
        return inspect_checkpoint(reader)


def _check_what_to_count(ckpt, preset_name, recipe, experts, options: MergeOptions) -> None:
    if ckpt and preset_name:
        raise UsageError("give either CKPT or --preset, not both")
    if not ckpt and not preset_name:
        raise UsageError("nothing to count: give a checkpoint CKPT or --preset NAME")
    if experts is not None and not recipe:
        raise UsageError("--experts needs --recipe")
    if recipe and experts is None:
        raise UsageError("--recipe needs --experts N")
    given = [FIELDS[n].metadata["flag"].split("/")[0] for n in COUNTED
             if n not in REROUTE and getattr(options, n) is not None]
    if given and not recipe:
        raise UsageError(f"{' and '.join(given)} need{'s' if len(given) == 1 else ''} --recipe (a checkpoint's "
                         "experts and routers are its own; --ffn-top-k and --attention-routing re-route it)")
    routing_option(options.attention_routing)  # refused by name before anything is read


def routing_option(value: str | int | None) -> tuple[bool, int | None]:
    """--attention-routing: (given?, top-k or None for soft)."""
    if value is None:
        return False, None
    try:
        return True, parse_attention_routing(value)
    except ValueError as e:
        raise UsageError(f"Invalid value for --attention-routing: {e}") from None


def _mixture_from_recipe(recipe_name: str, dense: ModelConfig, experts: int, options: MergeOptions,
                         convention: str) -> tuple[ModelConfig, dict[str, Any]]:
    """The config `merge --recipe` would write with these options; `experts` counts every expert of the mixture.
    With the paper's convention, the paper's routing where the options leave it to the recipe; the second value
    is what of it was taken."""
    if dense.is_mixture:
        raise UsageError(f"--recipe {recipe_name}: the base model is already a mixture "
                         f"({describe_kind(dense)}); a recipe starts from a dense model")
    try:
        recipe = load_recipe(recipe_name)
        # a recipe that takes no --experts (upcycle) has one input, the seed; its other experts are
        # copies of the seed's FFN. Otherwise every expert is an input (extra copies count the same).
        if recipe.max_experts == 0:
            if options.extra_ffn_experts is not None:
                raise UsageError(f"--extra-ffn-experts: recipe {recipe_name} counts its copies of the seed's FFN with "
                                 "--experts N (N - 1 copies besides the seed's own slot); give --experts alone")
            n_inputs, options = 1, dataclasses.replace(options, extra_ffn_experts=experts - 1)
        else:
            n_inputs = experts
        paper = _paper_routing(recipe, options) if convention == "paper" else {}
        return mixture_config(recipe, dense, n_inputs, dataclasses.replace(options, **paper)), paper
    except UsageError:
        raise
    except UserError as e:
        raise UsageError(f"--recipe {recipe_name}: {one_line(e)}") from e


def _paper_routing(recipe: Recipe, options: MergeOptions) -> dict[str, Any]:
    """The paper's routing (PAPER_ROUTING) for the options left to the recipe, where it differs from the recipe's
    own and applies (a recipe without FFN experts routes none)."""
    out = {}
    for name, value in PAPER_ROUTING.items():
        if getattr(options, name) is None and (recipe.ffn_experts or name != "ffn_top_k") \
                and options.resolved(name, recipe) != value:
            out[name] = value
    return out


def _apply_routing(cfg: ModelConfig, options: MergeOptions) -> ModelConfig:
    """Re-route an existing model (changes the active count only)."""
    given, attn_top_k = routing_option(options.attention_routing)
    changes: dict[str, Any] = {}
    if options.ffn_top_k is not None:
        if not cfg.ffn_experts:
            raise UsageError("--ffn-top-k: this model has no FFN experts (dense FFN)")
        changes["ffn_top_k"] = options.ffn_top_k
    if given:
        if not cfg.attn_experts:
            raise UsageError("--attention-routing: this model has no attention experts (dense attention)")
        changes["attn_top_k"] = attn_top_k
    try:
        return cfg.replace(**changes) if changes else cfg
    except ConfigError as e:
        raise UsageError(one_line(e)) from e


def _refuse_mismatches(ckpt: str, a: Audit) -> None:
    if a.mismatches:
        n = len(a.mismatches)
        more = f" (and {n - 1} more; `bam-surgery inspect` lists them)" if n > 1 else ""
        raise BamSurgeryError(f"{ckpt}: {a.mismatches[0].message()}{more}")
