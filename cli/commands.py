"""The bam-surgery command line: a thin layer over recipe -> plan -> execute.

    bam-surgery merge --seed seed.safetensors --experts code.safetensors,math.safetensors --out mix.safetensors

User errors (bad recipe, bad input, refused output path) print one line,
`bam-surgery: error: <message>`, and exit with status 2; nothing is left at --out.
"""
from __future__ import annotations

import dataclasses
import errno
import os
import signal
import sys
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import click

from bam_surgery.app.exports import ExportRequest, carried_files, export, export_inputs
from bam_surgery.converters.export import check_export, exporter
from bam_surgery.runtime.atomic import InterruptedAfterWrite
from bam_surgery.runtime.config import GATE_NORMS, MAX_EXPERTS, ROUTERS, GateNorm, Router
from bam_surgery.surgery.audit import audit_checkpoint
from bam_surgery.surgery.errors import USER_ERRORS, BamSurgeryError, missing_package_message, one_line, os_error_message
from bam_surgery.surgery.inspect import render_audit
from bam_surgery.surgery.names import input_names, parse_named, split_specs
from bam_surgery.surgery.open_input import open_input
from bam_surgery.surgery.plan import MergeOptions, compile_plan, format_plan
from bam_surgery.surgery.recipe import SHARED_KV_RULES, WARM_STARTS, SharedKVRule, WarmStart, load_recipe
from bam_surgery.surgery.sizes import parse_size

from .options import (ALLOW_PICKLE, MAX_SHARD_SIZE, OUT_FORCE, WRITTEN, command_options, format_option, option,
                      output_written)

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for Ctrl-C
EXIT_TERMINATED = 143  # 128 + SIGTERM
INTERRUPTED = "interrupted; nothing was written"


def _error_line(message: str) -> None:
    click.echo(f"bam-surgery: error: {one_line(message)}", err=True)


class UserError(click.ClickException):
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

    * the project's user errors (BamSurgeryError, CheckpointError, ConfigError) and click's own
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
        except USER_ERRORS as e:
            raise UserError(one_line(e)) from None
        except KeyboardInterrupt as e:
            written = ctx.meta.get(WRITTEN)
            if written and not isinstance(e, InterruptedAfterWrite):
                e = InterruptedAfterWrite(written[-1])
            raise Interrupted(e) from None
        except ModuleNotFoundError as e:
            message = missing_package_message(e)
            if message is None:
                raise
            raise UserError(message) from None
        except OSError as e:
            if e.errno == errno.EPIPE:
                raise
            raise UserError(os_error_message(e)) from None

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
            sys.exit(e.exit_code if isinstance(e, (UserError, Interrupted)) else EXIT_USER_ERROR)
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


def _parse_weights(text: str | None) -> tuple[float, ...] | None:
    if text is None:
        return None
    try:
        return tuple(float(w) for w in text.split(","))
    except ValueError:
        raise BamSurgeryError(f"--weights: cannot read {text!r}; write comma-separated numbers, e.g. 0.4,0.2,0.2,0.2"
                              ) from None


_held_warnings: list[str] | None = None  # while a merge runs (_warnings_unless_refused)


def _warn(msg: str) -> None:
    if _held_warnings is not None:
        _held_warnings.append(msg)
    else:
        _warn_now(msg)


def _warn_now(msg: str) -> None:
    """A warning never held: what a run did to the disk (a killed run's work folder settled)."""
    click.echo(f"bam-surgery: warning: {one_line(msg)}", err=True)


@contextmanager
def _warnings_unless_refused():
    """A merge's warnings (an expert far from the seed or equal to it, tokenizers that differ, non-finite values
    kept) held while it runs: printed once it completes or is interrupted, dropped when it is refused, so that a
    refused merge prints its one error line alone (an unrelated expert holding NaN printed the distance warning,
    then the error: issue 33). Fix the error, and the next run prints them."""
    global _held_warnings
    _held_warnings = []
    try:
        yield
    except Exception:
        _held_warnings = None
        raise
    finally:
        held, _held_warnings = _held_warnings or [], None
        for msg in held:
            _warn_now(msg)


def _check_format_out(fmt: str, out: str | None) -> None:
    if out is not None and exporter(fmt).writes_directory and str(out).endswith(".safetensors"):
        raise BamSurgeryError(f"--format {fmt}: writes a directory; {out} names a .safetensors file")


ROUTER_INITS = ("random", *WARM_STARTS)  # --router-init: random, or a warm start


@dataclass(frozen=True)
class MergeArgs:
    """Every option of `bam-surgery merge` as click parsed it, one field per option (its parameter name),
    declared once with its click option (cli.options.option, command_options).
    The plan's options (surgery.plan.MergeOptions) are built from them in one place: plan_options."""

    seed: str = option(
        "--seed", "seed", required=True, metavar="[NAME=]CKPT",
        help="The dense seed checkpoint every expert was branched from; it joins as expert 0 unless "
             "--no-seed-expert. Named 'seed' unless given NAME=CKPT.")
    experts: tuple[str, ...] = option(
        "--experts", "experts", multiple=True, metavar="[NAME=]CKPT,...",
        help="Dense expert checkpoints branched from the seed, as NAME=CKPT (e.g. code=ckpt/code) or CKPT "
             "(named after its file or folder), comma-separated or the option repeated (one each, for a "
             "path holding a comma); they become experts 1, 2, ... in this order.")
    out: str | None = option(
        "--out", "out", type=click.Path(dir_okay=True, file_okay=True), metavar="OUT",
        help="Output path: a name ending in .safetensors writes one file, anything else a directory of "
             "shards with an index and config.json. Required unless --dry-run.")
    recipe: str = option(
        "--recipe", default="bam", show_default=True, metavar="NAME|FILE.yaml",
        help="How tensors are merged: bam, bam-shared-kv, btx, btx-shared-expert, upcycle, or the path of a recipe "
             "file (see recipes/README.md).")
    ffn_top_k: int | None = option(
        "--ffn-top-k", type=click.IntRange(min=1, max=MAX_EXPERTS), metavar="K",
        help="FFN experts each token is routed to (default: the recipe's, 1 for the shipped recipes).")
    # soft | topK
    attention_routing: str | None = option(
        "--attention-routing", metavar="soft|topK",
        help="Attention-expert routing: soft (every token to every expert, the paper's choice) or topK, "
             "e.g. top2 (default: the recipe's).")
    gate_norm: GateNorm | None = option(
        "--gate-norm", type=click.Choice(GATE_NORMS),
        help="Gate values: softmax takes p_i from the full softmax (paper); topk_softmax renormalizes "
             "over the chosen top-k.")
    extra_ffn_experts: int | None = option(
        "--extra-ffn-experts", type=click.IntRange(min=0, max=MAX_EXPERTS), metavar="N",
        help="Add N FFN experts initialized from the seed's FFN (paper, Table 6: BTX with 5-8 experts; "
             "for upcycle, the number of copies besides the seed's own slot).")
    seed_expert: bool | None = option(
        "--seed-expert/--no-seed-expert", default=None,
        help="Whether the seed joins the mixture as expert 0 (default: yes). Without it the seed is "
             "still the reference for shapes and for --extra-ffn-experts.")
    # W0,W1,... as given (plan_options reads the numbers)
    weights: str | None = option(
        "--weights", metavar="W0,W1,...",
        help="Weights of the averaged tensors (norms, embeddings, ...), one per mixture input in expert "
             "order (seed first when it joins); normalized to sum 1. Default: uniform.")
    shared_kv_rule: SharedKVRule | None = option(
        "--shared-kv-rule", type=click.Choice(SHARED_KV_RULES),
        help="For shared-KV recipes: make the one K/V projection by averaging the inputs' (mean) or by "
             "copying the seed's (seed). Default: the recipe's (mean for bam-shared-kv).")
    router_seed: int = option(
        "--router-seed", type=int, default=0, show_default=True, metavar="N",
        help="Seed of the random router init; each router's generator is seeded from N and its tensor "
             "name, so results do not depend on order.")
    router_std: float | None = option(
        "--router-std", type=click.FloatRange(min=0), metavar="X",
        help="Routers are initialized from normal(0, X) (default: the recipe's, 0.02).")
    router: Router | None = option(
        "--router", type=click.Choice(ROUTERS),
        help="Router kind of every router: linear, mlp, attention or expert_embedding (docs/routers.md; "
             "default: the recipe's, linear).")
    ffn_router: Router | None = option(
        "--ffn-router", type=click.Choice(ROUTERS), help="Router kind of the FFN routers (overrides --router).")
    attn_router: Router | None = option(
        "--attn-router", type=click.Choice(ROUTERS),
        help="Router kind of the attention routers (overrides --router).")
    router_hidden: int | None = option(
        "--router-hidden", type=click.IntRange(min=1), metavar="N",
        help="mlp routers: hidden width (default 2*d_model); attention routers: query/key width "
             "(default head_dim).")
    router_temperature: float | None = option(
        "--router-temperature", type=click.FloatRange(min=0, min_open=True), metavar="T",
        help="expert_embedding routers: initial temperature tau of logits = cos(x, m_e) / tau (learned; "
             "default 0.1).")
    # ROUTER_INITS
    router_init: str = option(
        "--router-init", type=click.Choice(ROUTER_INITS), default="random",
        show_default=True,
        help="Expert embeddings of expert_embedding routers: random, or the mean router-input state of each "
             "expert's calibration domain (domain-mean) or of the tokens its dense model predicts best "
             "(profile); the warm starts need --calibration.")
    calibration: str | None = option(
        "--calibration", metavar="SPEC",
        help="Calibration data for --router-init domain-mean|profile, a data SPEC as train takes it "
             "(NAME=SOURCE,...; domain-mean: one domain per expert, named like the expert; the seed's "
             "domain is general).")
    calibration_tokens: int = option(
        "--calibration-tokens", type=click.IntRange(min=1), default=8192, show_default=True, metavar="N",
        help="Calibration tokens per domain (the first N of its train split).")
    tokenizer: str | None = option(
        "--tokenizer", metavar="PATH|bytes",
        help="Tokenizer of the calibration text (default: the seed's tokenizer.json, or bytes for "
             "vocabularies of at most 512).")
    token_cache: str | None = option(
        "--token-cache", metavar="DIR",
        help="Token cache folder of the calibration data (default: ~/.cache/bam-surgery/tokens).")
    lb_coef: float | None = option(
        "--lb-coef", type=click.FloatRange(min=0), metavar="ALPHA",
        help="Load-balancing loss weight alpha written into the output config (paper eq. 3; default "
             "0.01).")
    z_coef: float | None = option(
        "--z-coef", type=click.FloatRange(min=0), metavar="BETA",
        help="Router z-loss weight beta written into the output config (paper eq. 3; default 0.001).")
    dtype: str | None = option(
        "--dtype", type=click.Choice(["float32", "bfloat16", "float16"]),
        help="Output dtype (default: the dtype of the seed's embedding). Averages are accumulated in "
             "float32 either way.")
    max_shard_size: str | None = option(MAX_SHARD_SIZE)
    fmt: str = option(format_option("Output format."))
    dry_run: bool = option(
        "--dry-run", is_flag=True,
        help="Print the plan and the parameter audit from the inputs' headers; read no tensor data and "
             "write nothing.")
    force: bool = option(OUT_FORCE)
    allow_nonfinite: bool = option(
        "--allow-nonfinite", is_flag=True,
        help="Merge even if an input holds NaN or Inf values (they are reported as warnings).")
    allow_pickle: bool = option(ALLOW_PICKLE)
    quiet: bool = option(
        "--quiet", "-q", is_flag=True, help="No progress bar and no summary line.")

    @property
    def warm_start(self) -> WarmStart | None:
        return None if self.router_init == "random" else self.router_init

    def plan_options(self) -> MergeOptions:
        """MergeOptions from the options of the same names; --weights read as numbers, --router-init as the
        warm start."""
        same = {f.name: getattr(self, f.name) for f in dataclasses.fields(MergeOptions) if f.name != "weights"}
        return MergeOptions(**same, weights=_parse_weights(self.weights))


@cli.command()
@command_options(MergeArgs)
def merge(args: MergeArgs) -> None:
    """Merge dense checkpoints branched from one seed into a mixture (or upcycle one dense model)."""
    # lazy: execute, output_path, branches and plan_reader pull in hashing (blake3), not needed for --help
    from bam_surgery.surgery.execute import execute_plan

    the_recipe = load_recipe(args.recipe)  # validated before any checkpoint is opened
    shard_bytes = _check_merge_args(args)
    options = args.plan_options()
    named = [parse_named(args.seed), *split_specs(args.experts)]
    names = input_names([spec for _, spec in named], [name for name, _ in named])
    with ExitStack() as opened:
        if not args.dry_run:
            opened.enter_context(_warnings_unless_refused())
        readers = [opened.enter_context(open_input(spec, args.allow_pickle)) for _, spec in named]
        plan = compile_plan(the_recipe, readers, options, names=names)
        check_export(args.fmt, plan.config, recipe=the_recipe.name)  # from the plan's config, before any read
        if args.warm_start and not args.dry_run:  # a stage before the streamed merge: reads inputs and data
            plan = _warm_start(plan, args)
        if args.dry_run:
            _print_dry_run(plan, args)
            return
        if args.fmt == "canonical":
            carried = carried_files(export_inputs(plan.inputs[0].reader, "canonical", plan=plan, warn=_warn))
            path = execute_plan(plan, args.out, force=args.force, max_shard_bytes=shard_bytes,
                                progress=not args.quiet and sys.stderr.isatty(), warn=_warn, on_stale=_warn_now,
                                side_files=carried)
        else:
            path = _merge_export(plan, Path(args.out), args.fmt, args.force, shard_bytes)
        output_written(path)
    if not args.quiet:
        _print_merge_summary(plan, path)


def _check_merge_args(args: MergeArgs) -> int | None:
    """The checks of merge's options among themselves, before any checkpoint is opened; the shard size in bytes."""
    if args.out is None and not args.dry_run:
        raise BamSurgeryError("--out is required (or use --dry-run)")
    shard_bytes = parse_size(args.max_shard_size) if args.max_shard_size else None
    if shard_bytes and args.out is not None and str(args.out).endswith(".safetensors"):
        raise BamSurgeryError(f"--max-shard-size: {args.out} is a single .safetensors file; give a directory path "
                              "to write shards")
    _check_format_out(args.fmt, args.out)
    if args.warm_start and not args.calibration:
        raise BamSurgeryError(f"--router-init {args.router_init}: needs --calibration DATA (e.g. "
                              "code=data/domains/code,general=data/domains/general)")
    if args.calibration and not args.warm_start:
        raise BamSurgeryError("--calibration: only --router-init domain-mean or profile reads calibration data")
    return shard_bytes


def _warm_start(plan, args: MergeArgs):
    """The plan with its expert embeddings computed from the calibration data (surgery/warm_start.py)."""
    # lazy: warm_start pulls in the tokenizers package (30 ms), for --router-init only
    from bam_surgery.surgery.warm_start import Calibration, warm_start

    log = (lambda msg: None) if args.quiet else (lambda msg: click.echo(msg, err=True))
    calibration = Calibration(args.calibration, args.calibration_tokens, args.tokenizer, args.token_cache)
    return warm_start(plan, calibration, log)


def _print_dry_run(plan, args: MergeArgs) -> None:
    click.echo(format_plan(plan))
    click.echo("")
    click.echo(_audit_text(plan))
    if args.out is not None and Path(args.out).exists() and not args.force:
        _warn(f"{args.out} exists; the merge would need --force")


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


def _merge_export(plan, out: Path, fmt: str, force: bool, shard_bytes: int | None) -> Path:
    """Export straight from the plan (no intermediate canonical file): a PlanReader computes each
    tensor when the exporter asks for it; app.exports carries the seed's side files and the card."""
    # lazy: these pull in hashing (blake3), not needed for --help
    from bam_surgery.surgery.branches import check_branches
    from bam_surgery.surgery.output_path import check_output_path, plan_inputs
    from bam_surgery.surgery.plan_reader import PlanReader

    check_output_path(out, force, plan_inputs(plan))
    check_branches(plan, _warn)
    return export(PlanReader(plan, warn=_warn, hash_inputs=False), out, fmt,
                  ExportRequest(max_shard_bytes=shard_bytes, force=force), plan=plan, warn=_warn)


@cli.command()
@click.argument("source", metavar="CKPT")
@click.option("--out", required=True, type=click.Path(), metavar="OUT",
              help="Output path: .safetensors file or directory (canonical), a directory (hf, mixtral, onnx), or a "
                   "FILE.gguf (gguf).")
@format_option("Output format (from any input: canonical file or directory, HF directory, hub id, Mixtral or HF "
               "BAM export).")
@click.option("--architecture", metavar="MODEL_TYPE",
              help="For --format hf of a dense model: the HF architecture to write (llama, mistral, qwen2, "
                   "gpt_neox, gpt2, cohere, phi). Default: the input's own, when it came from HF.")
@MAX_SHARD_SIZE
@OUT_FORCE
@ALLOW_PICKLE
@click.option("--quiet", "-q", is_flag=True, help="No summary line (convert draws no progress bar).")
def convert(source, out, fmt, architecture, max_shard_size, force, allow_pickle, quiet) -> None:
    """Convert one checkpoint between formats, streamed (e.g. an HF Llama to canonical and back).

    The tokenizer files, chat template and generation config go with the weights into every format
    (docs/deploy.md, "What every export carries"); a format that cannot carry them says so in one line.
    """
    shard_bytes = parse_size(max_shard_size) if max_shard_size else None
    _check_format_out(fmt, out)
    with open_input(source, allow_pickle) as reader:
        export(reader, out, fmt, ExportRequest(architecture=architecture, max_shard_bytes=shard_bytes, force=force),
               source=str(source))
        output_written(Path(out))
    if not quiet:
        click.echo(f"wrote {out} ({fmt})", err=True)


def _audit_text(plan) -> str:
    """Parameter counts of the planned output, from its shapes only (the count-params table)."""
    from bam_surgery.surgery.plan_reader import PlanReader  # lazy: pulls in hashing (blake3), not needed for --help

    return render_audit(audit_checkpoint(PlanReader(plan, hash_inputs=False)), "planned output of the merge")


# The header-only commands (count-params, inspect) live in their own module.
from .audit import count_params_cmd, inspect_cmd  # noqa: E402

cli.add_command(count_params_cmd)
cli.add_command(inspect_cmd)
from .generate import generate_cmd  # noqa: E402

cli.add_command(generate_cmd)
from .onnx import export_onnx_cmd  # noqa: E402

cli.add_command(export_onnx_cmd)
from .gguf import export_gguf_cmd  # noqa: E402

cli.add_command(export_gguf_cmd)

from .train import eval_cmd, plot_cmd, train_cmd  # noqa: E402

cli.add_command(train_cmd)
cli.add_command(eval_cmd)
cli.add_command(plot_cmd)
from .routing import routing_stats_cmd  # noqa: E402

cli.add_command(routing_stats_cmd)

from .pipeline import pipeline_cmd  # noqa: E402

cli.add_command(pipeline_cmd)


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
