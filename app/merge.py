"""The merge use case, once: `bam-surgery merge` and the pipeline's mix stage both call `merge`.

    result = merge([(None, "seed.safetensors"), ("code", "code.safetensors")], "mix.safetensors",
                   recipe="bam", options=MergeOptions(ffn_top_k=2))
    result.path, result.plan.config

Walk: the request's own checks (before any checkpoint is opened), the inputs opened (headers only), the
plan compiled (surgery/plan.py) and the format's capability checked from its config, the warm start
(surgery/warm_start.py, with --router-init domain-mean|profile), then OUT checked once (the OUT policy and
the branch check) and written: canonical by surgery/execute.py (with the seed's side files), any other format
through app/exports.py from a PlanReader (no intermediate canonical file). A dry run stops after the plan and returns it unwritten.
"""
from __future__ import annotations

import os
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from bam_surgery.converters.export import check_export, exporter
from bam_surgery.runtime.errors import print_warning
from bam_surgery.runtime.output_path import check_output_path
from bam_surgery.runtime.sizes import parse_size
from bam_surgery.surgery.branches import check_branches
from bam_surgery.surgery.errors import BamSurgeryError
from bam_surgery.surgery.execute import execute_plan
from bam_surgery.surgery.names import input_names
from bam_surgery.surgery.options import MergeOptions
from bam_surgery.surgery.plan import Plan, compile_plan
from bam_surgery.surgery.plan_reader import PlanReader
from bam_surgery.surgery.prompts import check_prompts, prompt_start, read_prompt_file
from bam_surgery.surgery.recipe import Recipe, load_recipe

from .exports import ExportRequest, carried_files, export_inputs, write_export
from .inputs import open_input

Warn = Callable[[str], None]
MergeInput = tuple[str | None, str]  # (name or None: the default name, checkpoint spec); the seed first


@dataclass(frozen=True)
class MergeResult:
    plan: Plan  # what was (or, for a dry run, would be) written
    path: Path | None  # OUT once written; None for a dry run


def merge(inputs: Sequence[MergeInput], out: str | os.PathLike | None, *, recipe: str | Recipe = "bam",
          options: MergeOptions = MergeOptions(), fmt: str = "canonical", max_shard_size: str | None = None,
          dry_run: bool = False, force: bool = False, allow_pickle: bool = False, progress: bool = False,
          warn: Warn | None = None, on_stale: Warn | None = None, log: Warn | None = None,
          on_written: Callable[[Path], None] | None = None) -> MergeResult:
    """Merge `inputs` (the seed first, then the experts) into OUT with `recipe` and `options`.

    fmt: an output format of converters.export; max_shard_size: '2GB' and the like (directory outputs);
    warn: the merge's warnings (default: printed to stderr); on_stale: told when a killed run's work folder for
    OUT is settled (default: warn); log: the warm start's progress lines; on_written: called with OUT the
    moment it is in place (before the inputs are closed). The result's plan holds closed readers: its shapes,
    config and options are there to show, not its tensors."""
    warn = warn or print_warning
    the_recipe = recipe if isinstance(recipe, Recipe) else load_recipe(recipe)  # before any checkpoint is opened
    shard_bytes = check_request(out, options, fmt, max_shard_size, dry_run)
    prompts = read_prompt_file(options.router_prompts) if options.router_prompts else None
    names = input_names([spec for _, spec in inputs], [name for name, _ in inputs])
    with ExitStack() as opened:
        readers = [opened.enter_context(open_input(spec, allow_pickle)) for _, spec in inputs]
        plan = compile_plan(the_recipe, readers, options, names=names)
        check_export(fmt, plan.config, recipe=the_recipe.name)  # from the plan's config, before any read
        if prompts is not None:
            check_prompts(plan, prompts)
        if options.warm_start and not dry_run:  # a stage before the streamed merge: reads inputs and data
            plan = _warm_start(plan, options, log)
        if prompts is not None and not dry_run:  # likewise: runs the prompts through the merged model
            plan = prompt_start(plan, prompts, options.tokenizer, log)
        if dry_run:
            return MergeResult(plan, None)
        out = Path(out)
        check_output_path(out, force, [(inp.label, inp.reader) for inp in plan.inputs])
        if fmt == "canonical":  # the seed's side files carried (app/exports.py); the branch check in execute_plan
            carried = carried_files(export_inputs(plan.inputs[0].reader, "canonical", plan=plan, warn=warn))
            path = execute_plan(plan, out, force=force, max_shard_bytes=shard_bytes, progress=progress, warn=warn,
                                on_stale=on_stale, side_files=carried)
        else:
            check_branches(plan, warn)
            path = _export_merged(plan, out, fmt, force, shard_bytes, warn)
        if on_written is not None:
            on_written(path)
    return MergeResult(plan, path)


def check_request(out: str | os.PathLike | None, options: MergeOptions, fmt: str, max_shard_size: str | None,
                  dry_run: bool) -> int | None:
    """The checks of a merge's options among themselves, before any checkpoint is opened; the shard size in
    bytes."""
    if out is None and not dry_run:
        raise BamSurgeryError("--out is required (or use --dry-run)")
    shard_bytes = parse_size(max_shard_size) if max_shard_size else None
    if shard_bytes and out is not None and str(out).endswith(".safetensors"):
        raise BamSurgeryError(f"--max-shard-size: {out} is a single .safetensors file; give a directory path "
                              "to write shards")
    check_format_out(fmt, out)
    if options.warm_start and not options.calibration:
        raise BamSurgeryError(f"--router-init {options.warm_start}: needs --calibration DATA (e.g. "
                              "code=data/domains/code,general=data/domains/general)")
    if options.calibration and not options.warm_start:
        raise BamSurgeryError("--calibration: only --router-init domain-mean or profile reads calibration data")
    return shard_bytes


def check_format_out(fmt: str, out: str | os.PathLike | None) -> None:
    """A format that writes a directory refuses an OUT named like one file."""
    if out is not None and exporter(fmt).writes_directory and str(out).endswith(".safetensors"):
        raise BamSurgeryError(f"--format {fmt}: writes a directory; {out} names a .safetensors file")


def _warm_start(plan: Plan, options: MergeOptions, log: Warn | None) -> Plan:
    """The plan with its expert embeddings computed from the calibration data (surgery/warm_start.py)."""
    # lazy: warm_start pulls in the tokenizers package (30 ms), for --router-init only
    from bam_surgery.surgery.warm_start import Calibration, warm_start

    calibration = Calibration(options.calibration, options.calibration_tokens, options.tokenizer,
                              options.token_cache)
    return warm_start(plan, calibration, log)


def _export_merged(plan: Plan, out: Path, fmt: str, force: bool, shard_bytes: int | None, warn: Warn) -> Path:
    """Export straight from the plan (no intermediate canonical file): a PlanReader computes each tensor when the
    exporter asks for it; app/exports.py carries the seed's side files and the card (OUT checked above)."""
    return write_export(PlanReader(plan, warn=warn, hash_inputs=False), out, fmt,
                        ExportRequest(max_shard_bytes=shard_bytes, force=force), plan=plan, warn=warn)
