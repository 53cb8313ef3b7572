"""The merge use case, once: `bam-surgery merge` and the pipeline's mix stage both call `merge`.

    result = merge([(None, "seed.safetensors"), ("code", "code.safetensors")], "mix.safetensors",
                   recipe="bam", options=MergeOptions(ffn_top_k=2))
    result.path, result.plan.config

Walk: the request's own checks (before any checkpoint is opened), the inputs opened (headers only), the
plan compiled (surgery/plan.py) and the format's capability checked from its config, the warm start
(surgery/warm_start.py, with --router-init domain-mean|profile) and the routers from prompts (surgery/prompts.py,
with --router-prompts: the file read before any checkpoint is opened), then OUT checked once (the OUT policy and
the branch check) and written: canonical by surgery/execute.py (with the seed's side files), any other format
through app/exports.py from a PlanReader (no intermediate canonical file). A dry run stops after the plan and
returns it unwritten.
"""
from __future__ import annotations

import os
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from bam_surgery.converters.export import check_export
from bam_surgery.runtime.output_path import check_output_path
from bam_surgery.runtime.sizes import parse_size
from bam_surgery.surgery.audit import Audit, audit_checkpoint
from bam_surgery.surgery.branches import check_branches
from bam_surgery.surgery.errors import BamSurgeryError
from bam_surgery.surgery.execute import execute_plan
from bam_surgery.surgery.names import input_names
from bam_surgery.surgery.options import MergeOptions
from bam_surgery.surgery.inspect import render_audit
from bam_surgery.surgery.plan import Plan, compile_plan, format_plan
from bam_surgery.surgery.plan_reader import PlanReader
from bam_surgery.surgery.prompts import check_prompts, prompt_start, read_prompt_file
from bam_surgery.surgery.recipe import Recipe, load_recipe

from .exports import ExportRequest, carried_files, check_format_out, export_inputs, write_export
from .inputs import open_input
from .reporter import Reporter

MergeInput = tuple[str | None, str]  # (name or None: the default name, checkpoint spec); the seed first


@dataclass(frozen=True)
class MergeResult:
    plan: Plan  # what was (or, for a dry run, would be) written
    path: Path | None  # OUT once written; None for a dry run
    audit: Audit | None = None  # a dry run: the planned output's parameter counts (from its shapes)

    def dry_run_text(self) -> str:
        """A dry run's plan and the planned output's parameter counts, as `merge --dry-run` prints them."""
        return f"{format_plan(self.plan)}\n\n{render_audit(self.audit, 'planned output of the merge')}"


def merge(inputs: Sequence[MergeInput], out: str | os.PathLike | None, *, recipe: str | Recipe = "bam",
          options: MergeOptions = MergeOptions(), fmt: str = "canonical", max_shard_size: str | None = None,
          dry_run: bool = False, force: bool = False, allow_pickle: bool = False,
          reporter: Reporter | None = None) -> MergeResult:
    """Merge `inputs` (the seed first, then the experts) into OUT with `recipe` and `options`.

    fmt: an output format of converters.export; max_shard_size: '2GB' and the like (directory outputs);
    reporter: the merge's warnings, the warm start's progress lines, a progress bar (reporter.progress), a killed
    run's work folder for OUT settled, and OUT the moment it is in place, before the inputs are closed (default:
    Reporter(), warnings on stderr). The result's plan holds closed readers: its shapes, config and options are
    there to show, not its tensors."""
    reporter = reporter or Reporter()
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
            plan = _warm_start(plan, options, reporter.log)
        if prompts is not None and not dry_run:  # likewise: runs the prompts through the merged model
            plan = prompt_start(plan, prompts, options.tokenizer, reporter.log)
        if dry_run:
            return MergeResult(plan, None, audit_checkpoint(PlanReader(plan, hash_inputs=False)))
        out = Path(out)
        check_output_path(out, force, [(inp.label, inp.reader) for inp in plan.inputs])
        warn = reporter.warning
        if fmt == "canonical":  # the seed's side files carried (app/exports.py); the branch check in execute_plan
            carried = carried_files(export_inputs(plan.inputs[0].reader, "canonical", plan=plan, warn=warn))
            path = execute_plan(plan, out, force=force, max_shard_bytes=shard_bytes, progress=reporter.progress,
                                warn=warn, on_stale=reporter.settled, side_files=carried)
        else:
            check_branches(plan, warn)
            path = _export_merged(plan, out, fmt, force, shard_bytes, reporter)
        reporter.written(path)
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


def _warm_start(plan: Plan, options: MergeOptions, log: Callable[[str], None]) -> Plan:
    """The plan with its expert embeddings computed from the calibration data (surgery/warm_start.py)."""
    # lazy: warm_start pulls in the tokenizers package (30 ms), for --router-init only
    from bam_surgery.surgery.warm_start import Calibration, warm_start

    calibration = Calibration(options.calibration, options.calibration_tokens, options.tokenizer,
                              options.token_cache)
    return warm_start(plan, calibration, log)


def _export_merged(plan: Plan, out: Path, fmt: str, force: bool, shard_bytes: int | None, reporter: Reporter
                   ) -> Path:
    """Export straight from the plan (no intermediate canonical file): a PlanReader computes each tensor when the
    exporter asks for it; app/exports.py carries the seed's side files and the card (OUT checked above)."""
    return write_export(PlanReader(plan, warn=reporter.warning, hash_inputs=False), out, fmt,
                        ExportRequest(max_shard_bytes=shard_bytes, force=force), plan=plan, reporter=reporter)
