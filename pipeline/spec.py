"""The resolved pipeline: what a validated pipeline file says, with every default filled in, and what
follows from it (each stage's training config, the mixture-training steps, the resolved document).

    spec = load_pipeline("tiny")                  # schema.py: read and validate the file
    spec.train_steps(spec.mixture("bam"), "compute-matched")
    branch_config(spec, "code", init="DIR/models/seed", out="DIR/runs/branch-code")   # a TrainConfig

`resolved_doc()` is what DIR/pipeline.resolved.yaml holds and what `--resume` compares; it is itself a
pipeline file (validating it gives the same document).

Compute-matched training (the paper's CM) gives every mixture the training FLOPs of the reference mixture
(`stages.train.compute_reference`, by default the first listed): steps = round(steps_ref * F_ref / F),
F = train.metrics.flops_per_token(config, seq_len) = 6 x active matmul parameters (FFN experts counted
top-k / E, soft attention experts all) + 12 x layers x seq_len x query width x attention experts run.
Every run has the same tokens per step, so equal FLOPs means steps in inverse ratio of F. A mixture whose F
is within `compute_tolerance` (1%) of the reference's is not trained twice: its data-matched run is its
compute-matched run. The paper matched TPU-core-days (wall time); FLOPs are the deterministic stand-in.

Time-matched training (`time-matched`, beside or instead of compute-matched) gives every mixture the reference's
training time on a device: steps = round(steps_ref * T / T_ref), T the model's training throughput (tokens per
second) in `stages.train.throughput` (measured by benchmarks/throughput.py on the device a user names, or given
with its source). The same tolerance makes one run serve both settings.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import yaml

from bam_surgery.runtime.config import ModelConfig
from bam_surgery.surgery.errors import BamSurgeryError
from bam_surgery.surgery.options import MergeOptions
from bam_surgery.surgery.recipe import Recipe
from bam_surgery.train.config import TrainConfig
from bam_surgery.train.metrics import flops_per_token

SCHEMA_VERSION = 1
STAGES = ("tokenizer", "seed", "branch", "mix", "train", "eval", "report")
STAGE_FIELDS = STAGES[1:]  # the YAML's stages: mapping (the tokenizer stage is data.tokenizer: {bpe: ...})
DENSE = "dense"  # the dense baselines' units: dense-dm, dense-cm (the seed continued on the mixture data)
SETTINGS = {"data-matched": "dm", "compute-matched": "cm", "time-matched": "tm"}


class PipelineError(BamSurgeryError):
    """The pipeline file is invalid; the message names the file and the field."""


# ---- the resolved pipeline ----------------------------------------------------------------------
@dataclass(frozen=True)
class Mixture:
    name: str
    recipe_spec: str  # as given: a shipped name or a path (resolved to absolute)
    recipe: Recipe
    options: MergeOptions
    config: ModelConfig  # the merged model's config
    given: dict[str, Any]  # the merge options as written in the YAML (router_seed filled in)
    flops_per_token: float  # training FLOPs per token at the pipeline's seq_len (train.metrics)


@dataclass
class PipelineSpec:
    path: str  # the pipeline file as given (for messages)
    name: str
    description: str
    seed: int
    threads: int | None
    general: str  # absolute source paths (or hf:...)
    domains: dict[str, str]
    tokenizer: str
    seq_len: int
    token_cache: str | None
    text_field: str
    knobs: dict[str, Any]  # training knobs of every run; each stage's own (seed_knobs, ...) override them
    seed_init: str | None  # a given seed checkpoint, else trained:
    seed_model: dict[str, Any] | None  # ModelConfig fields of a trained seed
    seed_knobs: dict[str, Any]
    dense_config: ModelConfig
    branch_general_share: float
    branch_lr_scale: float | None
    branch_knobs: dict[str, Any]
    mixtures: list[Mixture]
    train_general_share: float
    settings: list[str]  # data-matched, compute-matched
    compute_reference: str | None
    compute_tolerance: float
    train_knobs: dict[str, Any]
    eval_max_tokens: int
    eval_batch_size: int
    report_attention_routing: list[str]
    report_baseline: str | None
    bpe: dict[str, int] | None = None  # a tokenizer trained by the pipeline: {vocab_size, min_frequency}
    throughput: dict[str, Any] | None = None  # time-matched: {source, tokens_per_s: {mixture or dense: T}}
    branches: bool = True  # a branch stage (no stages.branch: no specialists, mixtures from the seed alone)
    dense_baseline: bool = False  # train the seed on the mixture data too (dense-dm, dense-cm)
    doc: dict[str, Any] = field(default_factory=dict)  # the resolved YAML document

    # -- derived --------------------------------------------------------------------------------
    def stage_names(self) -> list[str]:
        """The stages this pipeline runs, in order: the tokenizer stage only when it trains one."""
        return [s for s in STAGES if (s != "tokenizer" or self.bpe) and (s != "branch" or self.branches)]

    @property
    def dense_flops_per_token(self) -> float:
        return flops_per_token(self.dense_config, self.seq_len)

    def unit_flops_per_token(self, unit: str) -> float:
        """Training FLOPs per token of a unit's model: the dense seed's for `seed`, `branch-*` and the dense
        baselines `dense-*`, else the mixture's of `<setting>-<mixture>`."""
        if unit == "seed" or unit.startswith(("branch-", f"{DENSE}-")):
            return self.dense_flops_per_token
        return self.mixture(unit.split("-", 1)[1]).flops_per_token

    def mixture(self, name: str) -> Mixture:
        return next(m for m in self.mixtures if m.name == name)

    def train_steps(self, mix: Mixture, setting: str) -> int:
        """Mixture-training steps (matched_steps of the mixture)."""
        return self.matched_steps(mix.name, setting)

    def flops_of(self, key: str) -> float:
        """Training FLOPs per token of a mixture (by name) or of the dense model (DENSE)."""
        return self.dense_flops_per_token if key == DENSE else self.mixture(key).flops_per_token

    def _step_scale(self, key: str, setting: str) -> float:
        """steps_ref times this is the model's matched steps: the reference's FLOPs per token over the model's
        (compute-matched), the model's throughput over the reference's (time-matched)."""
        if setting == "time-matched":
            tps = self.throughput["tokens_per_s"]
            return tps[key] / tps[self.compute_reference]
        return self.mixture(self.compute_reference).flops_per_token / self.flops_of(key)

    def matched_steps(self, key: str, setting: str) -> int:
        """Training steps of a mixture-training run (a mixture's by name, or the dense baseline's: DENSE): the knob
        for data-matched; matched to the reference's FLOPs (compute-matched) or time (time-matched), at least 1."""
        steps = self.mixture_steps
        if setting == "data-matched" or self.trained_once(key, setting):
            return steps
        return max(1, round(steps * self._step_scale(key, setting)))

    @property
    def mixture_steps(self) -> int:
        """The data-matched mixture-training steps."""
        return {**self.knobs, **self.train_knobs}.get("steps", TrainConfig().steps)

    def trained_once(self, key: str, setting: str) -> bool:
        """A model whose cost per token (FLOPs compute-matched, time time-matched) is within compute_tolerance of the
        reference's (the reference itself; BTX with more experts at top-1; top-1 attention routing; the dense
        baseline beside BTX) has its data-matched run as its run of `setting`: it is trained once."""
        if setting == "data-matched" or "data-matched" not in self.settings or setting not in self.settings:
            return False
        if setting == "time-matched":
            return abs(1 / self._step_scale(key, setting) - 1) <= self.compute_tolerance
        return abs(self.flops_of(key) / self.mixture(self.compute_reference).flops_per_token - 1) \
            <= self.compute_tolerance

    def trained_mixtures(self) -> list[tuple[str, Mixture]]:
        """(setting, mixture) of every distinct mixture-training run, data-matched ones first."""
        return [(setting, mix) for setting in self.settings for mix in self.mixtures
                if not self.trained_once(mix.name, setting)]

    def dense_runs(self) -> list[tuple[str, str]]:
        """(setting, unit) of every distinct dense-baseline run: dense-dm trains the seed on the mixture data
        for the data-matched mixtures' tokens; dense-cm (dense-tm) for the compute reference's FLOPs (time), unless
        the dense model is trained once (trained_once: then dense-dm is both)."""
        if not self.dense_baseline:
            return []
        return [(setting, self.dense_unit(setting)) for setting in self.settings
                if not self.trained_once(DENSE, setting)]

    def dense_unit(self, setting: str) -> str:
        """The dense baseline's run of a setting: dense-dm, dense-cm or dense-tm."""
        return f"{DENSE}-{SETTINGS[self._run_setting(DENSE, setting)]}"

    def dense_steps(self, setting: str) -> int:
        """A dense baseline's steps (matched_steps of the dense model)."""
        return self.matched_steps(DENSE, setting)

    def unit_name(self, setting: str, mix: Mixture) -> str:
        """The run of (setting, mixture): dm-NAME, cm-NAME or tm-NAME."""
        return f"{SETTINGS[self._run_setting(mix.name, setting)]}-{mix.name}"

    def _run_setting(self, key: str, setting: str) -> str:
        """The setting whose run serves `setting`: data-matched for a model trained once."""
        return "data-matched" if self.trained_once(key, setting) else setting

    def data_spec(self, weights: dict[str, float]) -> str:
        """A train SPEC over the named sources ('general' or a domain) with these weights (0 left out)."""
        src = {"general": self.general, **self.domains}
        return ",".join(f"{n}={src[n]}:{_num(w)}" for n, w in weights.items() if w > 0)

    def eval_spec(self) -> str:
        return ",".join(f"{n}={s}" for n, s in {"general": self.general, **self.domains}.items())

    def eval_domains(self) -> list[str]:
        return ["general", *self.domains]


def _num(x: float) -> str:
    return repr(float(x)) if not float(x).is_integer() else str(int(x))


# ---- the training configs of each stage -----------------------------------------------------------
def _run_config(spec: PipelineSpec, knobs: dict[str, Any], **fixed: Any) -> TrainConfig:
    base = dict(seed=spec.seed, tokenizer=spec.tokenizer, seq_len=spec.seq_len, token_cache=spec.token_cache,
                text_field=spec.text_field)
    return TrainConfig.from_dict({**knobs, **base, **fixed}, where="pipeline")


def seed_config(spec: PipelineSpec, out: str, model_config: str = "seed-model.json") -> TrainConfig:
    return _run_config(spec, {**spec.knobs, **spec.seed_knobs}, model_config=model_config, out=out,
                       data=spec.data_spec({"general": 1.0}))


def branch_config(spec: PipelineSpec, domain: str, init: str, out: str) -> TrainConfig:
    g = spec.branch_general_share
    return _run_config(spec, {**spec.knobs, **spec.branch_knobs}, init=init, out=out,
                       data=spec.data_spec({domain: 1 - g, "general": g}))


def train_config(spec: PipelineSpec, mix: Mixture | None, setting: str, init: str, out: str) -> TrainConfig:
    """A mixture-training run; mix None: the dense baseline (the seed on the same data, same knobs)."""
    g = spec.train_general_share
    weights = {d: (1 - g) / len(spec.domains) for d in spec.domains}
    steps = spec.dense_steps(setting) if mix is None else spec.train_steps(mix, setting)
    return _run_config(spec, {**spec.knobs, **spec.train_knobs, "steps": steps}, init=init,
                       out=out, data=spec.data_spec({**weights, "general": g}))


# ---- the resolved document --------------------------------------------------------------------------
def resolved_doc(spec: PipelineSpec, doc: dict[str, Any]) -> dict[str, Any]:
    """The pipeline with every default filled in and paths absolute: DIR/pipeline.resolved.yaml."""
    seed_stage: dict[str, Any] = {"init": spec.seed_init} if spec.seed_init else {
        "model": spec.seed_model, "knobs": spec.seed_knobs}
    return {
        "schema": SCHEMA_VERSION, "name": spec.name, "description": spec.description, "seed": spec.seed,
        "threads": spec.threads,
        "data": {"general": spec.general, "domains": dict(spec.domains),
                 "tokenizer": {"bpe": dict(spec.bpe)} if spec.bpe else spec.tokenizer,
                 "seq_len": spec.seq_len, "token_cache": spec.token_cache, "text_field": spec.text_field},
        "knobs": dict(spec.knobs),
        "stages": {
            "seed": seed_stage,
            **({"branch": {"general_share": spec.branch_general_share, "knobs": dict(spec.branch_knobs)}}
               if spec.branches else {}),
            "mix": {"mixtures": [{"name": m.name, "recipe": m.recipe_spec, **m.given} for m in spec.mixtures]},
            "train": {"general_share": spec.train_general_share, "settings": list(spec.settings),
                      "compute_reference": spec.compute_reference, "compute_tolerance": spec.compute_tolerance,
                      **({"dense_baseline": True} if spec.dense_baseline else {}),
                      **({"throughput": spec.throughput} if spec.throughput else {}), "knobs": dict(spec.train_knobs)},
            "eval": {"max_tokens": spec.eval_max_tokens, "batch_size": spec.eval_batch_size},
            "report": {"attention_routing": list(spec.report_attention_routing), "baseline": spec.report_baseline},
        },
    }


def dump_resolved(spec: PipelineSpec) -> str:
    return yaml.safe_dump(spec.doc, sort_keys=False)


def first_difference(a: Any, b: Any, where: str = "") -> str | None:
    """The path of the first field where two documents differ (None if equal)."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in list(a) + [k for k in b if k not in a]:
            d = first_difference(a.get(k), b.get(k), f"{where}.{k}" if where else str(k))
            if d:
                return d
        return None
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            d = first_difference(x, y, f"{where}[{i}]")
            if d:
                return d
        return None
    return None if a == b else (where or "(document)")
