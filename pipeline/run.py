"""`bam-surgery pipeline`: the whole Branch-Attend-Mix workflow, stage by stage, resumable.

    spec = load_pipeline("tiny")                                 # schema.py: the file, validated
    PipelineRun(spec, Path("runs/tiny")).run()                   # or run(only=["report"], resume=True)

Stages (STAGES), each a list of units run in order through the Python APIs (train.train,
app.merge.merge, train.evaluate), each unit recorded in DIR/commands.sh as the
equivalent command line:

    tokenizer  train a byte-level BPE on every source's train split (data.tokenizer.bpe) tokenizer/
    seed     train the dense seed on general text (or link the given checkpoint)      runs/seed, models/seed
    branch   one continued-pretraining run per domain from the seed                  runs/branch-D, models/D
    mix      every mixture of stages.mix, from the seed and the specialists          mixes/M.safetensors
    train    mixture training, data-, compute- and time-matched                      runs/dm-M, cm-M, tm-M
             (and the dense baselines: the seed trained on the same data)            runs/dense-dm, dense-cm
    eval     every model on each domain's held-out text (and the general text)       eval/MODEL.json
    report   report.md, report.json, plots/*.png                                     (report.py)

models/ holds links named after the merge's expert names (models/seed, models/code, ...) to the final
checkpoints: the merge names its experts after its inputs' file names.

Completion is judged from the products, each written atomically: a training run is complete when its
final checkpoint (checkpoints/step-N) exists, a merge when its file exists, an eval when its JSON exists.
A run folder with checkpoints but not the final one is resumed (train's exact resume); one with none is
started again. A stage's marker, DIR/stages/STAGE.json (its units' tokens and times), is written last;
a stage with a marker is skipped whole. So a crash or an interrupt loses at most the current unit's
progress since its last checkpoint, and `--resume` picks up there.
"""
from __future__ import annotations

import copy
import json
import os
import shlex
import shutil
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from bam_surgery.app.merge import merge
from bam_surgery.app.reporter import Reporter
from bam_surgery.app.train import evaluate, train
from bam_surgery.converters.yamlfile import read_yaml
from bam_surgery.runtime.errors import one_line
from bam_surgery.runtime.jsonfile import read_json
from bam_surgery.runtime.text import render_table
from bam_surgery.surgery.options import command_args
from bam_surgery.train import TrainConfig, load_run_config
from bam_surgery.train.bpe import train_bpe
from bam_surgery.train.checkpoints import latest_checkpoint, step_dir_name
from bam_surgery.train.data import Domain, file_sha256, open_source

from .files import provenance, training_seconds, write_record
from .report import write_report
from .spec import (STAGES, Mixture, PipelineError, PipelineSpec, branch_config, dump_resolved, first_difference,
                   seed_config, train_config)

Log = Callable[[str], None]


class UnitReporter(Reporter):
    """A unit's lines in the pipeline's log (`line` indents them under the unit): the use cases' warnings, notes and
    progress lines."""

    def __init__(self, line: Log):
        self._line = line

    def warning(self, message: str) -> None:
        self._line(f"warning: {one_line(message)}")

    def note(self, message: str) -> None:
        self._line(f"note: {one_line(message)}")

    def log(self, line: str) -> None:
        self._line(line)
RESOLVED = "pipeline.resolved.yaml"
COMMANDS = "commands.sh"


@dataclass
class Unit:
    stage: str
    name: str
    commands: list[str]  # the equivalent command lines
    done: Callable[[], bool]
    work: Callable[[], dict[str, Any]]  # does the unit; returns what it produced (tokens, ...)


def _link_atomic(link: Path, target: str) -> None:
    link.parent.mkdir(parents=True, exist_ok=True)
    tmp = link.with_name(f".{link.name}.partial-link")
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    os.symlink(target, tmp)
    try:
        os.replace(tmp, link)
    except BaseException:
        tmp.unlink()
        raise


def _quote(args: list[str]) -> str:
    return " ".join(shlex.quote(str(a)) for a in args)


@contextmanager
def _threads(n: int | None) -> Iterator[None]:
    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class PipelineRun:
    """One pipeline run into DIR: the units of every stage, their completion, the records."""

    def __init__(self, spec: PipelineSpec, out: Path, log: Log | None = None):
        self.dir = Path(out).resolve()
        if spec.bpe:  # every stage reads the tokenizer the tokenizer stage writes
            spec = replace(spec, tokenizer=str(self.tokenizer_file()))
        self.spec = spec
        self.log = log or (lambda m: print(m, file=sys.stderr, flush=True))
        self.runs, self.models, self.mixes = self.dir / "runs", self.dir / "models", self.dir / "mixes"
        self.configs, self.evals, self.stages = self.dir / "configs", self.dir / "eval", self.dir / "stages"
        self.grown: list[str] | None = None  # what --resume adds to DIR's pipeline (check_out), None: nothing

    # ---- paths -----------------------------------------------------------------------------------
    def final_checkpoint(self, unit: str, steps: int) -> Path:
        return self.runs / unit / "checkpoints" / step_dir_name(steps)

    def tokenizer_file(self) -> Path:
        return self.dir / "tokenizer" / "tokenizer.json"

    def seed_checkpoint(self) -> str:
        return str(self.models / self._seed_link_name())

    def _seed_link_name(self) -> str:
        """models/seed; models/seed.safetensors when the given seed is one file: a file is a checkpoint by its
        suffix (open_checkpoint), so a link without it would not open."""
        init = self.spec.seed_init
        single = init is not None and Path(init).suffix == ".safetensors" and not Path(init).is_dir()
        return "seed.safetensors" if single else "seed"

    def mix_file(self, mix: Mixture) -> Path:
        return self.mixes / f"{mix.name}.safetensors"

    def marker(self, stage: str) -> Path:
        return self.stages / f"{stage}.json"

    def unit_record(self, unit: str) -> Path:
        return self.stages / "units" / f"{unit}.json"

    # ---- the training configs (written to DIR/configs, read back: exactly what `train --config` reads) --
    def train_configs(self) -> dict[str, Any]:
        """unit -> TrainConfig of every training run, in order."""
        spec, out = self.spec, {}
        if spec.seed_init is None:
            out["seed"] = seed_config(spec, str(self.runs / "seed"), str(self.configs / "seed-model.json"))
        for d in self.branched():
            out[f"branch-{d}"] = branch_config(spec, d, self.seed_checkpoint(), str(self.runs / f"branch-{d}"))
        for setting, name in spec.dense_runs():
            out[name] = train_config(spec, None, setting, self.seed_checkpoint(), str(self.runs / name))
        for setting, mix in spec.trained_mixtures():
            name = spec.unit_name(setting, mix)
            out[name] = train_config(spec, mix, setting, str(self.mix_file(mix)), str(self.runs / name))
        return out

    def branched(self) -> list[str]:
        """The domains with a specialist (none without a branch stage)."""
        return list(self.spec.domains) if self.spec.branches else []

    def eval_models(self) -> dict[str, str]:
        """model id -> checkpoint evaluated: the seed, the specialists, every mixture untrained and trained."""
        spec, cfgs = self.spec, self.train_configs()
        out = {"seed": self.seed_checkpoint()}
        out.update({f"branch-{d}": str(self.models / d) for d in self.branched()})
        out.update({f"mix-{m.name}": str(self.mix_file(m)) for m in spec.mixtures})
        for _, name in spec.dense_runs():
            out[name] = str(self.final_checkpoint(name, cfgs[name].steps))
        for setting, mix in spec.trained_mixtures():
            name = spec.unit_name(setting, mix)
            out[name] = str(self.final_checkpoint(name, cfgs[name].steps))
        return out

    # ---- units ---------------------------------------------------------------------------------------
    def units(self) -> list[Unit]:
        spec, cfgs = self.spec, self.train_configs()
        units: list[Unit] = []
        if spec.bpe:
            units.append(Unit("tokenizer", "tokenizer", [self._pipeline_command("tokenizer")],
                              self.tokenizer_file().is_file, self._tokenizer))
        # seed
        if spec.seed_init is None:
            units.append(self._train_unit("seed", "seed", cfgs["seed"]))
            target = os.path.relpath(self.final_checkpoint("seed", cfgs["seed"].steps), self.models)
        else:
            target = spec.seed_init
        units.append(self._link_unit("seed", self._seed_link_name(), target))
        # branch
        for d in self.branched():
            name = f"branch-{d}"
            units.append(self._train_unit("branch", name, cfgs[name]))
            units.append(self._link_unit("branch", d, os.path.relpath(self.final_checkpoint(name, cfgs[name].steps),
                                                                      self.models)))
        # mix
        for mix in spec.mixtures:
            units.append(self._merge_unit(mix))
        # train: the dense baselines first, then the mixtures
        for _, name in spec.dense_runs():
            units.append(self._train_unit("train", name, cfgs[name]))
        for setting, mix in spec.trained_mixtures():
            name = spec.unit_name(setting, mix)
            units.append(self._train_unit("train", name, cfgs[name]))
        # eval
        for model, ckpt in self.eval_models().items():
            units.append(self._eval_unit(model, ckpt))
        units.append(Unit("report", "report", [self._pipeline_command("report")],
                          lambda: (self.dir / "report.json").is_file(), self._report))
        return units

    def _pipeline_command(self, stage: str) -> str:
        """A stage with no command of its own: the pipeline itself, resumed for that stage."""
        return _quote(["bam-surgery", "pipeline", self.dir / RESOLVED, "--out", self.dir, "--resume", "--only", stage])

    def _train_unit(self, stage: str, name: str, cfg) -> Unit:
        config_file = self.configs / f"{name}.yaml"
        final = self.final_checkpoint(name, cfg.steps)
        return Unit(stage, name, [_quote(["bam-surgery", "train", "--config", config_file])],
                    final.is_dir, lambda: self._train(name, config_file))

    def _link_unit(self, stage: str, name: str, target: str) -> Unit:
        link = self.models / name
        return Unit(stage, f"models/{name}", [_quote(["mkdir", "-p", self.models]),
                                             _quote(["ln", "-sfn", target, link])],
                    lambda: link.is_symlink() and os.readlink(link) == target,
                    lambda: (_link_atomic(link, target), {"tokens": 0})[1])

    def _merge_unit(self, mix: Mixture) -> Unit:
        out = self.mix_file(mix)
        return Unit("mix", f"mix-{mix.name}", [_quote(self.merge_args(mix))], out.is_file, lambda: self._merge(mix))

    def _eval_unit(self, model: str, ckpt: str) -> Unit:
        out = self.evals / f"{model}.json"
        cmd = _quote(self.eval_args(ckpt)) + " > " + shlex.quote(str(out))
        return Unit("eval", f"eval-{model}", [cmd], out.is_file, lambda: self._eval(ckpt, out))

    # ---- the command lines -------------------------------------------------------------------------
    def merge_inputs(self, mix: Mixture) -> list[str]:
        """The seed and the specialists (a recipe that takes no experts, upcycle: the seed alone)."""
        experts = [str(self.models / d) for d in self.spec.domains] if mix.recipe.max_experts != 0 else []
        return [self.seed_checkpoint(), *experts]

    def merge_args(self, mix: Mixture) -> list[str]:
        seed, *experts = self.merge_inputs(mix)
        args = ["bam-surgery", "merge", "--seed", seed, *(["--experts", ",".join(experts)] if experts else []),
                "--recipe", mix.recipe_spec]
        return args + command_args(mix.given) + ["--out", str(self.mix_file(mix))]

    def eval_args(self, ckpt: str) -> list[str]:
        spec = self.spec
        args = ["bam-surgery", "eval", ckpt, "--data", spec.eval_spec(), "--tokenizer", spec.tokenizer,
                "--seq-len", str(spec.seq_len), "--batch-size", str(spec.eval_batch_size), "--max-tokens",
                str(spec.eval_max_tokens)]
        if spec.text_field != "text":
            args += ["--text-field", spec.text_field]
        if spec.token_cache:
            args += ["--token-cache", spec.token_cache]
        if spec.knobs.get("device", "auto") != "auto":
            args += ["--device", spec.knobs["device"]]
        return args + ["--json"]

    def commands_text(self) -> str:
        lines = [f"#!/bin/sh",
                 f"# Pipeline {self.spec.name} ({self.spec.path}) into {self.dir}: every unit as the equivalent",
                 "# bam-surgery command, in the order the pipeline runs them (it calls the same Python functions).",
                 f"# The training configs are in {self.configs}; the resolved pipeline in {self.dir / RESOLVED}.",
                 "set -e"]
        if self.spec.threads:
            lines.append(f"export OMP_NUM_THREADS={self.spec.threads}")
        stage = None
        for u in self.units():
            if u.stage != stage:
                stage = u.stage
                lines += ["", f"# ---- {stage}"]
            lines += u.commands
        return "\n".join(lines) + "\n"

    # ---- the work of each unit -----------------------------------------------------------------------
    def _train(self, name: str, config_file: Path) -> dict[str, Any]:
        run = self.runs / name
        log = lambda m: self.log(f"  {m}")  # noqa: E731
        resumed = False
        if run.exists() and latest_checkpoint(run) is not None and (run / "config.yaml").is_file():
            self.log(f"  resuming {run} from {latest_checkpoint(run).name}")
            cfg, resumed = load_run_config(run, {"out": str(run)}), True
        else:
            if run.exists():  # set up but no checkpoint yet: nothing to keep
                shutil.rmtree(run)
            cfg = TrainConfig.from_yaml(config_file)
        result = train(cfg, resume=resumed, reporter=UnitReporter(log))
        return {"tokens": result.tokens, "steps": result.steps, "checkpoint": str(result.checkpoint),
                "resumed": resumed, "train_s": training_seconds(result.checkpoint)}

    def _tokenizer(self) -> dict[str, Any]:
        spec = self.spec
        sources = [open_source(Domain(n, src, 1.0), "train", spec.text_field)
                   for n, src in {"general": spec.general, **spec.domains}.items()]
        path = train_bpe(sources, spec.bpe["vocab_size"], self.tokenizer_file().parent, spec.bpe["min_frequency"])
        self.log(f"  byte-level BPE, {spec.bpe['vocab_size']:,} tokens, from the train split of "
                 f"{', '.join(s.name for s in sources)}")
        return {"tokens": 0, "file": str(path), "sha256": file_sha256(path)}

    def _merge(self, mix: Mixture) -> dict[str, Any]:
        path = merge([(None, s) for s in self.merge_inputs(mix)], self.mix_file(mix), recipe=mix.recipe,
                     options=mix.options, reporter=UnitReporter(lambda m: self.log(f"  {m}"))).path
        return {"tokens": 0, "file": str(path), "bytes": path.stat().st_size}

    def _eval(self, ckpt: str, out: Path) -> dict[str, Any]:
        spec = self.spec
        report = evaluate(ckpt, spec.eval_spec(), tokenizer=spec.tokenizer, seq_len=spec.seq_len,
                          batch_size=spec.eval_batch_size, max_tokens=spec.eval_max_tokens,
                          text_field=spec.text_field, token_cache=spec.token_cache,
                          device=spec.knobs.get("device", "auto"))
        write_record(out, json.dumps(report.to_dict(), indent=2) + "\n")  # what `eval --json` prints
        shown = ", ".join(f"{n} {r.perplexity:.3f}" for n, r in report.domains.items())
        self.log(f"  perplexity: {shown}")
        return {"tokens": sum(r.tokens for r in report.domains.values())}

    def _report(self) -> dict[str, Any]:
        files = write_report(self)
        self.log("  wrote " + ", ".join(str(Path(f).relative_to(self.dir)) for f in files))
        return {"tokens": 0}

    # ---- running ------------------------------------------------------------------------------------
    def check_out(self, resume: bool) -> bool:
        """The OUT policy; returns whether DIR holds a run already."""
        d, saved = self.dir, self.dir / RESOLVED
        if d.exists() and not d.is_dir():
            raise PipelineError(f"--out {d}: exists and is not a folder")
        if saved.is_file():
            if not resume:
                raise PipelineError(f"--out {d}: holds a pipeline run; pass --resume to continue it, or choose a new "
                                    "--out (nothing was changed)")
            old = read_yaml(saved, error=PipelineError)  # bounded: converters/yamlfile.py
            if first_difference(_without_cache(old), _without_cache(self.spec.doc)):
                added, diff = grown_by(old, self.spec.doc)
                if diff:
                    raise PipelineError(f"--resume: {d} was run with another pipeline: {diff} differs from {saved}; "
                                        "a run continues with its pipeline, grown only by mixtures appended to "
                                        "stages.mix.mixtures or dense_baseline: true (or choose a new --out)")
                self.grown = added
            return True
        if d.exists() and any(d.iterdir()):
            raise PipelineError(f"--out {d}: exists and holds no pipeline run ({RESOLVED}); choose a new --out "
                                "(nothing was changed)")
        if resume:
            raise PipelineError(f"--resume: {d} holds no pipeline run ({RESOLVED}); start it without --resume")
        return False

    def check_only(self, only: list[str] | None) -> list[str]:
        """The stages to run, in order; every earlier stage left out must be complete."""
        names = self.spec.stage_names()
        if not only:
            return names
        self.check_only_names(only)
        for s in only:
            for before in STAGES[:STAGES.index(s)]:
                if before in names and before not in only and not self.marker(before).is_file():
                    raise PipelineError(f"--only {','.join(only)}: stage {before} is not complete in {self.dir}; "
                                        f"run it first (add it to --only, or leave --only out)")
        return [s for s in names if s in only]

    @staticmethod
    def check_only_names(only: list[str]) -> None:
        for s in only:
            if s not in STAGES:
                raise PipelineError(f"--only: {s!r} is not a stage; stages are {', '.join(STAGES)}")

    def _grow(self) -> None:
        """DIR's pipeline grown by units (grown_by): the stages that gain units (and the report) run again, their
        complete units skipped. Their markers and the report go first, the new resolved pipeline last (prepare),
        so an interrupt in between leaves a run that the same --resume grows again."""
        self.log(f"pipeline {self.spec.name}: {self.dir} grows by {', '.join(self.grown) or 'report settings'}; "
                 f"stages {', '.join(GROWN_STAGES)} run again for the new units (complete units are skipped)")
        for stage in GROWN_STAGES:
            self.marker(stage).unlink(missing_ok=True)
        (self.dir / "report.json").unlink(missing_ok=True)

    def prepare(self) -> None:
        """DIR's resolved pipeline, training configs and commands.sh (every one written atomically)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        if self.grown is not None or not (self.dir / RESOLVED).is_file():
            write_record(self.dir / RESOLVED, dump_resolved(self.spec))
        if self.spec.seed_init is None:
            write_record(self.configs / "seed-model.json", json.dumps(self.spec.seed_model, indent=1) + "\n")
        for name, cfg in self.train_configs().items():
            write_record(self.configs / f"{name}.yaml", cfg.to_yaml())
        write_record(self.dir / COMMANDS, self.commands_text())

    def run(self, only: list[str] | None = None, resume: bool = False, prepare_only: bool = False) -> Path:
        """Run (or continue) the pipeline; returns DIR. Raises PipelineError before any work on bad
        input (OUT policy, --only). prepare_only: write DIR's files (resolved pipeline, configs,
        commands.sh) and run no stage."""
        existed = self.check_out(resume)
        if self.grown is not None:
            self._grow()
        stages = self.check_only(only)
        self.prepare()
        if prepare_only:
            self.log(f"pipeline {self.spec.name}: prepared {self.dir} ({COMMANDS}, configs/); run no stage")
            return self.dir
        self.log(f"pipeline {self.spec.name} -> {self.dir}" + (" (resumed)" if existed else ""))
        units = self.units()
        with _threads(self.spec.threads):
            for stage in stages:
                self._run_stage(stage, [u for u in units if u.stage == stage])
        return self.dir

    def _run_stage(self, stage: str, units: list[Unit]) -> None:
        if self.marker(stage).is_file():
            self.log(f"stage {stage}: complete, skipped")
            return
        self.log(f"stage {stage}: {len(units)} unit(s)")
        for i, u in enumerate(units, 1):
            if u.done():
                self.log(f"[{stage} {i}/{len(units)}] {u.name}: complete, skipped")
                continue
            self.log(f"[{stage} {i}/{len(units)}] {u.name}")
            wall, cpu = time.perf_counter(), time.process_time()
            produced = u.work()
            rec = {"stage": stage, "unit": u.name, **produced, "wall_s": round(time.perf_counter() - wall, 3),
                   "cpu_s": round(time.process_time() - cpu, 3), **provenance(short=True)}
            write_record(self.unit_record(u.name), json.dumps(rec, indent=1) + "\n")
            self.log(f"[{stage} {i}/{len(units)}] {u.name}: done in {rec['wall_s']:.1f} s")
        summary = {"stage": stage, "units": {}}
        for u in units:
            rec_file = self.unit_record(u.name)
            summary["units"][u.name] = read_json(rec_file, expect=dict) if rec_file.is_file() else {}
        recs = summary["units"].values()
        summary.update(tokens=sum(r.get("tokens", 0) for r in recs),
                       wall_s=round(sum(r.get("wall_s", 0.0) for r in recs), 3),
                       cpu_s=round(sum(r.get("cpu_s", 0.0) for r in recs), 3))
        write_record(self.marker(stage), json.dumps(summary, indent=1) + "\n")

    # ---- the plan, for --dry-run ------------------------------------------------------------------
    def describe(self) -> str:
        spec, cfgs = self.spec, self.train_configs()
        rows = []
        for name, cfg in cfgs.items():
            tokens = cfg.steps * (cfg.batch_tokens or cfg.micro_batch * spec.seq_len)
            fpt = spec.unit_flops_per_token(name)
            rows.append((name, f"{cfg.steps:,}", f"{tokens:,}", f"{fpt / 1e6:,.2f}", f"{tokens * fpt:.3e}"))

        total = sum(float(r[4]) for r in rows)
        return "\n".join([render_table(("training run", "steps", "tokens", "MFLOP/token", "FLOPs"), rows),
                          f"total training FLOPs {total:.3e}", "", self.commands_text()])


GROWN_STAGES = ("mix", "train", "eval", "report")  # the stages a grown pipeline adds units to


def grown_by(old: Any, new: Any) -> tuple[list[str], str | None]:
    """(what `new` adds to `old`, the first other difference or None) for two resolved pipelines. A run of `old`
    continues as `new` when the only differences are mixtures appended to stages.mix.mixtures, the dense baseline
    turned on and report settings: every unit of `old` is then a unit of `new` with the same config
    (compute-matched steps depend on the compute reference only, which stays)."""
    if not (isinstance(old, dict) and isinstance(new, dict)):
        return [], "(document)"
    try:
        a, b = copy.deepcopy(_without_cache(old)), copy.deepcopy(_without_cache(new))
        added: list[str] = []
        mixes_a, mixes_b = a["stages"]["mix"]["mixtures"], b["stages"]["mix"]["mixtures"]
        if len(mixes_b) > len(mixes_a) and mixes_b[:len(mixes_a)] == mixes_a:
            added += [f"mixture {m['name']}" for m in mixes_b[len(mixes_a):]]
            b["stages"]["mix"]["mixtures"] = mixes_a
        if b["stages"]["train"].pop("dense_baseline", False) and not a["stages"]["train"].pop("dense_baseline", False):
            added.append("the dense baseline")
        a["stages"].pop("report", None), b["stages"].pop("report", None)
    except (KeyError, TypeError, AttributeError):
        return [], first_difference(_without_cache(old), _without_cache(new)) or "(document)"
    return added, first_difference(a, b)


def _without_cache(doc: Any) -> Any:
    """The resolved document less the token cache's place (it holds the same tokens wherever it is)."""
    if isinstance(doc, dict) and isinstance(doc.get("data"), dict):
        return {**doc, "data": {k: v for k, v in doc["data"].items() if k != "token_cache"}}
    return doc
