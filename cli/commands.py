"""The bam-surgery command line: flags parsed, the use case called (app/: merge, count_params, ...), its result
printed.

    bam-surgery merge --seed seed.safetensors --experts code.safetensors,math.safetensors --out mix.safetensors

User errors (bad recipe, bad input, refused output path) print one line,
`bam-surgery: error: <message>`, and exit with status 2; nothing is left at --out.
"""
from __future__ import annotations

import errno
import os
import signal
import sys
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import click

from bam_surgery.app.errors import UsageError, UserError, missing_package_message, one_line, os_error_message
from bam_surgery.app.merge import merge as app_merge
from bam_surgery.runtime.atomic import InterruptedAfterWrite
from bam_surgery.surgery.options import MergeOptions
from bam_surgery.surgery.specs import merge_inputs

from .early import EXPERTS, INTERRUPTED, SEED
from .options import (ALLOW_PICKLE, MAX_SHARD_SIZE, OUT_FORCE, WRITTEN, CommandReporter, command_options, format_option,
                      option, options_of)

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for Ctrl-C
EXIT_TERMINATED = 143  # 128 + SIGTERM


def _error_line(message: str) -> None:
    click.echo(f"bam-surgery: error: {one_line(message)}", err=True)


class OneLineError(click.ClickException):
    """A user error, shown as one line with exit status 2."""

    exit_code = EXIT_USER_ERROR

    def show(self, file=None) -> None:
        _error_line(self.message)


class Interrupted(click.ClickException):
    """Ctrl-C: INTERRUPTED, or what the interrupt itself says (runtime.atomic.InterruptedAfterWrite: an
    output was already in place, so "nothing was written" would be false)."""

    exit_code = EXIT_INTERRUPTED

    def __init__(self, interrupt: BaseException | None = None) -> None:
        super().__init__(getattr(interrupt, "message", None) or INTERRUPTED)
        if isinstance(interrupt, Terminated) or isinstance(getattr(interrupt, "__context__", None), Terminated):
            self.exit_code = EXIT_TERMINATED

    def show(self, file=None) -> None:
        click.echo(f"bam-surgery: {self.message}", err=True)


class Group(click.Group):
    """The error contract of every command, in one place (so commands added later get it too):

    * the project's user errors (runtime.errors.UserError and its subclasses) and click's own
      usage errors (a bad option value, a missing argument): one line `bam-surgery: error: ...`,
      exit status 2;
    * a third-party package the command imports and the environment lacks: one line naming what to
      install, exit status 2;
    * an OSError nobody caught (disk full, read-only file system, a parent that is a file): one
      line naming the path, exit status 2;
    * Ctrl-C: `bam-surgery: interrupted; nothing was written`, exit status 130 (outputs are
      written under a temporary name and renamed at the end, so an interrupted run leaves none); once an
      output is in place (runtime.atomic.InterruptedAfterWrite, or the command called output_written):
      `bam-surgery: interrupted after OUT was written (it is complete)`;
    * a closed stdout (`| head`): a quiet exit.
    Anything else is a bug and keeps its traceback. CliRunner goes through `main` too.
    """

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except UsageError as e:  # shown as click's own usage errors are, naming the command's --help
            sub = self.get_command(ctx, ctx.invoked_subcommand) if ctx.invoked_subcommand else None
            where = click.Context(sub, info_name=ctx.invoked_subcommand, parent=ctx) if sub is not None else ctx
            raise click.UsageError(one_line(e), ctx=where) from None
        except UserError as e:
            raise OneLineError(one_line(e)) from None
        except KeyboardInterrupt as e:
            written = ctx.meta.get(WRITTEN)
            if written and not isinstance(e, InterruptedAfterWrite):
                e = InterruptedAfterWrite(written[-1])
            raise Interrupted(e) from None
        except ModuleNotFoundError as e:
            message = missing_package_message(e)
            if message is None:
                raise
            raise OneLineError(message) from None
        except OSError as e:
            if e.errno == errno.EPIPE:
                raise
            raise OneLineError(os_error_message(e)) from None

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode: bool = True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except (Interrupted, click.Abort, KeyboardInterrupt) as e:
            e = e if isinstance(e, Interrupted) else Interrupted(e)
            e.show()
            sys.exit(e.exit_code)
        except click.exceptions.NoArgsIsHelpError as e:  # a bare `bam-surgery`: the help, as it is, and status 2
            click.echo(e.ctx.get_help())
            sys.exit(EXIT_USER_ERROR)
        except click.UsageError as e:  # click's three-line usage message, as one line
            command = " ".join(["bam-surgery", *e.ctx.command_path.split()[1:]]) if e.ctx is not None else ""
            where = f" (see '{command} --help')" if command else ""
            _error_line(e.format_message() + where)
            sys.exit(EXIT_USER_ERROR)
        except click.ClickException as e:
            e.show()
            sys.exit(e.exit_code if isinstance(e, (OneLineError, Interrupted)) else EXIT_USER_ERROR)
        except BrokenPipeError:
            _quiet_broken_pipe()
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)


def _quiet_broken_pipe() -> None:
    """stdout's reader went away (`bam-surgery inspect x | head`): exit without a traceback."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # CliRunner's stdout has no file descriptor
        pass


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """Model surgery for mixture-of-experts upcycling: merge dense checkpoints branched from one seed
    into a BAM / BTX mixture, or upcycle one dense model."""


@dataclass(frozen=True)
class MergeArgs:
    """Every option of `bam-surgery merge` as click parsed it: its own (inputs, OUT, recipe, output) declared here
    with their click options (cli.options.option), and the merge's options, one MergeOptions whose flags come from
    its fields (surgery/options.py, the one declaration: cli.options.options_of)."""

    seed: str = option(SEED)
    experts: tuple[str, ...] = option(EXPERTS)
    out: str | None = option(
        "--out", "out", type=click.Path(dir_okay=True, file_okay=True), metavar="OUT",
        help="Output path: a name ending in .safetensors writes one file, anything else a directory of "
             "shards with an index and config.json. Required unless --dry-run.")
    recipe: str = option(
        "--recipe", default="bam", show_default=True, metavar="NAME|FILE.yaml",
        help="How tensors are merged: bam, bam-shared-kv, btx, btx-shared-expert, upcycle, or the path of a recipe "
             "file (see recipes/README.md).")
    options: MergeOptions = options_of(MergeOptions)
    max_shard_size: str | None = option(MAX_SHARD_SIZE)
    fmt: str = option(format_option("Output format."))
    dry_run: bool = option(
        "--dry-run", is_flag=True,
        help="Print the plan and the parameter audit from the inputs' headers; read no tensor data and "
             "write nothing.")
    force: bool = option(OUT_FORCE)
    allow_pickle: bool = option(ALLOW_PICKLE)
    quiet: bool = option(
        "--quiet", "-q", is_flag=True, help="No progress bar and no summary line.")


@cli.command()
@command_options(MergeArgs)
def merge(args: MergeArgs) -> None:
    """Merge dense checkpoints branched from one seed into a mixture (or upcycle one dense model)."""
    reporter = CommandReporter(log=not args.quiet, progress=not args.quiet and sys.stderr.isatty())
    with ExitStack() as held:
        if not args.dry_run:
            held.enter_context(reporter.holding_warnings())
        result = app_merge(merge_inputs(args.seed, args.experts), args.out, recipe=args.recipe,
                           options=args.options, fmt=args.fmt, max_shard_size=args.max_shard_size,
                           dry_run=args.dry_run, force=args.force, allow_pickle=args.allow_pickle, reporter=reporter)
    if args.dry_run:
        click.echo(result.dry_run_text())
        if args.out is not None and Path(args.out).exists() and not args.force:
            reporter.warning(f"{args.out} exists; the merge would need --force")
    elif not args.quiet:
        _print_merge_summary(result.plan, result.path)


def _print_merge_summary(plan, path: Path) -> None:
    cfg = plan.config
    shared = " (and a shared expert)" if cfg.ffn_shared_hidden else ""
    click.echo(f"wrote {path}: {cfg.name}, {cfg.ffn_experts} FFN experts{shared}, {cfg.attn_experts} attention "
               f"experts, {len(plan.tensors)} tensors, {plan.total_bytes:,} bytes", err=True)
    note = untrained_gate_note(cfg)
    if note:
        click.echo(f"bam-surgery: note: {note}", err=True)


def untrained_gate_note(cfg) -> str | None:
    """What to expect from a fresh top-k < E mixture with softmax gates (the paper's BAM setting):
    each FFN expert's output is multiplied by its p_i from the full softmax, about 1/E while the
    routers are random, so the merged model's loss before training says little about it."""
    E, k = cfg.ffn_experts, cfg.ffn_top_k
    shared = " and the shared expert's by sigmoid(0) = 0.5" if cfg.ffn_shared_hidden else ""
    if not E or (cfg.gate_norm != "softmax" or k >= E) and not shared:
        return None
    scaled = (f"each FFN output is scaled by its gate, about 1/{E} = {1 / E:.2g} (softmax gates, top-{k} of {E})"
              if cfg.gate_norm == "softmax" and k < E else "the routed experts' gates are random")
    return f"until the routers are trained {scaled}{shared}, so perplexity before training is not representative"


# The header-only commands (count-params, inspect) live in their own module.
from .audit import count_params_cmd, inspect_cmd  # noqa: E402

cli.add_command(count_params_cmd)
cli.add_command(inspect_cmd)
from .generate import generate_cmd  # noqa: E402

cli.add_command(generate_cmd)
from .exports import convert, export_gguf_cmd, export_onnx_cmd  # noqa: E402

cli.add_command(convert)
cli.add_command(export_onnx_cmd)
cli.add_command(export_gguf_cmd)

from .train import eval_cmd, plot_cmd, train_cmd  # noqa: E402

cli.add_command(train_cmd)
cli.add_command(eval_cmd)
cli.add_command(plot_cmd)
from .routing import routing_stats_cmd  # noqa: E402

cli.add_command(routing_stats_cmd)

from .pipeline import pipeline_cmd  # noqa: E402

cli.add_command(pipeline_cmd)
from .extend import extend_cmd  # noqa: E402

cli.add_command(extend_cmd)


class Terminated(KeyboardInterrupt):
    """SIGTERM, unwound exactly as Ctrl-C is (every clean-up a Ctrl-C runs: atomic outputs, a train run's folder),
    then exit status 143."""


def _terminate(signum, frame) -> None:
    raise Terminated()


def main(argv: list[str] | None = None) -> None:
    """The CLI (the console script enters through cli/launch.py, which calls this). The Group holds the
    error contract; this guard only catches a Ctrl-C that lands outside a command (while starting)."""
    signal.signal(signal.SIGTERM, _terminate)
    try:
        cli.main(args=argv, prog_name="bam-surgery")
    except KeyboardInterrupt as e:
        interrupted = Interrupted(e)
        interrupted.show()
        sys.exit(interrupted.exit_code)


if __name__ == "__main__":
    main()
