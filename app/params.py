"""The header-only use cases: count-params (total and active parameters by group) and inspect.

    count = count_params("mix.safetensors")                      # a checkpoint, from its header
    count = count_params(preset_name="paper-small", recipe="bam", experts=4, convention="paper")
    render_audit(count.audit, count.source)

Option combinations that cannot be are runtime.errors.UsageError (the CLI shows them as click shows its own
usage errors); a checkpoint whose tensors disagree with its config is refused, naming the first mismatch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bam_surgery.runtime.config import ConfigError, ModelConfig, preset, preset_trainable
from bam_surgery.runtime.errors import UsageError, UserError, one_line
from bam_surgery.surgery.audit import Audit, audit, audit_checkpoint
from bam_surgery.surgery.errors import BamSurgeryError
from bam_surgery.surgery.inspect import Inspection, describe_kind, inspect_checkpoint
from bam_surgery.surgery.recipe import load_recipe, mixture_config, parse_attention_routing
from bam_surgery.train.config import split_patterns

from .inputs import open_input


@dataclass(frozen=True)
class ParamCount:
    source: str  # what was counted, as the table's title says it: the checkpoint, or "preset NAME" (+ recipe)
    config: ModelConfig  # the counted model's config (the mixture's, with a recipe)
    audit: Audit


def count_params(ckpt: str | None = None, *, preset_name: str | None = None, recipe: str | None = None,
                 experts: int | None = None, ffn_top_k: int | None = None, attention_routing: str | None = None,
                 router: str | None = None, router_hidden: int | None = None,
                 trainable: str | None = None, convention: str = "exact",
                 allow_pickle: bool = False) -> ParamCount:
    """Parameters of a checkpoint (its header only) or a preset; with `recipe` and `experts`, of the mixture the
    recipe would build from it; ffn_top_k / attention_routing re-route (the active count only). trainable:
    train's --trainable PATTERNS (default: the preset's own, else every parameter)."""
    _check_what_to_count(ckpt, preset_name, recipe, experts, router, router_hidden)
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
        cfg = _mixture_from_recipe(recipe, base, experts, ffn_top_k, attention_routing, router, router_hidden)
        source += f" + recipe {recipe}, {experts} experts"
    else:
        cfg = _apply_routing(base, ffn_top_k, attention_routing)
    if not ckpt or cfg is not base:
        # a preset, a mixture that does not exist yet, or a re-routed checkpoint: its layout was
        # checked above, so the config's shapes are the checkpoint's shapes
        a = audit(cfg, convention, trainable=patterns)
    return ParamCount(source, cfg, a)


def inspect(ckpt: str, allow_pickle: bool = False) -> Inspection:
    """A checkpoint's config, tensor groups and provenance, from its header."""
    with open_input(ckpt, allow_pickle) as reader:
        return inspect_checkpoint(reader)


def _check_what_to_count(ckpt, preset_name, recipe, experts, router, router_hidden) -> None:
    if ckpt and preset_name:
        raise UsageError("give either CKPT or --preset, not both")
    if not ckpt and not preset_name:
        raise UsageError("nothing to count: give a checkpoint CKPT or --preset NAME")
    if experts is not None and not recipe:
        raise UsageError("--experts needs --recipe")
    if recipe and experts is None:
        raise UsageError("--recipe needs --experts N")
    if (router or router_hidden) and not recipe:
        raise UsageError("--router and --router-hidden need --recipe (a checkpoint's routers are its own)")


def routing_option(value: str | None) -> tuple[bool, int | None]:
    """--attention-routing: (given?, top-k or None for soft)."""
    if value is None:
        return False, None
    try:
        return True, parse_attention_routing(value)
    except ValueError as e:
        raise UsageError(f"Invalid value for --attention-routing: {e}") from None


def _mixture_from_recipe(recipe_name: str, dense: ModelConfig, experts: int, ffn_top_k: int | None,
                         attention_routing: str | None, router: str | None = None,
                         router_hidden: int | None = None) -> ModelConfig:
    """The config `merge --recipe` would write; `experts` counts every expert of the mixture."""
    given, attn_top_k = routing_option(attention_routing)
    if dense.is_mixture:
        raise UsageError(f"--recipe {recipe_name}: the base model is already a mixture "
                         f"({describe_kind(dense)}); a recipe starts from a dense model")
    try:
        recipe = load_recipe(recipe_name)
        # a recipe that takes no --experts (upcycle) has one input, the seed; its other experts are
        # copies of the seed's FFN. Otherwise every expert is an input (extra copies count the same).
        n_inputs, extra = (1, experts - 1) if recipe.max_experts == 0 else (experts, 0)
        return mixture_config(recipe, dense, n_inputs, ffn_top_k=ffn_top_k, extra_ffn_experts=extra,
                              attention_routing=("soft" if attn_top_k is None else attn_top_k) if given else None,
                              router=router, router_hidden=router_hidden)
    except UserError as e:
        raise UsageError(f"--recipe {recipe_name}: {one_line(e)}") from e


def _apply_routing(cfg: ModelConfig, ffn_top_k: int | None, attention_routing: str | None) -> ModelConfig:
    """Re-route an existing model (changes the active count only)."""
    given, attn_top_k = routing_option(attention_routing)
    changes: dict[str, Any] = {}
    if ffn_top_k is not None:
        if not cfg.ffn_experts:
            raise UsageError("--ffn-top-k: this model has no FFN experts (dense FFN)")
        changes["ffn_top_k"] = ffn_top_k
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
