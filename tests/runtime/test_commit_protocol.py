"""The commit protocol of runtime.atomic, state by state (its docstring lists the states).

At each named step of the commit (`atomic.COMMIT_STEPS`) the tests interrupt the run (the step hook
raises KeyboardInterrupt, as a Ctrl-C landing there would) or kill it (a forked child SIGKILLs itself
there, leaving the disk exactly as kill -9 would), then check: OUT holds the complete old or the
complete new output, nothing of a user's is removed, the interrupt after the new output is in place
does not say "nothing was written", and the next run on the same OUT settles the work folder, putting
a displaced old output back rather than removing it when the new one never landed.
Plus the issue's reproductions through `merge --force` (issue 20, items 1 and 2).
"""
from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save

from conftest import merge_family, seed_and_experts, tiny_config
from bam_surgery.runtime import atomic
from bam_surgery.runtime.atomic import atomic_dir, atomic_path, work_folder
from bam_surgery.runtime.errors import OutputError
from bam_surgery.runtime.outputs import FORMAT, not_own_output
from bam_surgery.runtime.safetensors_file import SafetensorsStreamWriter
from bam_surgery.cli.commands import cli

LANDED_FROM = "linked"  # the first step at which the new output is at OUT
# How --force replaces OUT: one renameat2(RENAME_EXCHANGE) ("exchange"); two renames where the file system
# refuses the exchange ("two-step"); os.link or os.rename where renameat2 is missing ("no-renameat2").
MODES = ("exchange", "two-step", "no-renameat2")
REACHED = {"exchange": {"ready", "recorded", "exchanged", "discarding", "removed", "unlocked"},
           "two-step": {"ready", "recorded", "aside", "checked", "landed", "discarding", "removed", "unlocked"},
           "no-renameat2": {"ready", "aside", "checked", "linked", "landed", "discarding", "removed", "unlocked"}}
# (kind, mode, step): each step the commit reaches in that mode ("linked": only a file is placed by os.link)
WALK = [(kind, mode, step) for kind in ("file", "folder") for mode in MODES
        for step in atomic.COMMIT_STEPS if step in REACHED[mode] and (step != "linked" or kind == "file")]


def use_mode(mode: str, setattr=setattr) -> None:
    """Make this process commit as in `mode` (setattr: monkeypatch.setattr in a test, plain in a child)."""
    if mode == "two-step":
        setattr(atomic, "rename_exchange", lambda a, b: False)  # as where the exchange is refused (EINVAL)
    elif mode == "no-renameat2":
        setattr(atomic, "_RENAMEAT2", None)


@functools.lru_cache(maxsize=None)
def blob(tag: str) -> bytes:
    """A safetensors file this tool owns (its metadata carries our format), telling `tag` apart (cached: the
    order of the metadata's keys varies from one call to the next)."""
    return save({"x": torch.tensor([float(len(tag))])}, metadata={"format": FORMAT, "tag": tag})


def write(target: Path, kind: str, tag: str, **kw) -> None:
    if kind == "file":
        with atomic_path(target, **kw) as tmp:
            tmp.write_bytes(blob(tag))
    else:
        with atomic_dir(target, **kw) as tmp:
            (tmp / "weights.txt").write_text(tag)
            (tmp / "more.txt").write_text(tag * 100)


def holds(target: Path, kind: str, tag: str) -> bool:
    """`target` is the complete output `tag`, and ours."""
    if not os.path.lexists(target) or not_own_output(target) is not None:
        return False
    if kind == "file":
        return target.read_bytes() == blob(tag)
    return (target / "weights.txt").read_text() == tag and (target / "more.txt").read_text() == tag * 100


def landed(step: str) -> bool:
    return atomic.COMMIT_STEPS.index(step) >= atomic.COMMIT_STEPS.index(LANDED_FROM)


@pytest.fixture
def out(tmp_path):
    """(OUT, a user's file beside it that must survive everything)."""
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    yield tmp_path / "mix"
    assert notes.read_text() == "mine"


def hook_at(step: str, action, seen: list[str]):
    def hook(name: str) -> None:
        seen.append(name)
        if name == step:
            action()
    return hook


def _interrupt():
    raise KeyboardInterrupt


def settles_on_the_next_runs(target: Path, kind: str, expect: str) -> list[str]:
    """The next run without --force puts a displaced old output back (or finds OUT in place) and refuses;
    OUT is then `expect`; the run after, with replace, writes over it and leaves no work folder."""
    told: list[str] = []
    with pytest.raises(OutputError, match="already exists"):
        write(target, kind, "next", replace=False, on_stale=told.append)
    assert holds(target, kind, expect)
    write(target, kind, "next", replace=True, on_stale=told.append)
    assert holds(target, kind, "next")
    assert not os.path.lexists(work_folder(target))
    assert sorted(p.name for p in target.parent.iterdir()) == sorted([target.name, "notes.txt"])
    return told


# ---- Ctrl-C at each step ------------------------------------------------------------------------------
@pytest.mark.parametrize("kind,mode,step", WALK)
def test_an_interrupt_at_each_step_keeps_the_old_or_the_new_output(out, monkeypatch, kind, mode, step):
    write(out, kind, "old")
    seen: list[str] = []
    monkeypatch.setattr(atomic, "step_hook", hook_at(step, _interrupt, seen))
    use_mode(mode, monkeypatch.setattr)
    with pytest.raises(KeyboardInterrupt) as caught:
        write(out, kind, "new")
    assert step in seen
    if landed(step):  # the new output is in place: the interrupt says so
        assert isinstance(caught.value, atomic.InterruptedAfterWrite), seen
        assert "was written" in caught.value.message and str(out) in caught.value.message
        assert holds(out, kind, "new")
    else:
        assert not isinstance(caught.value, atomic.InterruptedAfterWrite)
        assert holds(out, kind, "old")
    if atomic.COMMIT_STEPS.index(step) < atomic.COMMIT_STEPS.index("discarding"):
        assert not os.path.lexists(work_folder(out))  # the run's own clean-up finished
    monkeypatch.setattr(atomic, "step_hook", None)
    settles_on_the_next_runs(out, kind, "new" if landed(step) else "old")


@pytest.mark.parametrize("mode,step", [("exchange", "ready"), ("two-step", "ready"), ("two-step", "aside")])
def test_an_interrupt_keeps_a_users_folder_that_appeared_at_out(out, monkeypatch, mode, step):
    """OUT was empty at the ownership check; a user's folder is moved there while the run writes."""
    use_mode(mode, monkeypatch.setattr)

    def hook(name: str) -> None:
        if name == "ready":  # the first step
            out.mkdir()
            for i in range(50):
                (out / f"photo{i}.jpg").write_text(str(i))
        if name == step:
            raise KeyboardInterrupt

    monkeypatch.setattr(atomic, "step_hook", hook)
    with pytest.raises(KeyboardInterrupt) as caught:
        write(out, "folder", "new")
    assert not isinstance(caught.value, atomic.InterruptedAfterWrite)
    assert sorted(p.name for p in out.iterdir()) == sorted(f"photo{i}.jpg" for i in range(50))
    assert not os.path.lexists(work_folder(out))
    monkeypatch.setattr(atomic, "step_hook", None)
    with pytest.raises(OutputError, match="photo"):  # and no later run replaces it either
        write(out, "folder", "new", replace=True)
    assert len(list(out.iterdir())) == 50


@pytest.mark.parametrize("interrupt", [False, True])
def test_a_users_folder_swapped_out_is_swapped_back(out, monkeypatch, interrupt):
    """OUT holds our old output; after the exchange's own check a user puts a folder there instead; it is
    swapped out with the new output, found not ours, and swapped back (at once, or by the clean-up of a Ctrl-C
    that landed right after the exchange): OUT holds the user's folder, the run says nothing was written."""
    write(out, "folder", "old")

    def hook(name: str) -> None:
        if name == "recorded":
            for p in out.iterdir():
                p.unlink()
            for i in range(5):
                (out / f"photo{i}.jpg").write_text(str(i))
        if name == "exchanged" and interrupt:
            raise KeyboardInterrupt

    monkeypatch.setattr(atomic, "step_hook", hook)
    with pytest.raises(KeyboardInterrupt if interrupt else OutputError) as caught:
        write(out, "folder", "new", replace=True)
    assert not isinstance(caught.value, atomic.InterruptedAfterWrite)
    assert sorted(p.name for p in out.iterdir()) == [f"photo{i}.jpg" for i in range(5)]
    assert not os.path.lexists(work_folder(out))


# ---- kill -9 at each step -----------------------------------------------------------------------------
def killed_at(target: Path, kind: str, step: str, mode: str) -> None:
    """Run `write(target, kind, "new")` in a forked child that SIGKILLs itself at `step`."""
    new = blob("new")  # built here: the child only writes bytes
    pid = os.fork()
    if pid == 0:  # the child: no pytest clean-up, no finally clauses past the kill
        try:
            atomic.step_hook = lambda name: name == step and os.kill(os.getpid(), signal.SIGKILL)
            use_mode(mode)
            if kind == "file":
                with atomic_path(target) as tmp:
                    tmp.write_bytes(new)
            else:
                write(target, kind, "new")
        finally:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, f"the child never reached {step}"


@pytest.mark.parametrize("kind,mode,step", WALK)
def test_a_kill_at_each_step_is_settled_by_the_next_run(out, kind, mode, step):
    write(out, kind, "old")
    killed_at(out, kind, step, mode)
    work = work_folder(out)
    assert os.path.isdir(work)  # the kill left the work folder
    left = set(os.listdir(work)) - {atomic.LOCK}
    # no state holds neither output: the old one is at OUT or aside, or the new one is at OUT
    assert holds(out, kind, "new" if landed(step) else "old") or holds(work / atomic.REPLACED, kind, "old")
    if mode == "exchange":  # one exchange: OUT is never absent, it holds the old or the new output (issue 33)
        assert holds(out, kind, "new" if landed(step) else "old"), (step, os.listdir(work))
    if step in ("aside", "checked"):
        assert not os.path.lexists(out) and left == {out.name, atomic.REPLACED}
    told = settles_on_the_next_runs(out, kind, "new" if landed(step) else "old")
    if step in ("aside", "checked"):  # the old output was put back, not removed
        assert any("put the previous" in t for t in told), told
    elif left:
        assert any("removed" in t and "interrupted run" in t for t in told), told


def test_a_kill_while_putting_the_old_output_back_by_link_is_settled(out):
    """Where renameat2 is missing, the old file goes back to OUT by os.link then unlink: killed between."""
    write(out, "file", "old")
    killed_at(out, "file", "aside", "no-renameat2")
    pid = os.fork()
    if pid == 0:
        try:
            atomic._RENAMEAT2 = None
            atomic.step_hook = lambda name: name == "linked" and os.kill(os.getpid(), signal.SIGKILL)
            with atomic_path(out, replace=False):
                pass
        finally:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status)
    assert os.path.samefile(out, work_folder(out) / atomic.REPLACED)
    settles_on_the_next_runs(out, "file", "old")


def test_an_old_output_put_aside_is_kept_when_out_is_taken_meanwhile(out):
    """Killed in S2; then a user saves something at OUT: nothing removes either, and the error says where
    the old output is."""
    write(out, "folder", "old")
    killed_at(out, "folder", "checked", "two-step")
    out.mkdir()
    (out / "diary.txt").write_text("dear diary")
    with pytest.raises(OutputError, match="already exists"):
        write(out, "folder", "next", replace=False)
    with pytest.raises(OutputError, match="diary"):
        write(out, "folder", "next", replace=True)
    with pytest.raises(OutputError, match=f"kept at {work_folder(out) / atomic.REPLACED}"):
        atomic._acquire(work_folder(out), out, None)  # a run that got past its check before the user came
    assert (out / "diary.txt").read_text() == "dear diary"
    assert holds(work_folder(out) / atomic.REPLACED, "folder", "old")
    (out / "diary.txt").unlink()  # the user moves the diary away: the next run puts the old output back
    out.rmdir()
    settles_on_the_next_runs(out, "folder", "old")


# ---- through merge --force (issue 20, items 1 and 2) ---------------------------------------------------
CFG = tiny_config(block="parallel", norm="layernorm")


@pytest.fixture
def inputs(tmp_path) -> list[Path]:
    return seed_and_experts(tmp_path / "in", CFG)


def files_of(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def interrupt_when_checking_what_was_moved_aside(monkeypatch):
    """Ctrl-C landing between `os.rename(OUT, work/replaced)` and the rename of the new output onto OUT (the
    two-step commit, where the exchange is refused)."""
    use_mode("two-step", monkeypatch.setattr)
    real = atomic.not_own_output

    def check(path):
        if Path(path).name == "replaced":
            raise KeyboardInterrupt
        return real(path)
    monkeypatch.setattr(atomic, "not_own_output", check)


def test_interrupted_force_merge_keeps_a_folder_moved_to_out_after_the_check(tmp_path, inputs, monkeypatch):
    out = tmp_path / "mix"
    real_write = SafetensorsStreamWriter.write

    def write_and_move_in(self, name, tensor):
        if not out.exists():  # the user moves a folder to OUT after the ownership check
            out.mkdir()
            for i in range(30):
                (out / f"{i}.txt").write_text(f"file {i}")
        return real_write(self, name, tensor)

    monkeypatch.setattr(SafetensorsStreamWriter, "write", write_and_move_in)
    interrupt_when_checking_what_was_moved_aside(monkeypatch)
    result = merge_family(inputs, out, "--force", code=None)
    assert result.exit_code == 130 and result.stderr == "bam-surgery: interrupted; nothing was written\n"
    assert files_of(out) == {f"{i}.txt": f"file {i}".encode() for i in range(30)}
    assert not os.path.lexists(work_folder(out))


@pytest.mark.parametrize("kind", ["mix.safetensors", "mix"])
def test_interrupted_force_merge_keeps_the_previous_output(tmp_path, inputs, monkeypatch, kind):
    out = tmp_path / kind
    merge_family(inputs, out)
    before = files_of(tmp_path)
    interrupt_when_checking_what_was_moved_aside(monkeypatch)
    result = merge_family(inputs, out, "--force", "--router-seed", "5", code=None)
    assert result.exit_code == 130 and result.stderr == "bam-surgery: interrupted; nothing was written\n"
    assert files_of(tmp_path) == before  # the previous output, byte for byte; no work folder


def test_an_interrupt_after_the_new_output_is_in_place_says_it_was_written(tmp_path, inputs, monkeypatch):
    out = tmp_path / "mix"
    merge_family(inputs, out)
    monkeypatch.setattr(atomic, "step_hook", lambda name: name in ("landed", "exchanged") and _interrupt())
    result = merge_family(inputs, out, "--force", "--router-seed", "5", code=None)
    assert result.exit_code == 130
    assert result.stderr == f"bam-surgery: interrupted after {out} was written (it is complete)\n"
    assert not_own_output(out) is None and not os.path.lexists(work_folder(out))
    monkeypatch.setattr(atomic, "step_hook", None)
    again = tmp_path / "again"
    merge_family(inputs, again, "--router-seed", "5")
    assert files_of(out) == {k: v for k, v in files_of(again).items()}


def test_the_run_after_a_kill_in_the_commit_puts_the_previous_output_back(tmp_path, inputs):
    """The disk as a merge --force killed between its two renames leaves it: OUT moved aside, the new
    output complete beside it. The next run (without --force) must not remove the old output."""
    out = tmp_path / "mix.safetensors"
    merge_family(inputs, out)
    before = out.read_bytes()
    work = work_folder(out)
    work.mkdir()
    (work / "lock").write_text("12345\n")
    os.rename(out, work / "replaced")
    (work / out.name).write_bytes(before)
    result = merge_family(inputs, out, code=None)
    assert "put the previous" in result.stderr, result.stderr
    assert result.exit_code == 2 and "already exists" in result.stderr
    assert out.read_bytes() == before and not os.path.lexists(work)
    merge_family(inputs, out, "--force")


@pytest.mark.parametrize("command", ["merge", "convert"])
def test_an_interrupt_while_the_summary_is_printed_says_it_was_written(tmp_path, inputs, monkeypatch, command):
    """A Ctrl-C after the commit, in the command's own code (printing its `wrote ...` line): OUT is complete,
    so the line says `interrupted after OUT was written`, never "nothing was written" (issue 20)."""
    import click

    out = tmp_path / "mix"
    merge_family(inputs, out)
    real_echo = click.echo

    def echo(message=None, *args, **kwargs):
        if str(message).startswith("wrote "):
            raise KeyboardInterrupt
        return real_echo(message, *args, **kwargs)

    monkeypatch.setattr(click, "echo", echo)
    argv = (["merge", "--seed", str(inputs[0]), "--experts", ",".join(map(str, inputs[1:])), "--router-seed", "5"]
            if command == "merge" else ["convert", str(inputs[1])])
    result = CliRunner().invoke(cli, [*argv, "--out", str(out), "--force"])
    assert result.exit_code == 130
    assert result.stderr.splitlines()[-1] == f"bam-surgery: interrupted after {out} was written (it is complete)"
    monkeypatch.undo()
    assert not_own_output(out) is None and not os.path.lexists(work_folder(out))
    again = tmp_path / "again"
    assert CliRunner().invoke(cli, [*argv, "--out", str(again)]).exit_code == 0
    assert files_of(out) == files_of(again)


def test_the_readme_states_what_the_next_run_does_after_a_kill():
    """docs/safety.md's "What --force will and will not remove" (linked from the README) says what _settle does
    with a killed run's work folder: the displaced old output is put back (not removed) while the new one has not
    landed (issue 20)."""
    root = Path(__file__).resolve().parents[2]
    assert "docs/safety.md" in (root / "README.md").read_text(encoding="utf-8")
    doc = (root / "docs" / "safety.md").read_text(encoding="utf-8")
    section = " ".join(doc.split("## What `--force` will and will not remove")[1].split("\n## ")[0].split())
    assert "is put back at OUT if the new output never landed, and discarded only once it has" in section
    assert "interrupted after OUT was written" in section
    assert "removes it (its lock is free)" not in section


# ---- kill -9 of a real --force run in the commit window (issue 33) -------------------------------------
def _argv(command: str, inputs: list[Path]) -> list[str]:
    if command == "merge":
        return ["merge", "--seed", str(inputs[0]), "--experts", ",".join(map(str, inputs[1:])), "--router-seed", "5"]
    if command == "convert":
        return ["convert", str(inputs[1])]
    return ["export-onnx", str(inputs[1])]


KILLED_AT_NTH_STEP = """
import os, signal, sys
from bam_surgery.runtime import atomic
from bam_surgery.cli.commands import cli
calls = []
def hook(step):
    calls.append(step)
    if len(calls) == int(sys.argv[1]):
        os.kill(os.getpid(), signal.SIGKILL)
atomic.step_hook = hook
cli.main(sys.argv[2:], prog_name="bam-surgery")
"""


def tree(path: Path) -> dict[str, bytes] | None:
    if path.is_dir():
        return files_of(path)
    return {"": path.read_bytes()} if path.exists() else None


@pytest.mark.slow
@pytest.mark.parametrize("command,name,nth", [("merge", "mix.safetensors", 2), ("merge", "mix", 2), ("merge", "mix", 3),
                                              ("convert", "conv", 2), ("export-onnx", "onnx", 2)])
def test_a_force_run_killed_in_the_commit_window_leaves_out_whole(tmp_path, inputs, command, name, nth):
    """merge / convert / export-onnx --force SIGKILLed at the second or third step of the commit (past
    "ready": the old output is being replaced): OUT holds the old output or the new one, complete, never
    nothing; the next run settles the work folder."""
    out, again = tmp_path / name, tmp_path / "reference" / name  # the same name: a README names its folder
    argv = _argv(command, inputs)
    first = ["merge", "--seed", str(inputs[0]), "--experts", ",".join(map(str, inputs[1:]))] if command == "merge" \
        else argv
    assert CliRunner().invoke(cli, [*first, "--out", str(out)]).exit_code == 0
    old = tree(out)
    assert CliRunner().invoke(cli, [*argv, "--out", str(again)]).exit_code == 0
    new = tree(again)
    killed = subprocess.run([sys.executable, "-c", KILLED_AT_NTH_STEP, str(nth), *argv, "--out", str(out), "--force"],
                            capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert os.path.lexists(work_folder(out))
    now = tree(out)
    assert now in (old, new), f"OUT is {'absent' if now is None else 'neither the old nor the new output'}"
    result = CliRunner().invoke(cli, [*argv, "--out", str(out), "--force"])
    assert result.exit_code == 0, result.output
    assert tree(out) == new and not os.path.lexists(work_folder(out))
