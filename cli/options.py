"""Command-line options that several commands share, declared once (each with its help sentence), and
`output_written`, which a command calls once its output is committed (the CLI's Ctrl-C message reads it).

    @cli.command()
    @OUT_FORCE
    @MAX_SHARD_SIZE
    def my_command(force, max_shard_size): ...
"""
from __future__ import annotations

import dataclasses
import functools
import os
from contextlib import contextmanager
from pathlib import Path

import click

from bam_surgery.app.errors import one_line
from bam_surgery.app.exports import REFUSED_FORMATS, formats
from bam_surgery.app.reporter import Reporter
from bam_surgery.runtime.options import declared, scalar_type

FORMATS = formats()  # converters.export's table, in order



@dataclasses.dataclass(frozen=True)
class Writing:
    """How a command that reads checkpoints writes its one output: the flags convert and extend take as one group
    (`options_of(Writing)`), and merge and the export commands one by one (MAX_SHARD_SIZE, OUT_FORCE,
    ALLOW_PICKLE below, made from these fields). keywords(): the app functions' keywords of the same names."""

    max_shard_size: str | None = declared(
        None, "--max-shard-size", "Largest shard of a directory output, e.g. 2GB, 500MB, 1GiB (default: one shard).",
        metavar="SIZE")
    force: bool = declared(False, "--force", "Replace OUT if it exists.")
    allow_pickle: bool = declared(
        False, "--allow-pickle", "Also read pickle (.bin) weights of Hugging Face inputs (torch.load with "
                                 "weights_only=True).")

    def keywords(self) -> dict:
        return dataclasses.asdict(self)


def option(*decls, **attrs):
    """A field of a command's options dataclass, declared with its click option: `option("--x", help=...)`, or
    `option(SHARED)` for one of the shared options above. command_options turns the fields into the options."""
    shared = len(decls) == 1 and callable(decls[0]) and not attrs
    return dataclasses.field(metadata={"option": decls[0] if shared else click.option(*decls, **attrs)})


def options_of(cls, only: str | None = None):
    """A field of a command's options dataclass that is itself a dataclass `cls` whose fields declare their flags
    in their metadata (runtime/options.py:declared: surgery/options.py:MergeOptions, a format's own options): its
    flags go where the field is, and the command gets one `cls` instance built from them. only: the fields whose
    metadata has this key true (count-params takes MergeOptions' `counts` fields); the others keep their defaults."""
    return dataclasses.field(metadata={"options_of": cls, "only": only})


def command_options(cls):
    """A click command's options from the fields of `cls`, in field order, handed to the command as one `cls`
    instance: `@cli.command() @command_options(MergeArgs) def merge(args: MergeArgs)`."""
    nested = _nested(cls)

    def decorate(command):
        @functools.wraps(command)
        def with_options(**params):
            return command(command_args(cls, params))
        for f in reversed(dataclasses.fields(cls)):
            inner = nested.get(f.name)
            for decorator in ([flag_option(g) for g in reversed(flagged(*inner))] if inner
                              else [f.metadata["option"]]):
                with_options = decorator(with_options)
        return with_options
    return decorate


def command_args(cls, params: dict):
    """The `cls` instance a command gets from click's parameters (command_options)."""
    params = dict(params)
    for name, (inner, only) in _nested(cls).items():
        params[name] = inner(**{f.name: _parsed(f, params.pop(f.name)) for f in flagged(inner, only)})
    return cls(**params)


def flagged(cls, only: str | None = None) -> list[dataclasses.Field]:
    """The fields of an options dataclass that declare a flag (runtime/options.py:declared), those marked `only`
    if given; the others (a format's dtype cast, say) are the Python API's alone."""
    return [f for f in dataclasses.fields(cls) if "flag" in f.metadata and (only is None or f.metadata.get(only))]


def _nested(cls) -> dict:
    return {f.name: (f.metadata["options_of"], f.metadata["only"]) for f in dataclasses.fields(cls)
            if "options_of" in f.metadata}


def flag_option(f: dataclasses.Field):
    """The click option of a field that declares its flag in its metadata (flag, help, metavar, choices, bounds,
    show_default): a bool|None field is --x/--no-x, a bool field an on/off flag, bounds an int or float range."""
    m = f.metadata
    attrs = dict(help=m["help"], metavar=m["metavar"], default=f.default)
    if isinstance(m["show_default"], str):  # the flag spells its default (--router-init random)
        attrs.update(default=m["show_default"], show_default=True)
    elif m["show_default"]:
        attrs["show_default"] = True
    scalar = scalar_type(f)  # int, float, str, bool
    if m["choices"]:
        attrs["type"] = click.Choice(m["choices"])
    elif m["bounds"]:
        low, high = m["bounds"]
        attrs["type"] = (click.IntRange(min=low, max=high) if scalar == "int"
                         else click.FloatRange(min=low, max=high, min_open=m["min_open"]))
    elif m["parse"] is not None:  # text, which `parse` reads and refuses in its own words
        attrs["type"] = click.STRING
    elif scalar == "int":
        attrs["type"] = int
    elif f.type == "bool":
        attrs["is_flag"] = True
    return click.option(m["flag"], f.name, **{k: v for k, v in attrs.items() if v is not None or k == "default"})


MAX_SHARD_SIZE, OUT_FORCE, ALLOW_PICKLE = (flag_option(f) for f in dataclasses.fields(Writing))


def _parsed(f: dataclasses.Field, value):
    """A flag's value as its field takes it (the field's `parse`, where it has one)."""
    parse = f.metadata["parse"]
    return parse(value) if parse is not None and value is not None else value


def format_option(intro: str) -> callable:
    """--format, its choices and help from the exporter table."""
    # the refused formats are accepted here so that the command refuses them in one line saying why
    return click.option("--format", "fmt", type=click.Choice([*FORMATS, *REFUSED_FORMATS]), default="canonical",
                        show_default=True,
                        help=intro + " " + "; ".join(f"{k}: {v}" for k, v in FORMATS.items()) + ". Formats other "
                             "than canonical and gguf (one FILE.gguf) need a directory OUT. Refused, saying why: "
                             + ", ".join(REFUSED_FORMATS) + ".")


def eval_input_options(fn):
    """The options of the commands that run a checkpoint over held-out text (eval, routing-stats): the
    data, its split, tokenizer and windows, and the device."""
    options = [
        click.option("--data", required=True, metavar="SPEC",
                     help="Held-out data: NAME=SOURCE[:WEIGHT],... (folders with train*/val* files give their val* "
                          "files; weights are ignored)."),
        click.option("--split", type=click.Choice(["val", "train"]), default="val", show_default=True,
                     help="Which split of split sources (folders, DatasetDicts) to read."),
        click.option("--tokenizer", metavar="PATH|bytes",
                     help="Tokenizer (default: the checkpoint's own; bytes for vocabularies of at most 512)."),
        click.option("--eos-id", type=int, help="Token id between documents (default: the tokenizer's end-of-text)."),
        click.option("--text-field", default="text", show_default=True,
                     help="Field (JSONL) or column (Parquet, datasets) holding the text."),
        click.option("--seq-len", type=click.IntRange(min=1),
                     help="Window length (default: the model's max_positions)."),
        click.option("--batch-size", type=click.IntRange(min=1), default=8, show_default=True,
                     help="Windows per forward pass."),
        click.option("--max-tokens", type=click.IntRange(min=0), default=0, show_default=True,
                     help="Use the first N tokens of each domain (0: all)."),
        click.option("--token-cache", metavar="DIR",
                     help="Token cache folder (default: ~/.cache/bam-surgery/tokens)."),
        click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
                     help="Where to run."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


WRITTEN = "bam_surgery.written"  # click Context.meta key (shared by nested contexts): outputs in place


def output_written(path: str | os.PathLike) -> None:
    """Mark that the running command's output is in place, committed: a Ctrl-C from here on (while the command
    prints its summary, say) says `interrupted after PATH was written`, not "nothing was written"."""
    ctx = click.get_current_context(silent=True)
    if ctx is not None:
        ctx.meta.setdefault(WRITTEN, []).append(Path(path))


def warn_now(message: str) -> None:
    """A warning line on stderr, never held."""
    click.echo(f"bam-surgery: warning: {one_line(message)}", err=True)


class CommandReporter(Reporter):
    """A command's reporter (app/reporter.py): warnings and notes as `bam-surgery: warning|note: ...` lines, log lines
    on stderr unless `log` is off (--quiet), a progress bar where `progress`, and an output in place marked for the
    Ctrl-C message (output_written). A merge holds its warnings while it runs (holding_warnings)."""

    def __init__(self, *, log: bool = True, progress: bool = False):
        self._log, self.progress = log, progress
        self._held: list[str] | None = None

    def warning(self, message: str) -> None:
        if self._held is not None:
            self._held.append(message)
        else:
            warn_now(message)

    def settled(self, message: str) -> None:
        warn_now(message)  # what a run did to the disk: never held

    def note(self, message: str) -> None:
        click.echo(f"bam-surgery: note: {one_line(message)}", err=True)

    def log(self, line: str) -> None:
        if self._log:
            click.echo(line, err=True)

    def written(self, path: Path) -> None:
        output_written(path)

    @contextmanager
    def holding_warnings(self):
        """A merge's warnings (an expert far from the seed or equal to it, tokenizers that differ, non-finite values
        kept) held while it runs: printed once it completes or is interrupted, dropped when it is refused, so that a
        refused merge prints its one error line alone (an unrelated expert holding NaN printed the distance
        warning, then the error: issue 33). Fix the error, and the next run prints them."""
        self._held = []
        try:
            yield
        except Exception:
            self._held = None
            raise
        finally:
            held, self._held = self._held or [], None
            for message in held:
                warn_now(message)
