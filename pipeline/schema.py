"""The pipeline file: reading and validation, before any work is done.

    spec = load_pipeline("recipes/pipelines/tiny.yaml")     # or a shipped name: load_pipeline("tiny")

A pipeline YAML (schema in recipes/pipelines/README.md) names the data (general text and one folder per
specialist domain), the tokenizer and sequence length, the seed (a checkpoint, or a model trained from a
preset on general text), the training knobs of each stage, the mixtures to build (recipe and merge options
each) and the mixture-training settings (data-matched, compute-matched). Everything is checked here, from
the YAML and from headers alone: unknown keys and stages, recipes, merge options against the mixture's
config, the data folders and their held-out splits, the tokenizer, every training run's knobs. An error
is a PipelineError naming the file and the field (`tiny.yaml: stages.mix.mixtures[1].recipe: ...`). The
result is a spec.PipelineSpec.

Relative data, tokenizer, seed and recipe paths are relative to the current directory (as for every other
command) and are resolved to absolute paths.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import re
from importlib import resources
from pathlib import Path
from typing import Any, Callable

from bam_surgery.converters import open_checkpoint
from bam_surgery.converters.yamlfile import read_yaml, shown
from bam_surgery.runtime.config import PRESETS, ConfigError, ModelConfig, preset
from bam_surgery.runtime.errors import UserError, printable
from bam_surgery.runtime.jsonfile import read_json
from bam_surgery.surgery.errors import BamSurgeryError
from bam_surgery.surgery.options import PIPELINE_OPTIONS, MergeOptions
from bam_surgery.surgery.recipe import load_recipe, mixture_config
from bam_surgery.train.bpe import MAX_VOCAB as BPE_MAX_VOCAB
from bam_surgery.train.bpe import MIN_VOCAB as BPE_MIN_VOCAB
from bam_surgery.train.config import TrainConfig
from bam_surgery.train.data import HUB_PREFIX, Domain, has_split
from bam_surgery.train.errors import TrainError
from bam_surgery.train.metrics import flops_per_token
from bam_surgery.train.tokenize import checkpoint_tokenizer

from .spec import (DENSE, SCHEMA_VERSION, SETTINGS, STAGE_FIELDS, Mixture, PipelineError, PipelineSpec, branch_config, resolved_doc,
                   seed_config, train_config)

TRAINED_TOKENIZER = "(trained by the tokenizer stage: DIR/tokenizer/tokenizer.json)"  # PipelineRun sets the path
MAX_THREADS = 1024  # intra-op threads: more than any CPU has; libgomp runs out of memory near 1e9
TOP_LEVEL = ("schema", "name", "description", "seed", "threads", "data", "knobs", "stages")
# Knobs the pipeline sets itself for every run (a stage's knobs may not name them).
PIPELINE_KNOBS = ("init", "preset", "model_config", "data", "eval_data", "out", "seed", "tokenizer", "seq_len",
                  "token_cache", "text_field")
# Merge options a mixture may set, with their YAML types: those of surgery/options.py:MergeOptions that have some.
MERGE_OPTIONS = PIPELINE_OPTIONS
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")
RESERVED_MODEL_NAMES = ("seed", "general")


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
        doc = read_yaml(path, spec, error=PipelineError)  # bounded: converters/yamlfile.py
    except FileNotFoundError:
        raise PipelineError(f"pipeline {spec}: file not found") from None
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
        raise PipelineError(f"{self.where}: {printable(field_)[:120]}: {msg}")

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
            self.fail(field_, f"expected {' or '.join(t.__name__ for t in types)}, got {shown(value)}")
        if isinstance(value, float) and not math.isfinite(value):
            self.fail(field_, f"must be a finite number, got {shown(value)}")
        if check is not None and not check(value):
            self.fail(field_, f"must be {need}, got {shown(value)}")
        return value

    # -- the document ---------------------------------------------------------------------------------
    def pipeline(self, doc: Any) -> PipelineSpec:
        doc = self.mapping(doc, "", TOP_LEVEL, required=("name", "data", "stages"))
        schema = doc.get("schema", SCHEMA_VERSION)
        if schema != SCHEMA_VERSION:
            self.fail("schema", f"this tool reads schema {SCHEMA_VERSION}, the file says {shown(schema)}")
        name = self.typed(doc["name"], "name", (str,), lambda v: bool(_NAME.match(v)),
                          "letters, digits, '-', '_', '.'")
        description = str(doc.get("description") or "").strip()
        seed = self.typed(doc.get("seed", 0), "seed", (int,), lambda v: v >= 0, ">= 0")
        threads = doc.get("threads")
        if threads is not None:
            self.typed(threads, "threads", (int,), lambda v: 1 <= v <= MAX_THREADS, f"in [1, {MAX_THREADS}]")
        data = self.data(doc["data"])
        knobs = self.knobs(doc.get("knobs"), "knobs")
        stages = self.mapping(doc["stages"], "stages", STAGE_FIELDS, required=("seed", "mix", "train"))
        seed_init, seed_model, seed_knobs, dense = self.seed_stage(stages["seed"], data, knobs)
        seq_len = data["seq_len"] if data["seq_len"] is not None else dense.max_positions
        if seq_len > dense.max_positions:
            self.fail("data.seq_len", f"{seq_len} exceeds the seed's max_positions ({dense.max_positions})")
        bpe = self.bpe(data["tokenizer"], dense, seed_init)
        tokenizer = TRAINED_TOKENIZER if bpe else self.tokenizer(data["tokenizer"], dense, seed_init)
        branches = "branch" in stages  # without one: no specialists, every mixture from the seed alone (upcycle)
        b_share, lr_scale, b_knobs = self.branch_stage(stages["branch"], seed_init, {**knobs, **seed_knobs}) \
            if branches else (0.0, None, {})
        mixtures = self.mix_stage(stages["mix"], dense, len(data["domains"]), seed, seq_len, branches)
        t_share, settings, ref, tolerance, dense_baseline, t_knobs = self.train_stage(stages["train"],
                                                                                      [m.name for m in mixtures])
        throughput = self.throughput(stages["train"], settings, [m.name for m in mixtures], dense_baseline)
        ev = self.mapping(stages.get("eval"), "stages.eval", ("max_tokens", "batch_size"))
        max_tokens = self.typed(ev.get("max_tokens", 0), "stages.eval.max_tokens", (int,), lambda v: v >= 0, ">= 0")
        batch = self.typed(ev.get("batch_size", 8), "stages.eval.batch_size", (int,), lambda v: v >= 1, ">= 1")
        routing, baseline = self.report_stage(stages.get("report"), mixtures, ref)

        spec = PipelineSpec(
            path=self.where, name=name, description=description, seed=seed, threads=threads,
            general=data["general"], domains=data["domains"], tokenizer=tokenizer, seq_len=seq_len,
            token_cache=data["token_cache"], text_field=data["text_field"], knobs=knobs, seed_init=seed_init,
            seed_model=seed_model, seed_knobs=seed_knobs, dense_config=dense, branch_general_share=b_share,
            branch_lr_scale=lr_scale, branch_knobs=b_knobs, mixtures=mixtures, train_general_share=t_share,
            settings=settings, compute_reference=ref, compute_tolerance=tolerance, train_knobs=t_knobs,
            eval_max_tokens=max_tokens, eval_batch_size=batch, report_attention_routing=routing,
            report_baseline=baseline, bpe=bpe, dense_baseline=dense_baseline, throughput=throughput,
            branches=branches)
        self.check_runs(spec)
        spec.doc = resolved_doc(spec, doc)
        return spec

    def branch_stage(self, value: Any, seed_init: str | None, seed_knobs: dict[str, Any]
                     ) -> tuple[float, float | None, dict[str, Any]]:
        """(general share, lr scale, knobs with the peak lr filled in)."""
        branch = self.mapping(value, "stages.branch", ("general_share", "lr_scale", "knobs"))
        share = self.share(branch.get("general_share", 0.1), "stages.branch.general_share")
        knobs = self.knobs(branch.get("knobs"), "stages.branch.knobs")
        lr_scale = branch.get("lr_scale")
        if "lr" in knobs:
            if lr_scale is not None:
                self.fail("stages.branch.lr_scale", "give lr_scale or knobs.lr, not both")
            return share, None, knobs
        if seed_init is not None:
            self.fail("stages.branch.knobs.lr", "required when the seed is a given checkpoint (stages.seed.init): "
                      "the paper uses half the seed's pretraining peak")
        lr_scale = 0.5 if lr_scale is None else self.typed(lr_scale, "stages.branch.lr_scale", (float, int),
                                                           lambda v: v > 0, "> 0")
        return share, lr_scale, {**knobs, "lr": float(seed_knobs.get("lr", TrainConfig().lr)) * lr_scale}

    def train_stage(self, value: Any, names: list[str]) -> tuple[float, list[str], str | None, float, bool, dict]:
        """(general share, settings, compute reference, compute tolerance, dense baseline, knobs)."""
        train = self.mapping(value, "stages.train", ("general_share", "settings", "compute_reference",
                                                     "compute_tolerance", "dense_baseline", "throughput", "knobs"))
        share = self.share(train.get("general_share", 0.25), "stages.train.general_share")
        settings = self.settings(train.get("settings", ["data-matched", "compute-matched"]))
        ref = train.get("compute_reference")
        if ref is not None and ref not in names:
            self.fail("stages.train.compute_reference",
                      f"{shown(ref)} is not a mixture of stages.mix ({', '.join(names)})")
        ref = ref or (names[0] if {"compute-matched", "time-matched"} & set(settings) else None)
        tolerance = float(self.typed(train.get("compute_tolerance", 0.01), "stages.train.compute_tolerance",
                                     (float, int), lambda v: 0 <= v < 1, "in [0, 1)"))
        dense = self.typed(train.get("dense_baseline", False), "stages.train.dense_baseline", (bool,))
        return share, settings, ref, tolerance, dense, self.knobs(train.get("knobs"), "stages.train.knobs")

    def throughput(self, train: dict[str, Any], settings: list[str], names: list[str], dense: bool
                   ) -> dict[str, Any] | None:
        """stages.train.throughput (time-matched): a JSON file benchmarks/throughput.py wrote, or {source,
        tokens_per_s: {NAME: tokens/s}} given; a number for every mixture (and `dense` with the dense baseline)."""
        where = "stages.train.throughput"
        value = train.get("throughput")
        if "time-matched" not in settings:
            if value is not None:
                self.fail(where, "only the time-matched setting reads it (add time-matched to stages.train.settings)")
            return None
        if value is None:
            self.fail(where, "required by time-matched: each mixture's training tokens per second on the device "
                      "matched (python -m benchmarks.throughput PIPELINE --device DEVICE writes them), or given")
        if isinstance(value, str):  # a path as the data's are: from the working folder
            path = Path(value).expanduser()
            if not path.is_file():
                self.fail(where, f"{value}: no such file")
            value = read_json(path, expect=dict, error=PipelineError)
        t = self.mapping(value, where, ("source", "device", "tokens_per_s"), required=("source", "tokens_per_s"))
        source = self.typed(t["source"], f"{where}.source", (str,), lambda v: bool(v.strip()), "where the numbers come "
                            "from (device, how measured)")
        tps = self.mapping(t["tokens_per_s"], f"{where}.tokens_per_s", None)
        needed = names + ([DENSE] if dense else [])
        for n in needed:
            if n not in tps:
                self.fail(f"{where}.tokens_per_s", f"no number for {n} (it needs one for each of {', '.join(needed)})")
        out = {n: float(self.typed(tps[n], f"{where}.tokens_per_s.{n}", (int, float),
                                   lambda v: math.isfinite(v) and v > 0, "> 0")) for n in needed}
        return {"source": source, **({"device": str(t["device"])} if "device" in t else {}), "tokens_per_s": out}

    def report_stage(self, value: Any, mixtures: list[Mixture], ref: str | None) -> tuple[list[str], str]:
        """(the attention-routing comparison's mixtures, its baseline)."""
        names = [m.name for m in mixtures]
        rep = self.mapping(value, "stages.report", ("attention_routing", "baseline"))
        routing = self.name_list(rep.get("attention_routing", []), "stages.report.attention_routing", names)
        for r in routing:
            if not next(m for m in mixtures if m.name == r).config.attn_experts:
                self.fail("stages.report.attention_routing", f"mixture {shown(r)} has no attention experts to route")
        baseline = rep.get("baseline", ref or names[0])
        if baseline not in names:
            self.fail("stages.report.baseline",
                      f"{shown(baseline)} is not a mixture of stages.mix ({', '.join(names)})")
        return routing, baseline

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
                self.fail(f"data.domains.{n}", f"{shown(n)} is reserved (the seed and the general text); rename it")
            domains[n] = self.source(src, f"data.domains.{n}")
        seq_len = d.get("seq_len")
        if seq_len is not None:
            self.typed(seq_len, "data.seq_len", (int,), lambda v: v >= 1, ">= 1")
        cache = d.get("token_cache")
        if cache is not None:
            cache = str(Path(self.typed(cache, "data.token_cache", (str,))).expanduser().resolve())
        tok = d.get("tokenizer")
        if tok is not None:
            self.typed(tok, "data.tokenizer", (str, dict))
        return dict(general=general, domains=domains, tokenizer=tok, seq_len=seq_len, token_cache=cache,
                    text_field=self.typed(d.get("text_field", "text"), "data.text_field", (str,)))

    def source(self, value: Any, field_: str) -> str:
        src = self.typed(value, field_, (str,))
        if "," in src or "=" in src:
            self.fail(field_, f"{shown(src)}: a data source may not contain ',' or '='")
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
            self.fail("stages.seed.preset", f"{shown(name)}: unknown preset; choose one of {', '.join(PRESETS)}")
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

        try:
            with open_checkpoint(init) as reader:
                cfg = reader.config
                local = Path(reader.source_dir or reader.path or init)
        except (OSError, UserError) as e:
            self.fail("stages.seed.init", " ".join(str(e).split()) or type(e).__name__)
        if cfg.is_mixture:
            self.fail("stages.seed.init", f"{init} is a mixture; the seed is a dense checkpoint")
        if not local.exists():
            self.fail("stages.seed.init", f"{init}: not a local checkpoint the pipeline can link to")
        return str(local.expanduser().resolve()), None, {}, cfg

    def bpe(self, tok: Any, dense: ModelConfig, seed_init: str | None) -> dict[str, int] | None:
        """data.tokenizer: {bpe: {vocab_size: N, min_frequency: 2}}: the tokenizer stage trains one on the
        train split of every source (train/bpe.py); None for a given tokenizer."""
        if not isinstance(tok, dict):
            return None
        spec = self.mapping(tok, "data.tokenizer", ("bpe",), required=("bpe",))
        bpe = self.mapping(spec["bpe"], "data.tokenizer.bpe", ("vocab_size", "min_frequency"), required=("vocab_size",))
        vocab = self.typed(bpe["vocab_size"], "data.tokenizer.bpe.vocab_size", (int,),
                           lambda v: BPE_MIN_VOCAB <= v <= BPE_MAX_VOCAB, f"in [{BPE_MIN_VOCAB}, {BPE_MAX_VOCAB}]")
        min_freq = self.typed(bpe.get("min_frequency", 2), "data.tokenizer.bpe.min_frequency", (int,),
                              lambda v: v >= 1, ">= 1")
        if seed_init is not None:
            self.fail("data.tokenizer.bpe", "a given seed (stages.seed.init) brings its own tokenizer; train one "
                      "only for a seed the pipeline trains")
        if vocab != dense.vocab_size:
            self.fail("data.tokenizer.bpe.vocab_size", f"{vocab} differs from the seed model's vocab_size "
                      f"({dense.vocab_size}, stages.seed.model); make them equal")
        return {"vocab_size": vocab, "min_frequency": min_freq}

    def tokenizer(self, tok: str | None, dense: ModelConfig, seed_init: str | None) -> str:
        if tok is None:
            if seed_init is not None:
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

    def mix_stage(self, value: Any, dense: ModelConfig, n_domains: int, seed: int, seq_len: int,
                  branches: bool = True) -> list[Mixture]:
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
                self.fail(f"{where}.name", f"{shown(name)} appears twice")
            recipe_spec = self.typed(e["recipe"], f"{where}.recipe", (str,))
            try:
                recipe = load_recipe(recipe_spec)
            except BamSurgeryError as err:
                self.fail(f"{where}.recipe", " ".join(str(err).split()))
            if not branches and recipe.max_experts != 0:
                self.fail(f"{where}.recipe", f"recipe {recipe.name} mixes specialists: give stages.branch (or a "
                          "recipe that takes none, e.g. upcycle)")
            if "/" in recipe_spec or recipe_spec.endswith((".yaml", ".yml")):
                recipe_spec = str(Path(recipe_spec).resolve())
            given = {k: self.merge_option(k, e[k], f"{where}.{k}") for k in MERGE_OPTIONS if k in e}
            given.setdefault("router_seed", seed)
            try:
                options = MergeOptions(**{k: (tuple(v) if k == "weights" else v) for k, v in given.items()})
                # a recipe that takes no experts (upcycle) is made from the seed alone
                n_members = (n_domains if recipe.max_experts != 0 else 0) + (
                    1 if options.resolved("seed_expert", recipe) else 0)
                if options.weights is not None and len(options.weights) != n_members:
                    self.fail(f"{where}.weights", f"{len(options.weights)} weights for {n_members} mixture members")
                cfg = mixture_config(recipe, dense, n_members, options)
            except (ConfigError, TypeError, ValueError) as err:
                self.fail(where, " ".join(str(err).split()))
            out.append(Mixture(name, recipe_spec, recipe, options, cfg, given, flops_per_token(cfg, seq_len)))
        return out

    def merge_option(self, key: str, value: Any, field_: str) -> Any:
        """A merge option as `bam-surgery merge` would pass it (floats as floats, routing as 'soft'/'topK'),
        so the pipeline's merge and the recorded command write the same bytes."""
        self.typed(value, field_, MERGE_OPTIONS[key])
        if key == "weights":
            if not all(isinstance(w, (int, float)) and not isinstance(w, bool) for w in value):
                self.fail(field_, f"a list of numbers, got {shown(value)}")
            return [float(w) for w in value]
        if key == "attention_routing" and isinstance(value, int):
            return "soft" if value == 0 else f"top{value}"
        return float(value) if float in MERGE_OPTIONS[key] else value

    def settings(self, value: Any) -> list[str]:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not value:
            self.fail("stages.train.settings", f"a list of {', '.join(SETTINGS)}")
        for v in value:
            if v not in SETTINGS:
                self.fail("stages.train.settings", f"{shown(v)} is not one of {', '.join(SETTINGS)}")
        return [s for s in SETTINGS if s in value]

    def name_list(self, value: Any, field_: str, names: list[str]) -> list[str]:
        if not isinstance(value, list):
            self.fail(field_, "a list of mixture names")
        for v in value:
            if v not in names:
                self.fail(field_, f"{shown(v)} is not a mixture of stages.mix ({', '.join(names)})")
        return list(value)

    def check_runs(self, spec: PipelineSpec) -> None:
        """Every training run's TrainConfig, as train() will check it; the batch divides evenly."""
        for field_, cfg in (("stages.seed.knobs", seed_config(spec, "x") if spec.seed_init is None else None),
                            ("stages.branch.knobs", branch_config(spec, next(iter(spec.domains)), "x", "x")
                             if spec.branches else None),
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
