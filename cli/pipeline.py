"""`bam-surgery pipeline PIPELINE --out DIR [--resume] [--only STAGE,...] [--dry-run]`: a thin click
command over pipeline/run.py (the runner) and pipeline/schema.py (the file, validated)."""
from __future__ import annotations

import sys
from pathlib import Path

import click


@click.command("pipeline")
@click.argument("pipeline", metavar="PIPELINE")
@click.option("--out", required=True, type=click.Path(), metavar="DIR",
              help="Pipeline folder: run folders, models, mixtures, evaluations, report.md/report.json, "
                   "commands.sh. Must not exist (or be empty) unless --resume.")
@click.option("--resume", is_flag=True,
              help="Continue the pipeline in DIR where it stopped: complete stages and units are skipped, an "
                   "interrupted training run continues from its last checkpoint. The pipeline must be the one "
                   "DIR was started with.")
@click.option("--only", "only", metavar="STAGE,...",
              help="Run only these stages (tokenizer, seed, branch, mix, train, eval, report); the stages before "
                   "them must be complete in DIR.")
@click.option("--seed", type=click.IntRange(min=0), metavar="N",
              help="Replace the pipeline's seed (every run's init, data order and router init): the same "
                   "pipeline replicated with another seed.")
@click.option("--prepare", is_flag=True,
              help="Write DIR's resolved pipeline, training configs and commands.sh, and run nothing (to run the "
                   "training commands elsewhere, e.g. under torchrun; --resume then skips the runs they finished).")
@click.option("--dry-run", is_flag=True,
              help="Check the pipeline and print every training run (steps, tokens, FLOPs) and the equivalent "
                   "commands; write nothing.")
def pipeline_cmd(pipeline, out, resume, only, seed, prepare, dry_run):
    """Run the whole Branch-Attend-Mix workflow: train a seed, branch it into one specialist per domain, mix
    them with every listed recipe, train each mixture data-matched and compute-matched, evaluate every model
    and write DIR/report.md.

    PIPELINE is a YAML file (schema: recipes/pipelines/README.md) or the name of a shipped one (tiny,
    paper-small). The file is checked completely before any work starts.
    """
    # lazy: the pipeline layer (the train loop, its plots) is 0.05-0.08 s more on every start
    from bam_surgery.pipeline.run import PipelineRun
    from bam_surgery.pipeline.schema import load_pipeline

    spec = load_pipeline(pipeline, seed=seed)
    stages = [s.strip() for s in only.split(",") if s.strip()] if only else None
    run = PipelineRun(spec, Path(out), log=lambda m: click.echo(m, err=True))
    if dry_run:
        if stages:
            run.check_only_names(stages)
        click.echo(run.describe())
        return
    try:
        run.run(only=stages, resume=resume, prepare_only=prepare)
    except KeyboardInterrupt:
        again = f"bam-surgery pipeline {pipeline} --out {out}" + (f" --seed {seed}" if seed is not None else "")
        click.echo(f"bam-surgery: interrupted; continue with: {again} --resume", err=True)
        sys.exit(130)
    if not prepare:
        click.echo(f"pipeline {spec.name}: done; report {Path(out) / 'report.md'}", err=True)
