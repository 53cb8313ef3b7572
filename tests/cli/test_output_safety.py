"""Output-path safety: --force replaces only what bam-surgery wrote, never anything else.

Every data-loss test puts real files beside (or at) OUT and checks they survive byte for byte:
`.`, `''`, `..`, a parent of the working directory, the home folder, a folder of someone else's
safetensors models, a folder of ours with a foreign file added, something created at OUT while a
merge runs (with and without --force), a second run on the same OUT. Plus: a killed run's work
folder is removed by the next run (never a live one's), outputs respect the umask, a failed run
leaves no parent folders, and write errors (no space, read-only file system, a parent that is a
file) are one line.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from conftest import error_line, merge_family, random_state, seed_and_experts, tiny_config
from bam_surgery.runtime import atomic
from bam_surgery.runtime.atomic import atomic_path, work_folder, write_text_atomic
from bam_surgery.runtime.checkpoint import load_checkpoint, save_checkpoint
from bam_surgery.runtime.errors import OutputError, OutputWriteError
from bam_surgery.runtime.outputs import MARKER, not_own_output, protected
from bam_surgery.runtime.safetensors_file import SafetensorsStreamWriter
from bam_surgery.cli.commands import cli

CFG = tiny_config(block="parallel", norm="layernorm")


@pytest.fixture
def inputs(tmp_path) -> list[Path]:
    """A seed and two experts (canonical files) under tmp_path/in."""
    return seed_and_experts(tmp_path / "in", CFG)


def snapshot(root: Path) -> dict[str, str]:
    """Every file under root (the root itself included when it is a file) -> sha256 of its bytes."""
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def debris(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".partial"))


# ---- never the working directory, its parents, home, root ----------------------------------------
@pytest.mark.parametrize("out", [".", "", "..", "./", "sub/.."])
def test_force_never_touches_the_working_directory(tmp_path, inputs, monkeypatch, out):
    work = tmp_path / "work"
    (work / "sub").mkdir(parents=True)
    (work / "notes.txt").write_text("my notes")
    (work / "model.safetensors").write_bytes(b"someone's model")
    monkeypatch.chdir(work)
    before = snapshot(tmp_path)
    result = merge_family(inputs, out, "--force", code=None)
    error_line(result)
    assert snapshot(tmp_path) == before


def test_force_never_touches_a_parent_of_the_working_directory_or_home(tmp_path, inputs, monkeypatch):
    deep = tmp_path / "a" / "b"
    deep.mkdir(parents=True)
    (tmp_path / "a" / "keep.txt").write_text("keep")
    home = tmp_path / "users" / "home"
    (home / "docs").mkdir(parents=True)
    (home / "docs" / "thesis.tex").write_text("years of work")
    monkeypatch.chdir(deep)
    monkeypatch.setenv("HOME", str(home))
    before = snapshot(tmp_path)
    error_line(merge_family(inputs, tmp_path / "a", "--force", code=None), "parent of the working directory")
    error_line(merge_family(inputs, home, "--force", code=None), "home folder")
    error_line(merge_family(inputs, home.parent, "--force", code=None), "parent of the home folder")
    assert snapshot(tmp_path) == before
    assert protected(Path("/")) == "is the root of the file system"


def test_force_keeps_a_folder_of_foreign_safetensors_models(tmp_path, inputs):
    models = tmp_path / "models"
    models.mkdir()
    save_file({"w": torch.ones(3)}, str(models / "model.safetensors"), metadata={"format": "pt"})
    save_file({"w": torch.zeros(3)}, str(models / "other.safetensors"))
    (models / "config.json").write_text(json.dumps({"model_type": "llama"}))
    before = snapshot(models)
    error_line(merge_family(inputs, models, "--force", code=None), str(models), "did not write", "--force replaces only")
    assert snapshot(models) == before and debris(tmp_path) == []


def test_force_keeps_a_foreign_file_and_our_folder_with_a_foreign_file_added(tmp_path, inputs):
    foreign = tmp_path / "mix.safetensors"
    save_file({"w": torch.ones(3)}, str(foreign), metadata={"format": "pt"})
    before = snapshot(foreign)
    error_line(merge_family(inputs, foreign, "--force", code=None), "did not write")
    assert snapshot(foreign) == before

    ours = tmp_path / "mix"
    merge_family(inputs, ours)
    assert (ours / MARKER).is_file() and not_own_output(ours) is None
    (ours / "notes.md").write_text("my results")
    before = snapshot(ours)
    error_line(merge_family(inputs, ours, "--force", code=None), "notes.md")
    assert snapshot(ours) == before


def test_force_replaces_our_own_outputs(tmp_path, inputs):
    for out in (tmp_path / "mix.safetensors", tmp_path / "mix"):
        merge_family(inputs, out)
        error_line(merge_family(inputs, out, code=None), "already exists", "--force")
        result = merge_family(inputs, out, "--force", "--router-seed", "5", code=None)
        assert result.exit_code == 0, result.output
        assert load_checkpoint(out)[0].ffn_experts == 3
    # a canonical folder written before folders carried the marker is recognised by its own metadata
    legacy = tmp_path / "legacy"
    save_checkpoint(random_state(CFG, 1), CFG, legacy, max_shard_bytes=20_000)
    (legacy / MARKER).unlink()
    assert not_own_output(legacy) is None
    merge_family(inputs, legacy, "--force")
    # an empty folder holds nothing to lose
    (tmp_path / "empty").mkdir()
    merge_family(inputs, tmp_path / "empty", "--force")


def test_python_api_replaces_only_its_own_outputs(tmp_path):
    target = tmp_path / "notes"
    target.mkdir()
    (target / "a.txt").write_text("x")
    with pytest.raises(OutputError, match="a.txt"):
        save_checkpoint(random_state(CFG), CFG, target)
    assert (target / "a.txt").read_text() == "x"
    path = save_checkpoint(random_state(CFG), CFG, tmp_path / "x.safetensors")
    save_checkpoint(random_state(CFG, 1), CFG, path)  # its own output: replaced
    with pytest.raises(OutputError, match="already exists"):
        with atomic_path(path, replace=False) as tmp:
            tmp.write_bytes(b"new")
    assert torch.equal(load_checkpoint(path)[1]["embed.weight"], random_state(CFG, 1)["embed.weight"])


# ---- whatever appears at OUT while a run writes survives --------------------------------------------
@pytest.mark.parametrize("force", [False, True])
@pytest.mark.parametrize("kind", ["file", "folder"])
def test_what_appears_at_out_during_a_merge_is_kept(tmp_path, inputs, monkeypatch, force, kind):
    out = tmp_path / ("mix.safetensors" if kind == "file" else "mix")
    real_write = SafetensorsStreamWriter.write

    def write_and_meddle(self, name, tensor):
        if not os.path.lexists(out):  # someone else creates OUT while the merge runs
            if kind == "file":
                out.write_text("a file someone saved here meanwhile")
            else:
                out.mkdir()
                (out / "notes.txt").write_text("a folder someone made here meanwhile")
        return real_write(self, name, tensor)

    monkeypatch.setattr(SafetensorsStreamWriter, "write", write_and_meddle)
    result = merge_family(inputs, out, *(["--force"] if force else []), code=None)
    error_line(result, str(out), "while this run was writing")
    assert out.exists() and "meanwhile" in (out.read_text() if kind == "file" else (out / "notes.txt").read_text())
    assert debris(tmp_path) == []


def test_a_second_run_on_the_same_out_fails_while_the_first_writes(tmp_path, inputs):
    out = tmp_path / "mix.safetensors"
    with atomic_path(out, replace=False) as tmp:  # the first run, still writing
        for force in ([], ["--force"]):
            error_line(merge_family(inputs, out, *force, code=None), "another bam-surgery run", f"pid {os.getpid()}")
        tmp.write_bytes(b"first")
    assert out.read_bytes() == b"first" and debris(tmp_path) == []


def test_a_killed_runs_work_folder_is_removed_by_the_next_run(tmp_path, inputs):
    out = tmp_path / "mix.safetensors"
    stale = work_folder(out)
    stale.mkdir()
    (stale / "lock").write_text("12345\n")  # nobody holds its lock: the run was killed
    (stale / out.name).write_bytes(b"half a checkpoint")
    result = CliRunner().invoke(cli, ["merge", "--seed", str(inputs[0]), "--experts", str(inputs[1]),
                                      "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "removed" in result.stderr and str(stale) in result.stderr
    assert out.is_file() and debris(tmp_path) == []
    # a folder with that name holding something else is not ours to remove
    other = tmp_path / "other.safetensors"
    work_folder(other).mkdir()
    (work_folder(other) / "diary.txt").write_text("mine")
    error_line(merge_family(inputs, other, code=None), "diary.txt")
    assert (work_folder(other) / "diary.txt").read_text() == "mine"


# ---- permissions, parents, write errors --------------------------------------------------------------
@pytest.mark.parametrize("umask,mode", [(0o022, 0o755), (0o077, 0o700)])
def test_outputs_respect_the_umask(tmp_path, inputs, umask, mode):
    old = os.umask(umask)
    try:
        merge_family(inputs, tmp_path / "mix")
        merge_family(inputs, tmp_path / "mix.safetensors")
    finally:
        os.umask(old)
    assert (tmp_path / "mix").stat().st_mode & 0o777 == mode
    assert (tmp_path / "mix.safetensors").stat().st_mode & 0o777 == mode & 0o666
    assert all(p.stat().st_mode & 0o777 == mode & 0o666 for p in (tmp_path / "mix").iterdir())


def test_a_failed_run_leaves_no_folder_it_created(tmp_path, inputs):
    state = load_checkpoint(inputs[1])[1]
    state["lm_head.weight"] = torch.full_like(state["lm_head.weight"], float("nan"))
    bad = save_checkpoint(state, CFG, tmp_path / "in" / "nan.safetensors")
    out = tmp_path / "new" / "deeper" / "mix.safetensors"
    error_line(merge_family([inputs[0], bad], out, code=None), "non-finite")
    assert not (tmp_path / "new").exists()


def test_a_parent_that_is_a_file_is_one_line(tmp_path, inputs):
    (tmp_path / "file.txt").write_text("not a folder")
    error_line(merge_family(inputs, tmp_path / "file.txt" / "mix.safetensors", code=None), "file.txt", "not a folder")
    assert (tmp_path / "file.txt").read_text() == "not a folder"


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EDQUOT, errno.EROFS])
def test_write_errors_are_one_line_and_leave_nothing(tmp_path, inputs, monkeypatch, err):
    def fail(self, name, tensor):
        raise OSError(err, os.strerror(err))
    monkeypatch.setattr(SafetensorsStreamWriter, "write", fail)
    out = tmp_path / "out" / "mix"
    line = error_line(merge_family(inputs, out, code=None), str(out), os.strerror(err))
    assert "Traceback" not in line and not (tmp_path / "out").exists()


def test_read_only_file_system_when_creating_the_output_folder(tmp_path, inputs, monkeypatch):
    real_mkdir = os.mkdir

    def read_only(path, *a, **k):
        if str(path).startswith(str(tmp_path / "ro")):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_mkdir(path, *a, **k)

    monkeypatch.setattr(os, "mkdir", read_only)
    error_line(merge_family(inputs, tmp_path / "ro" / "mix.safetensors", code=None), "Read-only file system")


def _enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # as a write(2) raises it: no file name


@pytest.mark.parametrize("call", ["open", "pwrite"])
def test_a_disk_too_full_for_the_lock_keeps_the_previous_output_and_names_out(tmp_path, inputs, monkeypatch,
                                                                                call):
    """merge --force on a full disk (issue 20, disk full): the lock file or its pid cannot be written. One line
    naming OUT; no work folder left; the previous output kept byte for byte."""
    out = tmp_path / "mix"
    merge_family(inputs, out)
    before = snapshot(tmp_path)
    real_open = os.open

    def full_open(path, *a, **k):
        if str(path).endswith(f"{atomic.PARTIAL_SUFFIX}/{atomic.LOCK}"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real_open(path, *a, **k)

    monkeypatch.setattr(os, call, full_open if call == "open" else _enospc)
    line = error_line(merge_family(inputs, out, "--force", "--router-seed", "5", code=None), str(out), "No space left on device")
    monkeypatch.undo()
    assert not os.path.lexists(work_folder(out)), line
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("where", ["write", "replace", "interrupt"])
def test_write_text_atomic_keeps_the_old_text_and_leaves_no_partial(tmp_path, monkeypatch, where):
    """The one atomic text writer (pipeline records, a run's `latest`, a truncated metrics.jsonl): a full disk
    or a Ctrl-C leaves the old text and no `.NAME.*.partial`; the error names the file."""
    path = tmp_path / "latest"
    write_text_atomic(path, "old\n")
    if where == "write":
        real_fdopen = os.fdopen

        class Full:
            def __init__(self, f):
                self.f = f

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self.f.close()

            def write(self, text):
                _enospc()

        monkeypatch.setattr(os, "fdopen", lambda fd, *a, **k: Full(real_fdopen(fd, *a, **k)))
    elif where == "replace":
        monkeypatch.setattr(os, "replace", _enospc)
    else:
        monkeypatch.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt if where == "interrupt" else OutputWriteError) as e:
        write_text_atomic(path, "new\n")
    monkeypatch.undo()
    if where != "interrupt":
        assert str(e.value) == f"{path}: could not be written (No space left on device); nothing was left there"
        assert e.value.errno == errno.ENOSPC
    assert path.read_text() == "old\n" and sorted(p.name for p in tmp_path.iterdir()) == ["latest"]
