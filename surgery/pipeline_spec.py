"""The pipeline file: schema, validation and resolution, before any work is done.

    spec = load_pipeline("recipes/pipelines/tiny.yaml")     # or a shipped name: load_pipeline("tiny")
    spec.units(Path("runs/tiny"))                           # every unit of work, in order

A pipeline YAML (schema in recipes/pipelines/README.md) names the data (general text and one folder per
specialist domain), the tokenizer and sequence length, the seed (a checkpoint, or a model trained from a
preset on general text), the training knobs of each stage, the mixtures to build (recipe and merge options
each) and the mixture-training settings (data-matched, compute-matched). Everything is checked here, from
the YAML and from headers alone: unknown keys and stages, recipes, merge options against the mixture's
config, the data folders and their held-out splits, the tokenizer, every training run's knobs. An error
is a PipelineError naming the file and the field (`tiny.yaml: stages.mix.mixtures[1].recipe: ...`).

Resolution fills every default in; `resolved_doc()` is what DIR/pipeline.resolved.yaml holds and what
`--resume` compares. Relative data, tokenizer and seed paths are relative to the current directory (as
for every other command) and are resolved to absolute paths.

Compute-matched training (the paper's CM) gives every mixture the training FLOPs of the reference mixture
(`stages.train.compute_reference`, by default the first listed): steps = round(steps_ref * F_ref / F),
F = train.metrics.flops_per_token(config, seq_len) = 6 x active matmul parameters (FFN experts counted
top-k / E, soft attention experts all) + 12 x layers x seq_len x query width x attention experts run.
Every run has the same tokens per step, so equal FLOPs means steps in inverse ratio of F. A mixture whose F
is within `compute_tolerance` (1%) of the reference's is not trained twice: its data-matched run is its
compute-matched run. The paper matched TPU-core-days (wall time); FLOPs are the deterministic stand-in.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Callable

import yaml

from bam_surgery.runtime.config import PRESETS, ConfigError, ModelConfig, preset
from bam_surgery.train.config import TrainConfig
from bam_surgery.train.data import HUB_PREFIX, Domain, has_split
from bam_surgery.train.errors import TrainError
from bam_surgery.train.metrics import flops_per_token

from .errors import BamSurgeryError
from .plan import MergeOptions
from .recipe import Recipe, load_recipe, mixture_config

SCHEMA_VERSION = 1
STAGES = ("seed", "branch", "mix", "train", "eval", "report")
SETTINGS = {"data-matched": "dm", "compute-matched": "cm"}
TOP_LEVEL = ("schema", "name", "description", "seed", "threads", "data", "knobs", "stages")
# Knobs the pipeline sets itself for every run (a stage's knobs may not name them).
PIPELINE_KNOBS = ("init", "preset", "model_config", "data", "eval_data", "out", "seed", "tokenizer", "seq_len",
                  "token_cache", "text_field")
# Merge options a mixture may set (MergeOptions fields), with their YAML types.
MERGE_OPTIONS: dict[str, tuple[type, ...]] = {
    "seed_expert": (bool,), "extra_ffn_experts": (int,), "ffn_top_k": (int,), "attention_routing": (str, int),
    "gate_norm": (str,), "weights": (list,), "dtype": (str,), "router_seed": (int,), "router_std": (float, int),
    "shared_kv_rule": (str,), "lb_coef": (float, int), "z_coef": (float, int)}
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")
RESERVED_MODEL_NAMES = ("seed", "general")


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
    knobs: dict[str, Any]  # shared training knobs
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
    doc: dict[str, Any] = field(default_factory=dict)  # the resolved YAML document

    # -- derived --------------------------------------------------------------------------------
    def mixture(self, name: str) -> Mixture:
        return next(m for m in self.mixtures if m.name == name)

    def train_steps(self, mix: Mixture, setting: str) -> int:
        """Mixture-training steps: the knob for data-matched; FLOPs-matched to the reference for
        compute-matched (at least 1)."""
        steps = self.train_knobs["steps"]
        if setting == "data-matched" or self.same_as_data_matched(mix):
            return steps
        ref = self.mixture(self.compute_reference)
        return max(1, round(steps * ref.flops_per_token / mix.flops_per_token))

    def same_as_data_matched(self, mix: Mixture) -> bool:
        """A mixture whose FLOPs per token are within compute_tolerance of the reference's (the reference
        itself; BTX with more experts at top-1; top-1 attention routing) has its data-matched run as its
        compute-matched run: it is trained once."""
        if "data-matched" not in self.settings or "compute-matched" not in self.settings:
            return False
        ref = self.mixture(self.compute_reference)
        return abs(mix.flops_per_token / ref.flops_per_token - 1) <= self.compute_tolerance

    def trained_mixtures(self) -> list[tuple[str, Mixture]]:
        """(setting, mixture) of every distinct mixture-training run, data-matched ones first."""
        return [(setting, mix) for setting in self.settings for mix in self.mixtures
                if not (setting == "compute-matched" and self.same_as_data_matched(mix))]

    def unit_name(self, setting: str, mix: Mixture) -> str:
        """The run of (setting, mixture): dm-NAME or cm-NAME."""
        if setting == "compute-matched" and self.same_as_data_matched(mix):
            setting = "data-matched"
        return f"{SETTINGS[setting]}-{mix.name}"

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


# ---- loading --------------------------------------------------------------------------------------
def shipped_pipelines() -> list[str]:
    root = resources.files("bam_surgery.recipes") / "pipelines"
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".yaml")) if root.is_dir() else []


def pipeline_path(spec: str) -> Path:
    """A pipeline file by path, or a shipped one by name (recipes/pipelines/NAME.yaml)."""
    path = Path(spec)
    if spec.endswith((".yaml", ".yml")) or "/" in spec:
        if not path.is_file():
            raise PipelineError(f"pipeline {spec}: file not found")
        return path
    shipped = resources.files("bam_surgery.recipes") / "pipelines" / f"{spec}.yaml"
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", spec) or not shipped.is_file():
        raise PipelineError(f"pipeline {spec!r}: no such pipeline; choose one of {', '.join(shipped_pipelines())} "
                            "or give the path of a .yaml file")
    return Path(str(shipped))


def load_pipeline(spec: str, check_data: bool = True, seed: int | None = None) -> PipelineSpec:
    """Read, validate and resolve a pipeline file. check_data=False skips what needs the data and
    checkpoints on disk (sources, tokenizer file, a given seed): the schema and numbers alone. `seed`
    replaces the file's seed (a replication of the same pipeline)."""
    path = pipeline_path(spec)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise PipelineError(f"{spec}: cannot read ({e})") from None
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise PipelineError(f"{spec}: not valid YAML ({' '.join(str(e).split())})") from None
    if seed is not None and isinstance(doc, dict):
        doc["seed"] = seed
    return _Validator(spec, check_data).pipeline(doc)


def spec_from_doc(doc: dict[str, Any], where: str, check_data: bool = True) -> PipelineSpec:
    """Validate an already parsed document (a resolved pipeline read back)."""
    return _Validator(where, check_data).pipeline(doc)


# ---- validation -------------------------------------------------------------------------------------
class _Validator:
    def __init__(self, where: str, check_data: bool):
        self.where, self.check_data = where, check_data

    def fail(self, field_: str, msg: str) -> None:
        raise PipelineError(f"{self.where}: {field_}: {msg}")

    def mapping(self, value: Any, field_: str, allowed: tuple[str, ...] | None, required: tuple[str, ...] = ()
                ) -> dict[str, Any]:
        if value is None:
            value = {}
        if not isinstance(value, dict):
            self.fail(field_, f"expected a mapping, got {type(value).__name__}")
        if allowed is not None:
            for key in value:
                if key not in allowed:
                    close = difflib.get_close_matches(str(key), allowed, n=1)
                    hint = f" (did you mean {close[0]}?)" if close else f" (allowed: {', '.join(allowed)})"
                    self.fail(f"{field_}.{key}" if field_ else str(key), f"unknown field{hint}")
        for key in required:
            if key not in value or value[key] is None:
                self.fail(f"{field_}.{key}" if field_ else key, "required")
        return value

    def typed(self, value: Any, field_: str, types: tuple[type, ...], check: Callable[[Any], bool] | None = None,
              need: str = "") -> Any:
        ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in types)
        if float in types and isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as a string
            try:
                value, ok = float(value), True
            except ValueError:
                pass
        if not ok:
            self.fail(field_, f"expected {' or '.join(t.__name__ for t in types)}, got {value!r}")
        if isinstance(value, float) and not math.isfinite(value):
            self.fail(field_, f"must be a finite number, got {value!r}")
        if check is not None and not check(value):
            self.fail(field_, f"must be {need}, got {value!r}")
        return value

    # -- the document ---------------------------------------------------------------------------------
    def pipeline(self, doc: Any) -> PipelineSpec:
        doc = self.mapping(doc, "", TOP_LEVEL, required=("name", "data", "stages"))
        schema = doc.get("schema", SCHEMA_VERSION)
        if schema != SCHEMA_VERSION:
            self.fail("schema", f"this tool reads schema {SCHEMA_VERSION}, the file says {schema!r}")
        name = self.typed(doc["name"], "name", (str,), lambda v: bool(_NAME.match(v)),
                          "letters, digits, '-', '_', '.'")
        description = str(doc.get("description") or "").strip()
        seed = self.typed(doc.get("seed", 0), "seed", (int,), lambda v: v >= 0, ">= 0")
        threads = doc.get("threads")
        if threads is not None:
            self.typed(threads, "threads", (int,), lambda v: v >= 1, ">= 1")
        data = self.data(doc["data"])
        knobs = self.knobs(doc.get("knobs"), "knobs")
        stages = self.mapping(doc["stages"], "stages", STAGES, required=("seed", "branch", "mix", "train"))
        seed_init, seed_model, seed_knobs, dense = self.seed_stage(stages["seed"], data, knobs)
        seq_len = data["seq_len"] if data["seq_len"] is not None else dense.max_positions
        if seq_len > dense.max_positions:
            self.fail("data.seq_len", f"{seq_len} exceeds the seed's max_positions ({dense.max_positions})")
        tokenizer = self.tokenizer(data["tokenizer"], dense, seed_init)
        branch = self.mapping(stages["branch"], "stages.branch", ("general_share", "lr_scale", "knobs"))
        b_share = self.share(branch.get("general_share", 0.1), "stages.branch.general_share")
        b_knobs = self.knobs(branch.get("knobs"), "stages.branch.knobs")
        lr_scale = branch.get("lr_scale")
        if "lr" in b_knobs:
            if lr_scale is not None:
                self.fail("stages.branch.lr_scale", "give lr_scale or knobs.lr, not both")
        else:
            if seed_init is not None:
                self.fail("stages.branch.knobs.lr", "required when the seed is a given checkpoint (stages.seed.init): "
                          "the paper uses half the seed's pretraining peak")
            lr_scale = 0.5 if lr_scale is None else self.typed(lr_scale, "stages.branch.lr_scale", (float, int),
                                                               lambda v: v > 0, "> 0")
            b_knobs = {**b_knobs, "lr": float({**knobs, **seed_knobs}.get("lr", TrainConfig().lr)) * lr_scale}
        mixtures = self.mix_stage(stages["mix"], dense, len(data["domains"]), seed, seq_len)
        train = self.mapping(stages["train"], "stages.train",
                             ("general_share", "settings", "compute_reference", "compute_tolerance", "knobs"))
        t_share = self.share(train.get("general_share", 0.25), "stages.train.general_share")
        settings = self.settings(train.get("settings", list(SETTINGS)))
        names = [m.name for m in mixtures]
        ref = train.get("compute_reference")
        if ref is not None and ref not in names:
            self.fail("stages.train.compute_reference", f"{ref!r} is not a mixture of stages.mix "
                      f"({', '.join(names)})")
        ref = ref or (names[0] if "compute-matched" in settings else None)
        tolerance = float(self.typed(train.get("compute_tolerance", 0.01), "stages.train.compute_tolerance",
                                     (float, int), lambda v: 0 <= v < 1, "in [0, 1)"))
        t_knobs = self.knobs(train.get("knobs"), "stages.train.knobs")
        ev = self.mapping(stages.get("eval"), "stages.eval", ("max_tokens", "batch_size"))
        max_tokens = self.typed(ev.get("max_tokens", 0), "stages.eval.max_tokens", (int,), lambda v: v >= 0, ">= 0")
        batch = self.typed(ev.get("batch_size", 8), "stages.eval.batch_size", (int,), lambda v: v >= 1, ">= 1")
        rep = self.mapping(stages.get("report"), "stages.report", ("attention_routing", "baseline"))
        routing = self.name_list(rep.get("attention_routing", []), "stages.report.attention_routing", names)
        for r in routing:
            if not next(m for m in mixtures if m.name == r).config.attn_experts:
                self.fail("stages.report.attention_routing", f"mixture {r!r} has no attention experts to route")
        baseline = rep.get("baseline", ref if ref else names[0])
        if baseline not in names:
            self.fail("stages.report.baseline", f"{baseline!r} is not a mixture of stages.mix ({', '.join(names)})")

        spec = PipelineSpec(
            path=self.where, name=name, description=description, seed=seed, threads=threads,
            general=data["general"], domains=data["domains"], tokenizer=tokenizer, seq_len=seq_len,
            token_cache=data["token_cache"], text_field=data["text_field"], knobs=knobs, seed_init=seed_init,
            seed_model=seed_model, seed_knobs=seed_knobs, dense_config=dense, branch_general_share=b_share,
            branch_lr_scale=lr_scale, branch_knobs=b_knobs, mixtures=mixtures, train_general_share=t_share,
            settings=settings, compute_reference=ref, compute_tolerance=tolerance, train_knobs={**knobs, **t_knobs},
            eval_max_tokens=max_tokens, eval_batch_size=batch, report_attention_routing=routing,
            report_baseline=baseline)
        spec.train_knobs.setdefault("steps", TrainConfig().steps)
        self.check_runs(spec)
        spec.doc = resolved_doc(spec, doc)
        return spec

    def data(self, value: Any) -> dict[str, Any]:
        d = self.mapping(value, "data", ("general", "domains", "tokenizer", "seq_len", "token_cache", "text_field"),
                         required=("general", "domains"))
        general = self.source(d["general"], "data.general")
        domains_in = self.mapping(d["domains"], "data.domains", None)
        if not domains_in:
            self.fail("data.domains", "no domains; name at least one: NAME: FOLDER")
        domains = {}
        for n, src in domains_in.items():
            if not isinstance(n, str) or not _NAME.match(n):
                self.fail(f"data.domains.{n}", "a domain name is letters, digits, '-', '_', '.'")
            if n in RESERVED_MODEL_NAMES:
                self.fail(f"data.domains.{n}", f"{n!r} is reserved (the seed and the general text); rename it")
            domains[n] = self.source(src, f"data.domains.{n}")
        seq_len = d.get("seq_len")
        if seq_len is not None:
            self.typed(seq_len, "data.seq_len", (int,), lambda v: v >= 1, ">= 1")
        cache = d.get("token_cache")
        if cache is not None:
            cache = str(Path(self.typed(cache, "data.token_cache", (str,))).expanduser().resolve())
        tok = d.get("tokenizer")
        if tok is not None:
            self.typed(tok, "data.tokenizer", (str,))
        return dict(general=general, domains=domains, tokenizer=tok, seq_len=seq_len, token_cache=cache,
                    text_field=self.typed(d.get("text_field", "text"), "data.text_field", (str,)))

    def source(self, value: Any, field_: str) -> str:
        src = self.typed(value, field_, (str,))
        if "," in src or "=" in src:
            self.fail(field_, f"{src!r}: a data source may not contain ',' or '='")
        if src.startswith(HUB_PREFIX):
            return src  # a hub dataset: checked when it is read
        path = Path(src).expanduser().resolve()
        if self.check_data:
            if not path.exists():
                self.fail(field_, f"{src}: no such file or folder")
            try:
                if not has_split(Domain(field_.rsplit(".", 1)[-1], str(path), 1.0), "val"):
                    self.fail(field_, f"{src}: no held-out split (a folder with train* and val* files); the "
                              "eval stage needs one")
            except TrainError as e:
                self.fail(field_, str(e))
        return str(path)

    def share(self, value: Any, field_: str) -> float:
        return float(self.typed(value, field_, (float, int), lambda v: 0 <= v < 1, "in [0, 1)"))

    def knobs(self, value: Any, field_: str) -> dict[str, Any]:
        known = tuple(f.name for f in dataclasses.fields(TrainConfig))
        knobs = dict(self.mapping(value, field_, known))
        for k in knobs:
            if k in PIPELINE_KNOBS:
                self.fail(f"{field_}.{k}", "set by the pipeline for every run (data:, seed:, the stage's model); "
                          "remove it")
        try:  # types and values, as train would check them
            cfg = TrainConfig.from_dict({**knobs, "preset": "tiny", "data": "x=y", "out": "x"}, where=field_)
            cfg.validate()
        except TrainError as e:
            raise PipelineError(f"{self.where}: {e}" if str(e).startswith(field_) else
                                f"{self.where}: {field_}.{e}") from None
        return {k: getattr(cfg, k) for k in knobs}  # normalized: '3e-4' read as a float

    def seed_stage(self, value: Any, data: dict, knobs: dict) -> tuple[str | None, dict | None, dict, ModelConfig]:
        s = self.mapping(value, "stages.seed", ("init", "preset", "model", "knobs"))
        if s.get("init") is not None:
            for k in ("preset", "model", "knobs"):
                if s.get(k) is not None:
                    self.fail(f"stages.seed.{k}", "a given seed (init) is not trained; remove it or init")
            init = self.typed(s["init"], "stages.seed.init", (str,))
            return self.given_seed(init)
        name = s.get("preset")
        model = self.mapping(s.get("model"), "stages.seed.model", None)
        if name is None and not model:
            self.fail("stages.seed", "give init (a checkpoint), or preset and/or model (a model to train)")
        if name is not None and name not in PRESETS:
            self.fail("stages.seed.preset", f"{name!r}: unknown preset; choose one of {', '.join(PRESETS)}")
        try:
            cfg = preset(name, **model) if name else ModelConfig(**model)
        except (ConfigError, TypeError) as e:
            self.fail("stages.seed.model", " ".join(str(e).split()))
        if cfg.is_mixture:
            self.fail("stages.seed.model", "the seed is dense (ffn_experts and attn_experts 0)")
        seed_knobs = self.knobs(s.get("knobs"), "stages.seed.knobs")
        return None, cfg.to_dict(), seed_knobs, cfg

    def given_seed(self, init: str) -> tuple[str, None, dict, ModelConfig]:
        """A given seed checkpoint: its config from the header, and the local path models/seed links to (a
        hub id's snapshot folder)."""
        if not self.check_data:
            raise PipelineError(f"{self.where}: stages.seed.init: a given seed is read to check the pipeline")
        from bam_surgery.converters import open_checkpoint

        from .errors import USER_ERRORS

        try:
            with open_checkpoint(init) as reader:
                cfg = reader.config
                local = Path(reader.source_dir or reader.path or init)
        except (OSError, *USER_ERRORS) as e:
            self.fail("stages.seed.init", " ".join(str(e).split()) or type(e).__name__)
        if cfg.is_mixture:
            self.fail("stages.seed.init", f"{init} is a mixture; the seed is a dense checkpoint")
        if not local.exists():
            self.fail("stages.seed.init", f"{init}: not a local checkpoint the pipeline can link to")
        return str(local.expanduser().resolve()), None, {}, cfg

    def tokenizer(self, tok: str | None, dense: ModelConfig, seed_init: str | None) -> str:
        if tok is None:
            if seed_init is not None:
                from bam_surgery.converters import open_checkpoint
                from bam_surgery.train.tokenize import checkpoint_tokenizer

                with open_checkpoint(seed_init) as reader:
                    carried = checkpoint_tokenizer(reader)
                if carried:
                    return carried
            if dense.vocab_size <= 512:
                return "bytes"
            self.fail("data.tokenizer", f"required for a vocabulary of {dense.vocab_size} tokens (a tokenizer.json "
                      "file or folder); merged mixtures carry no tokenizer, so every stage names it")
        if tok == "bytes":
            if dense.vocab_size < 256:
                self.fail("data.tokenizer", f"bytes needs vocab_size >= 256 (the seed has {dense.vocab_size})")
            return tok
        path = Path(tok).expanduser().resolve()
        if self.check_data and not (path.is_file() or (path / "tokenizer.json").is_file()):
            self.fail("data.tokenizer", f"{tok}: no tokenizer.json there")
        return str(path)

    def mix_stage(self, value: Any, dense: ModelConfig, n_domains: int, seed: int, seq_len: int) -> list[Mixture]:
        m = self.mapping(value, "stages.mix", ("mixtures",), required=("mixtures",))
        entries = m["mixtures"]
        if not isinstance(entries, list) or not entries:
            self.fail("stages.mix.mixtures", "a list of at least one mixture ({name, recipe, options...})")
        out: list[Mixture] = []
        for i, entry in enumerate(entries):
            where = f"stages.mix.mixtures[{i}]"
            e = self.mapping(entry, where, ("name", "recipe", *MERGE_OPTIONS), required=("name", "recipe"))
            name = self.typed(e["name"], f"{where}.name", (str,), lambda v: bool(_NAME.match(v)),
                              "letters, digits, '-', '_', '.'")
            if any(x.name == name for x in out):
                self.fail(f"{where}.name", f"{name!r} appears twice")
            recipe_spec = self.typed(e["recipe"], f"{where}.recipe", (str,))
            try:
                recipe = load_recipe(recipe_spec)
            except BamSurgeryError as err:
                self.fail(f"{where}.recipe", " ".join(str(err).split()))
            if recipe.max_experts == 0:
                self.fail(f"{where}.recipe", f"recipe {recipe.name} takes no experts; a pipeline mixes specialists")
            if "/" in recipe_spec or recipe_spec.endswith((".yaml", ".yml")):
                recipe_spec = str(Path(recipe_spec).resolve())
            given = {k: e[k] for k in MERGE_OPTIONS if k in e}
            for k, v in given.items():
                self.typed(v, f"{where}.{k}", MERGE_OPTIONS[k])
            given.setdefault("router_seed", seed)
            try:
                options = MergeOptions(**{k: (tuple(float(w) for w in v) if k == "weights" else v)
                                          for k, v in given.items()})
                n_members = n_domains + (1 if (recipe.defaults["seed_expert"] if options.seed_expert is None
                                               else options.seed_expert) else 0)
                if options.weights is not None and len(options.weights) != n_members:
                    self.fail(f"{where}.weights", f"{len(options.weights)} weights for {n_members} mixture members")
                cfg = mixture_config(recipe, dense, n_members, ffn_top_k=options.ffn_top_k,
                                     attn_top_k=options.attention_routing,
                                     extra_ffn_experts=options.extra_ffn_experts, gate_norm=options.gate_norm,
                                     lb_coef=options.lb_coef, z_coef=options.z_coef)
            except (ConfigError, TypeError, ValueError) as err:
                self.fail(where, " ".join(str(err).split()))
            out.append(Mixture(name, recipe_spec, recipe, options, cfg, given, flops_per_token(cfg, seq_len)))
        return out

    def settings(self, value: Any) -> list[str]:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not value:
            self.fail("stages.train.settings", f"a list of {', '.join(SETTINGS)}")
        for v in value:
            if v not in SETTINGS:
                self.fail("stages.train.settings", f"{v!r} is not one of {', '.join(SETTINGS)}")
        return [s for s in SETTINGS if s in value]

    def name_list(self, value: Any, field_: str, names: list[str]) -> list[str]:
        if not isinstance(value, list):
            self.fail(field_, "a list of mixture names")
        for v in value:
            if v not in names:
                self.fail(field_, f"{v!r} is not a mixture of stages.mix ({', '.join(names)})")
        return list(value)

    def check_runs(self, spec: PipelineSpec) -> None:
        """Every training run's TrainConfig, as train() will check it; the batch divides evenly."""
        for field_, cfg in (("stages.seed.knobs", seed_config(spec, "x") if spec.seed_init is None else None),
                            ("stages.branch.knobs", branch_config(spec, next(iter(spec.domains)), "x", "x")),
                            ("stages.train.knobs", train_config(spec, spec.mixtures[0], "data-matched", "x", "x"))):
            if cfg is None:
                continue
            try:
                cfg.validate()
            except TrainError as e:
                self.fail(field_, str(e))
            per_micro = cfg.micro_batch * spec.seq_len
            if cfg.batch_tokens is not None and cfg.batch_tokens % per_micro:
                self.fail(f"{field_}.batch_tokens", f"{cfg.batch_tokens} is not a multiple of micro_batch * seq_len "
                          f"= {cfg.micro_batch} * {spec.seq_len}")


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


def train_config(spec: PipelineSpec, mix: Mixture, setting: str, init: str, out: str) -> TrainConfig:
    g = spec.train_general_share
    weights = {d: (1 - g) / len(spec.domains) for d in spec.domains}
    return _run_config(spec, {**spec.train_knobs, "steps": spec.train_steps(mix, setting)}, init=init, out=out,
                       data=spec.data_spec({**weights, "general": g}))


# ---- the resolved document --------------------------------------------------------------------------
def resolved_doc(spec: PipelineSpec, doc: dict[str, Any]) -> dict[str, Any]:
    """The pipeline with every default filled in and paths absolute: DIR/pipeline.resolved.yaml."""
    seed_stage: dict[str, Any] = {"init": spec.seed_init} if spec.seed_init else {
        "model": spec.seed_model, "knobs": spec.seed_knobs}
    return {
        "schema": SCHEMA_VERSION, "name": spec.name, "description": spec.description, "seed": spec.seed,
        "threads": spec.threads,
        "data": {"general": spec.general, "domains": dict(spec.domains), "tokenizer": spec.tokenizer,
                 "seq_len": spec.seq_len, "token_cache": spec.token_cache, "text_field": spec.text_field},
        "knobs": dict(spec.knobs),
        "stages": {
            "seed": seed_stage,
            "branch": {"general_share": spec.branch_general_share, "knobs": dict(spec.branch_knobs)},
            "mix": {"mixtures": [{"name": m.name, "recipe": m.recipe_spec, **m.given} for m in spec.mixtures]},
            "train": {"general_share": spec.train_general_share, "settings": list(spec.settings),
                      "compute_reference": spec.compute_reference, "compute_tolerance": spec.compute_tolerance,
                      "knobs": {k: v for k, v in spec.train_knobs.items()
                                if k not in spec.knobs or spec.knobs[k] != v}},
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
