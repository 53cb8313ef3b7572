"""The public Python API: `import bam_surgery`, then the use cases as functions with the CLI's names and options
(docs/api.md). Each is a declaration over the one implementation the CLI calls (app/: merge.py, extend.py,
exports.py, train.py, generate.py, params.py, load.py); options are keywords named as the flags name them
(--ffn-top-k: ffn_top_k), given as values or as the flag's text. Every refusal is a bam_surgery.UserError whose
str() is the one line the CLI prints after `bam-surgery: error:` (app/errors.py: an OSError or a missing package
too).

    import bam_surgery as bs
    mix = bs.merge("seed/", ["code=code/", "law=law/"], "mix.safetensors", recipe="bam", ffn_top_k=1)
    bs.count_params("mix.safetensors").table()
    bs.train_model(init="mix.safetensors", data="code=data/domains/code", out="run", steps=20)
    bs.evaluate("run", "code=data/domains/code").table()
    bs.generate("run", "def fib(n):", max_new_tokens=20).text
    m = bs.load("run"); m.model(...), m.encode(...)
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Mapping, Sequence

from bam_surgery.runtime.options import scalar_type
from bam_surgery.surgery.options import ExtendOptions, MergeOptions
from bam_surgery.surgery.specs import merge_inputs, split_specs

from . import exports, extend as extend_use_case, generate as generate_use_case, merge as merge_use_case, params
from . import train as train_use_case
from .errors import UsageError, one_line_errors
from .load import Loaded, load as load_use_case
from .reporter import Reporter


def options_from(cls, given: Mapping[str, Any], what: str, only: Sequence[str] | None = None):
    """An options dataclass (MergeOptions, a format's own) from keywords named as its fields (those in `only`, if
    given); a value given as text is read as its flag reads it (the field's `parse`), anything else as it is."""
    fields = {f.name: f for f in dataclasses.fields(cls) if only is None or f.name in only}
    unknown = sorted(set(given) - set(fields))
    if unknown:
        raise UsageError(f"{what} takes no option {unknown[0]!r}; its options: {', '.join(fields)}")
    values = {}
    for name, value in given.items():
        parse = fields[name].metadata.get("parse")
        if isinstance(value, str):
            value = parse(value) if parse is not None else _scalar_text(value, fields[name], what)
        values[name] = value
    return cls(**values)


_SCALARS = {"int": int, "float": float}
_BOOLS = {"true": True, "yes": True, "1": True, "on": True, "false": False, "no": False, "0": False, "off": False}


def _scalar_text(value: str, field: dataclasses.Field, what: str) -> Any:
    """A number or yes/no option given as its flag's text, read as the flag reads it (`router_seed="1"` is 1)."""
    kind = scalar_type(field)
    try:
        if kind in _SCALARS:
            return _SCALARS[kind](value)
        if kind == "bool":
            return _BOOLS[value.strip().lower()]
    except (ValueError, KeyError):
        expected = {"int": "an integer", "float": "a number", "bool": "yes or no"}[kind]
        raise UsageError(f"{what}: option {field.name}={value!r} is not {expected}") from None
    return value


@one_line_errors
def load(checkpoint: str | Path, *, tokenizer: str | None = None, device: str = "cpu", dtype: str | None = None,
         allow_pickle: bool = False) -> Loaded:
    """Load any checkpoint (a GGUF file, an HF folder or hub id, a canonical file or folder, our exports, a train
    run folder: its newest checkpoint) into a model with its tokenizer: Loaded(model, tokenizer, checkpoint,
    generation) with encode(text) and decode(ids). tokenizer: a tokenizer.json, a folder holding one, or 'bytes'
    (default: the checkpoint's own); device: cpu, cuda or cuda:N; dtype: float32, bfloat16 or float16."""
    return load_use_case(str(checkpoint), tokenizer=tokenizer, device=device, dtype=dtype, allow_pickle=allow_pickle)


@one_line_errors
def merge(seed: str | Path, experts: str | Sequence[str | Path] | Mapping[str, str | Path] = (),
          out: str | Path | None = None, *, recipe: str = "bam", format: str = "canonical",
          max_shard_size: str | None = None, dry_run: bool = False, force: bool = False, allow_pickle: bool = False,
          reporter: Reporter | None = None, **options: Any) -> merge_use_case.MergeResult:
    """`bam-surgery merge`: the dense checkpoints branched from `seed` into a mixture at `out` (None with
    dry_run). experts: [NAME=]CKPT values as --experts takes them (a comma-separated string, a list), or a
    {name: checkpoint} mapping; recipe: bam, bam-shared-kv, btx, btx-shared-expert, upcycle or a recipe file;
    format: an output format (formats()); options: the merge's options by their field names (ffn_top_k=1,
    gate_norm="softmax", router="mlp", weights=[...], ...: `bam-surgery merge --help`). Returns a MergeResult
    (plan, path; a dry run's audit and dry_run_text())."""
    inputs = merge_inputs(str(seed), expert_values(experts))
    return merge_use_case.merge(inputs, out, recipe=recipe, options=options_from(MergeOptions, options, "merge"),
                                fmt=format, max_shard_size=max_shard_size, dry_run=dry_run, force=force,
                                allow_pickle=allow_pickle, reporter=reporter)


@one_line_errors
def extend(mixture: str | Path, experts: str | Sequence[str | Path] | Mapping[str, str | Path], out: str | Path, *,
           max_shard_size: str | None = None, force: bool = False, allow_pickle: bool = False,
           reporter: Reporter | None = None, **options: Any) -> extend_use_case.ExtendResult:
    """`bam-surgery extend`: dense specialists branched from the mixture's seed added to the trained `mixture` (a
    checkpoint or a train run folder) as new experts, into `out` (canonical). experts: as merge takes them;
    options: extend's by their field names (router_init="random" | "prompts" | "domain", router_prompts=,
    calibration=, router_std=, ...: `bam-surgery extend --help`). Returns an ExtendResult (path, extension:
    .extension.config, .extension.before)."""
    inputs = split_specs(expert_values(experts))
    return extend_use_case.extend(str(mixture), inputs, out, options=options_from(ExtendOptions, options, "extend"),
                                  max_shard_size=max_shard_size, force=force, allow_pickle=allow_pickle,
                                  reporter=reporter)


def expert_values(experts: str | Path | Sequence[str | Path] | Mapping[str, str | Path]) -> list[str]:
    """--experts values from what merge and extend take: [NAME=]CKPT text (comma-separated or a list of them) or a
    {name: checkpoint} mapping."""
    if isinstance(experts, Mapping):
        return [f"{name}={spec}" for name, spec in experts.items()]
    return [str(v) for v in ((experts,) if isinstance(experts, (str, Path)) else experts)]


@one_line_errors
def convert(checkpoint: str | Path, out: str | Path, format: str = "canonical", *, max_shard_size: str | None = None,
            force: bool = False, allow_pickle: bool = False, reporter: Reporter | None = None,
            **format_options: Any) -> Path:
    """`bam-surgery convert` (and export-onnx, export-gguf): `checkpoint` (any the tool reads) written to `out` in
    `format`, with what every export carries (tokenizer files, chat template, generation config). format_options:
    the format's own (hf: architecture; onnx: opset, dtype ('fp16'), kv_cache, verify; gguf: dtype ('q8_0'))."""
    own = options_from(exports.format_options(format), format_options, f"format {format}")
    return exports.convert(str(checkpoint), out, format, own=own, max_shard_size=max_shard_size, force=force,
                           allow_pickle=allow_pickle, reporter=reporter)


def export_onnx(checkpoint: str | Path, out: str | Path, **options: Any) -> Path:
    """`bam-surgery export-onnx`: convert(checkpoint, out, "onnx", ...): opset, dtype, kv_cache, verify."""
    return convert(checkpoint, out, "onnx", **options)


def export_gguf(checkpoint: str | Path, out: str | Path, **options: Any) -> Path:
    """`bam-surgery export-gguf`: convert(checkpoint, out, "gguf", ...): dtype (f32, f16 or q8_0)."""
    return convert(checkpoint, out, "gguf", **options)


@one_line_errors
def train_model(config=None, *, config_file: str | Path | None = None, resume: bool = False,
                reporter: Reporter | None = None, **knobs: Any):
    """`bam-surgery train` (named train_model: `bam_surgery.train` is the training layer's package): a training run (init=, preset=, data=, out=, steps=, lr=, ...: TrainConfig's knobs,
    docs/training.md; config_file: a YAML file of them; resume: continue the run in `out`). Returns a TrainResult
    (run, steps, tokens, checkpoint, loss)."""
    return train_use_case.train(config, config_file=config_file, resume=resume, reporter=reporter, **knobs)


@one_line_errors
def evaluate(checkpoint: str | Path, data: str, **options: Any):
    """`bam-surgery eval`: per-domain held-out loss and perplexity (and routing statistics of a mixture) over
    `data`, a domain SPEC (NAME=SOURCE,...). options: split, tokenizer, eos_id, text_field, seq_len, batch_size,
    max_tokens, token_cache, device, reporter. Returns an EvalReport (domains, to_dict(), table())."""
    return train_use_case.evaluate(str(checkpoint), data, **options)


@one_line_errors
def routing_stats(checkpoint: str | Path, data: str, **options: Any):
    """`bam-surgery routing-stats`: a mixture's expert usage per layer and domain (compare=CKPT2: the share of
    tokens whose top-1 expert differs; plot=DIR: the PNGs), with eval's options. Returns a RoutingReport."""
    return train_use_case.routing_stats(str(checkpoint), data, **options)


@one_line_errors
def generate(checkpoint: str | Path | Loaded, prompt: str | None = None, **options: Any):
    """`bam-surgery generate`: continue `prompt` (or tokens=[ids], or chat="message" with system= through the chat
    template) with `checkpoint`: a path or hub id, or a model load() returned (run where it was loaded, with its
    tokenizer). options: tokenizer, chat_template, max_new_tokens, temperature, top_p, seed, device, dtype,
    reporter. Returns a Generation (text, tokens, prefill_seconds, decode_seconds, speeds())."""
    return generate_use_case.generate(checkpoint if isinstance(checkpoint, Loaded) else str(checkpoint), prompt,
                                      **options)


@one_line_errors
def count_params(checkpoint: str | Path | None = None, *, preset: str | None = None, recipe: str | None = None,
                 experts: int | None = None, trainable: str | None = None, convention: str = "exact",
                 allow_pickle: bool = False, **options: Any) -> params.ParamCount:
    """`bam-surgery count-params`: total and active parameters of a checkpoint (its header) or a preset; with
    recipe and experts, of the mixture the merge would build, with the merge's options (ffn_top_k, ...).
    convention='paper': the BAM paper's Table 5 counting. Returns a ParamCount (audit, table(), to_dict())."""
    return params.count_params(None if checkpoint is None else str(checkpoint), preset_name=preset, recipe=recipe,
                               experts=experts,
                               options=options_from(MergeOptions, options, "count_params", params.COUNTED),
                               trainable=trainable, convention=convention, allow_pickle=allow_pickle)


@one_line_errors
def inspect(checkpoint: str | Path, allow_pickle: bool = False):
    """`bam-surgery inspect`: a checkpoint's config, tensor groups and provenance, from its header. Returns an
    Inspection (table(), to_dict())."""
    return params.inspect(str(checkpoint), allow_pickle)


def formats() -> dict[str, str]:
    """The output formats convert and merge write, {name: a few words}."""
    return exports.formats()
