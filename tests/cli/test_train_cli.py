"""`bam-surgery train`, `eval`, `plot` from the command line, and every bad input the issue names:
one line `bam-surgery: error: ...`, exit 2, and no checkpoint overwritten or lost."""
from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch

from conftest import cli_error_line, run_cli

from bam_surgery.runtime import Model, preset, save_model

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "data" / "domains"
SMALL = dict(d_model=32, n_layers=1, n_heads=4, n_kv_heads=4, ffn_hidden=48, max_positions=32)


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny matrices (conftest.one_thread)


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tokens")


@pytest.fixture
def mix(tmp_path) -> Path:
    model = Model(preset("tiny", **SMALL, ffn_experts=2, attn_experts=2))
    model.reset_parameters(seed=1)
    return save_model(model, tmp_path / "mix.safetensors")


run, error_line = run_cli, cli_error_line


def train_args(init: Path, out: Path, cache: Path, data: str | None = None, *extra) -> list:
    return ["train", "--init", init, "--data", data or f"code={CORPUS}/code,law={CORPUS}/law:0.5", "--out", out,
            "--seq-len", 16, "--micro-batch", 2, "--steps", 2, "--warmup-steps", 1, "--lr", 1e-3,
            "--eval-tokens", 64, "--token-cache", cache, "--no-plot", "--no-progress", *extra]


def _digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_train_eval_plot_inspect(tmp_path, mix, cache):
    run(*train_args(mix, tmp_path / "run", cache, None, "--save-every", 1, "--eval-every", 1))
    ckpt = tmp_path / "run" / "checkpoints" / "step-00000002"
    assert (ckpt / "trainer.safetensors").is_file() and (tmp_path / "run" / "config.yaml").is_file()
    out = run("eval", tmp_path / "run", "--data", f"code={CORPUS}/code,law={CORPUS}/law", "--max-tokens", 100,
              "--seq-len", 16, "--token-cache", cache).output
    assert f"checkpoint  {ckpt}" in out and "FFN experts: share of tokens" in out
    assert "attention experts: mean gate" in out and "expert0" in out
    body = json.loads(run("eval", ckpt, "--data", f"code={CORPUS}/code", "--max-tokens", 100, "--seq-len", 16,
                          "--token-cache", cache, "--json").output)
    code = body["domains"]["code"]
    assert code["tokens"] == 100 and set(code["routing"]) == {"ffn", "attn"}
    assert set(code["routers"]) == {"layers.0.ffn_router", "layers.0.attn_router"}
    result = run("plot", tmp_path / "run", "--out", tmp_path / "png")
    assert sorted(p.name for p in (tmp_path / "png").iterdir()) == ["eval.png", "loss.png", "lr.png"]
    assert (tmp_path / "png" / "loss.png").read_bytes()[:4] == b"\x89PNG" and "wrote" in result.stderr
    shown = run("inspect", ckpt).output
    assert "training (oldest first)" in shown and "code 0.67, law 0.33" in shown
    # a run folder stands for its latest checkpoint
    same = lambda a, b: a.replace(str(ckpt), "RUN") == b.replace(str(ckpt), "RUN").replace(str(tmp_path / "run"), "RUN")  # noqa: E731
    assert same(shown, run("inspect", tmp_path / "run").output)
    assert same(run("count-params", ckpt).output, run("count-params", tmp_path / "run").output)


@pytest.mark.parametrize("data, message", [
    ("code={missing}", "code={missing}: no such file or folder"),
    ("code={empty}", "code={empty} (train split): no text"),
    ("code={corpus}/code:-1", "weight -1 must be a finite number >= 0"),
    ("code={corpus}/code:lots", "weight 'lots' is not a number"),
    ("code={corpus}/code:0.5,code={corpus}/law", "domain 'code' appears twice"),
])
def test_bad_data(tmp_path, mix, cache, data, message):
    (tmp_path / "empty.txt").write_text("\n\n<|doc|>\n  \n")
    fill = dict(missing=tmp_path / "nope", empty=tmp_path / "empty.txt", corpus=CORPUS)
    line = error_line(*train_args(mix, tmp_path / "run", cache, data.format(**fill)))
    assert message.format(**fill) in line
    assert not (tmp_path / "run").exists()


def test_tokenizer_that_does_not_fit_the_vocabulary(tmp_path, cache):
    small = save_model(Model(preset("tiny", **{**SMALL, "vocab_size": 64})), tmp_path / "small.safetensors")
    line = error_line(*train_args(small, tmp_path / "run", cache))
    assert "tokenizer bytes has 256 tokens but the model's vocabulary has 64 (vocab_size)" in line
    assert not (tmp_path / "run").exists()


def test_existing_run_folder_without_resume(tmp_path, mix, cache):
    run(*train_args(mix, tmp_path / "run", cache))
    before = _digest(tmp_path / "run")
    line = error_line(*train_args(mix, tmp_path / "run", cache))
    assert "--out " in line and "run folder exists; pass --resume" in line
    assert _digest(tmp_path / "run") == before


def test_resume_refuses_corrupt_checkpoints_and_changed_settings(tmp_path, mix, cache):
    run(*train_args(mix, tmp_path / "run", cache, None, "--save-every", 1))
    ckpt = tmp_path / "run" / "checkpoints" / "step-00000002"
    assert "differs from the run's" in error_line("train", "--out", tmp_path / "run", "--resume", "--lr", 0.5)
    weights = ckpt / "model-00001-of-00001.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])  # truncated
    before = _digest(tmp_path / "run")
    line = error_line("train", "--out", tmp_path / "run", "--resume", "--steps", 4)
    assert f"cannot resume from {ckpt}" in line and "truncated" in line
    assert _digest(tmp_path / "run") == before
    trainer = ckpt / "trainer.safetensors"
    weights.unlink()
    trainer.write_bytes(b"garbage")
    assert f"cannot resume from {ckpt}" in error_line("train", "--out", tmp_path / "run", "--resume")
    assert "nothing to resume" in error_line("train", "--out", tmp_path / "other", "--resume")


def test_other_bad_inputs(tmp_path, mix, cache):
    assert "give exactly one of --init CKPT, --preset NAME" in error_line(
        "train", "--data", f"code={CORPUS}/code", "--out", tmp_path / "r")
    assert "no such file or directory" in error_line(*train_args(tmp_path / "nope.safetensors", tmp_path / "r",
                                                                 cache))
    assert "batch_tokens 100 is not a multiple of" in error_line(*train_args(mix, tmp_path / "r", cache, None,
                                                                            "--batch-tokens", 100))
    assert "pattern 'expertz' matches no parameter" in error_line(*train_args(mix, tmp_path / "r", cache, None,
                                                                             "--trainable", "expertz"))
    assert "seq_len 64 exceeds the model's max_positions (32)" in error_line(
        *train_args(mix, tmp_path / "r", cache, None, "--seq-len", 64))
    (tmp_path / "t.yaml").write_text("warmup: 5\n")
    assert "warmup: unknown training knob" in error_line("train", "--config", tmp_path / "t.yaml")
    assert "no training metrics" in error_line("plot", tmp_path)
    assert not (tmp_path / "r").exists()


def test_identical_runs_write_identical_checkpoints(tmp_path, mix, cache, monkeypatch):
    """Two runs of one config write the same bytes: the torch RNG state in trainer.safetensors is seeded
    from the config (it was whatever the process's generator held) and the elapsed seconds live in
    timing.json, the one file that may differ. Each run goes in its own folder with the same relative
    --out, since the provenance records --out."""
    folders = []
    for draws in (1, 5):
        (tmp_path / str(draws)).mkdir()
        monkeypatch.chdir(tmp_path / str(draws))
        torch.rand(draws)  # the process's generator is somewhere else before each run
        before = torch.get_rng_state()
        run(*train_args(mix, "run", cache))
        assert torch.equal(torch.get_rng_state(), before)  # the caller's generator is left as it was
        folders.append(tmp_path / str(draws) / "run" / "checkpoints" / "step-00000002")
    first, second = (_digest(f) for f in folders)
    assert "trainer.safetensors" in first and "model-00001-of-00001.safetensors" in first
    assert sorted(name for name in first.keys() | second.keys() if first.get(name) != second.get(name)) in (
        [], ["timing.json"])


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_eval_shows_progress_on_a_terminal_only(tmp_path, mix, cache, monkeypatch):
    """eval draws a bar on stderr when it is a terminal (it ran silent), and prints nothing extra when not."""
    args = ["eval", mix, "--data", f"code={CORPUS}/code,law={CORPUS}/law", "--max-tokens", 160, "--seq-len", 16,
            "--batch-size", 2, "--token-cache", cache]
    piped = run(*args)
    assert piped.stderr == "" and "perplexity" in piped.stdout  # nothing extra when stderr is not a terminal
    import tqdm

    from bam_surgery.cli.commands import cli

    class EveryBatch(tqdm.tqdm):  # redraw at every update, not every 0.1 s: the test reads each drawing
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "mininterval": 0, "miniters": 1})

    monkeypatch.setattr(tqdm, "tqdm", EveryBatch)
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    monkeypatch.setattr(sys, "stderr", _Terminal())
    cli.main([str(a) for a in args], standalone_mode=False)
    assert sys.stdout.getvalue() == piped.stdout
    shown = sys.stderr.getvalue()
    # 160 tokens per domain: 10 windows of 16, 5 batches of 2; the bar counts all 10 and is removed at the end
    assert "| 5/10 [" in shown and "| 10/10 [" in shown and "batch/s" in shown, shown
    assert re.search(r"eval code: .*\| 1/10 \[", shown) and re.search(r"eval law: .*\| 6/10 \[", shown), shown
    assert re.search(r"\r +\r$", shown), shown  # cleared: the report follows on a clean terminal


def test_plot_replaces_only_pngs_it_wrote(tmp_path):
    """`plot RUN --out DIR` (issue 20, item 3): a user's loss.png in DIR, in a DIR reached through a symbolic
    link, or a symbolic link named loss.png, is refused before anything is drawn, as routing-stats --plot
    refuses (one rule: train.plot.plot_files); its own PNGs are replaced."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    lines = [{"kind": "train", "step": s, "loss": 3.0 / s, "nll": 3.0 / s, "lr": 1e-3} for s in (1, 2, 3)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "loss.png").write_bytes(b"\x89PNG a user's plot")
    (mine / "notes.txt").write_text("notes")
    (tmp_path / "link").symlink_to(mine)
    for out in (mine, tmp_path / "link"):
        line = error_line("plot", run_dir, "--out", out)
        assert f"{out / 'loss.png'} exists and was not written by bam-surgery" in line
    assert (mine / "loss.png").read_bytes() == b"\x89PNG a user's plot"
    assert sorted(p.name for p in mine.iterdir()) == ["loss.png", "notes.txt"]  # lr.png not drawn either
    (run_dir / "loss.png").write_text("the user's own, in the run folder")
    assert "loss.png exists and was not written by bam-surgery" in error_line("plot", run_dir)
    (run_dir / "loss.png").unlink()
    ours = tmp_path / "png"
    run("plot", run_dir, "--out", ours)
    (ours / "elsewhere.png").write_bytes((ours / "lr.png").read_bytes())
    (ours / "lr.png").unlink()
    (ours / "lr.png").symlink_to(ours / "elsewhere.png")  # a link, even to a PNG of ours, is not replaced
    assert "lr.png exists and was not written" in error_line("plot", run_dir, "--out", ours)
    (ours / "lr.png").unlink()
    before = (ours / "loss.png").stat().st_mtime_ns
    assert "wrote" in run("plot", run_dir, "--out", ours).stderr  # our own PNGs are replaced
    assert (ours / "loss.png").stat().st_mtime_ns >= before and (ours / "lr.png").is_file()
    run("plot", run_dir)  # into the run folder: twice, the second replacing the first
    run("plot", run_dir)


@pytest.mark.parametrize("line, says", [
    ({"kind": "train", "step": 2, "loss": "3.1", "nll": 3.1, "lr": 1e-3}, "line 2: loss is \"3.1\", not a number"),
    ({"kind": "train", "loss": 3.1, "nll": 3.1, "lr": 1e-3}, "line 2: a train record whose step is missing"),
    ({"kind": "eval", "step": 1, "domains": 5}, "line 2: an eval record whose domains is 5, not an object"),
    ("[" * 100_000 + "]" * 100_000, "line 2: JSON nested too deeply"),
    ([1, 2, 3], "line 2: a JSON list, not an object"),
])
def test_plot_malformed_metrics_is_one_line(tmp_path, line, says):
    """`plot` on a malformed metrics.jsonl (issue 20, tracebacks: wrong types, missing step, `"domains": 5`,
    deep nesting, a list line): one error line naming the line, nothing drawn."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    good = json.dumps({"kind": "train", "step": 1, "loss": 3.0, "nll": 3.0, "lr": 1e-3})
    bad = line if isinstance(line, str) else json.dumps(line)
    (run_dir / "metrics.jsonl").write_text(f"{good}\n{bad}\n{good}\n")
    assert says in error_line("plot", run_dir)
    assert sorted(p.name for p in run_dir.iterdir()) == ["metrics.jsonl"]
    (run_dir / "metrics.jsonl").write_text(f"{good}\n{bad[:len(bad) // 2]}")  # a torn last line is skipped
    run("plot", run_dir)
    assert (run_dir / "loss.png").is_file()


def test_resume_of_a_finished_run_is_one_line(tmp_path, mix, cache):
    """Issue 20: `train --resume` on a run that finished its steps was a TypeError (no step ran, no loss)."""
    run(*train_args(mix, tmp_path / "run", cache))
    before = _digest(tmp_path / "run")
    line = error_line("train", "--out", tmp_path / "run", "--resume")
    assert f"--resume: {tmp_path / 'run'} has finished its 2 steps (step-00000002); pass --steps N with N > 2" in line
    assert _digest(tmp_path / "run") == before


_KILLED_HOLDER = """
import os, signal, sys
from pathlib import Path
from bam_surgery.runtime.locks import lock_file
lock_file(Path(sys.argv[1]), Path(sys.argv[1]).parent)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_one_train_run_per_out(tmp_path, mix, cache, monkeypatch):
    """Issue 20, item 8: a second `train` into the --out a live run writes (fresh, or --resume) fails at once in
    one line naming the holder, and changes nothing there; the lock is held for the whole run and released at
    its end; a lock left by a killed run (kill -9) is taken over."""
    import subprocess

    from bam_surgery.runtime.locks import lock_file, unlock_file
    from bam_surgery.train import metrics
    from bam_surgery.train.loop import RUN_LOCK

    out = tmp_path / "run"
    lock = out / RUN_LOCK
    out.mkdir()
    fd = lock_file(lock, out)  # a live run holds it
    line = error_line(*train_args(mix, out, cache))
    assert f"--out {out}: another bam-surgery run (pid {os.getpid()}) is writing it right now" in line
    assert [p.name for p in out.iterdir()] == [RUN_LOCK]
    unlock_file(fd, lock)

    seen = []
    write = metrics.MetricsWriter.write

    def try_a_second_run(self, rec):  # inside the run: the lock is held
        with pytest.raises(Exception, match="another bam-surgery run"):
            unlock_file(lock_file(lock, out), lock)
        seen.append(rec["step"])
        write(self, rec)

    monkeypatch.setattr(metrics.MetricsWriter, "write", try_a_second_run)
    run(*train_args(mix, out, cache, None, "--eval-every", -1))
    monkeypatch.undo()
    assert seen == [1, 2] and not os.path.lexists(lock)  # released

    before = _digest(out)
    fd = lock_file(lock, out)
    line = error_line("train", "--out", out, "--resume", "--steps", 3)
    assert "another bam-surgery run" in line and f"pid {os.getpid()}" in line
    unlock_file(fd, lock)
    assert _digest(out) == before

    subprocess.run([sys.executable, "-c", _KILLED_HOLDER, str(lock)], check=False, timeout=120)
    assert lock.read_text().strip().isdigit()  # left behind by the killed holder, with its pid
    run("train", "--out", out, "--resume", "--steps", 3)
    assert not os.path.lexists(lock)
    steps = [json.loads(s)["step"] for s in (out / "metrics.jsonl").read_text().splitlines()
             if json.loads(s)["kind"] == "train"]
    assert steps == [1, 2, 3]


def test_a_refused_fresh_run_leaves_no_folder(tmp_path, mix, cache):
    """The lock is taken in a folder the fresh run creates; a run refused during set-up removes it again."""
    out = tmp_path / "a" / "b" / "run"
    assert "no-such-domain" in error_line(*train_args(mix, out, cache, "code=no-such-domain"))
    assert list(tmp_path.iterdir()) == [tmp_path / "mix.safetensors"]


def _no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # as write(2) raises it: no file name


class _FullFile:
    """An open text file whose writes find the disk full."""

    def __init__(self, f):
        self.f = f

    def write(self, text):
        _no_space()

    def flush(self):
        pass

    def close(self):
        self.f.close()


def _failed_with(*args) -> str:
    """Status 2, and one error line, the last (a run that started has printed its progress lines above it)."""
    lines = run(*args, code=2).stderr.splitlines()
    assert [ln for ln in lines if ln.startswith("bam-surgery:")] == lines[-1:], lines
    assert lines[-1].startswith("bam-surgery: error: "), lines
    return lines[-1]


@pytest.mark.parametrize("where, names", [("run.json", "run/run.json"), ("metrics", "run/metrics.jsonl"),
                                          ("checkpoint", "run/checkpoints/step-00000002")])
def test_a_full_disk_before_the_first_checkpoint_leaves_nothing(tmp_path, mix, cache, monkeypatch, where, names):
    """Disk full in a fresh `train` before its first checkpoint (issue 20, disk full): one line naming the file;
    the run folder (which could not be resumed) is removed, so the next `train --out` on the same path runs."""
    from bam_surgery.runtime.safetensors_file import SafetensorsStreamWriter
    from bam_surgery.train import metrics

    if where == "run.json":
        real = os.replace
        monkeypatch.setattr(os, "replace", lambda src, dst: _no_space() if Path(dst).name == "run.json"
                            else real(src, dst))
    elif where == "metrics":
        monkeypatch.setattr(metrics, "open", lambda *a, **k: _FullFile(open(*a, **k)), raising=False)
    else:
        monkeypatch.setattr(SafetensorsStreamWriter, "write", _no_space)
    line = _failed_with(*train_args(mix, tmp_path / "run", cache))
    monkeypatch.undo()
    assert str(tmp_path / names) in line and "No space left on device" in line, line
    assert not (tmp_path / "run").exists()
    run(*train_args(mix, tmp_path / "run", cache))
    assert (tmp_path / "run" / "checkpoints" / "step-00000002").is_dir()


def test_a_full_disk_after_a_checkpoint_leaves_a_run_to_resume(tmp_path, mix, cache, monkeypatch):
    from bam_surgery.runtime.safetensors_file import SafetensorsStreamWriter

    real = SafetensorsStreamWriter.write
    monkeypatch.setattr(SafetensorsStreamWriter, "write", lambda self, name, tensor: _no_space()
                        if "step-00000002" in str(self.path) else real(self, name, tensor))
    line = _failed_with(*train_args(mix, tmp_path / "run", cache, None, "--save-every", 1))
    monkeypatch.undo()
    assert "step-00000002: could not be written (No space left on device)" in line
    assert [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()] == ["latest", "step-00000001"]
    assert "resuming" in run("train", "--out", tmp_path / "run", "--resume").stderr
    assert (tmp_path / "run" / "checkpoints" / "step-00000002").is_dir()


def test_a_users_plot_in_the_run_folder_is_refused_before_training(tmp_path, mix, cache):
    """`train --resume` into a run folder holding a user's loss.png (issue 20): refused up front, by the rule of
    `plot` (train.plot.plot_files), not after training at the end-of-training plot; nothing changed."""
    run(*train_args(mix, tmp_path / "run", cache, None, "--plot"))
    (tmp_path / "run" / "loss.png").write_bytes(b"\x89PNG a user's plot")
    before = _digest(tmp_path / "run")
    line = error_line("train", "--out", tmp_path / "run", "--resume", "--steps", 4)
    assert f"--plot: {tmp_path / 'run' / 'loss.png'} exists and was not written by bam-surgery" in line, line
    assert "pass --no-plot" in line
    assert _digest(tmp_path / "run") == before  # no step trained, no metrics line written
    (tmp_path / "run" / "loss.png").unlink()
    assert "plots: " in run("train", "--out", tmp_path / "run", "--resume", "--steps", 4).stderr
    assert (tmp_path / "run" / "checkpoints" / "step-00000004").is_dir()


@pytest.mark.parametrize("args,says", [
    (("--lr", "1e300"), "lr: must be finite and at most 10.0"),
    (("--seed", str(2**64)), "seed: must be an integer from 0 to"), (("--seed", str(10**30)), "seed: must be"),
    (("--seed", "-1"), "seed: must be an integer from 0 to"),
    (("--batch-tokens", str(10**14)), "batch_tokens: must be finite and at most 2,147,483,648"),
    (("--z-coef", "inf"), "z_coef: must be finite"), (("--lb-coef", "nan"), "lb_coef: must be"),
])
def test_number_options_are_bounded_before_any_work(tmp_path, args, says):
    """Issue 33: an overflow traceback (--lr 1e300), Overflow/ValueError tracebacks (--seed 2**64, 10**30, -1),
    a MemoryError after 118 s (--batch-tokens), a run to a NaN loss (--z-coef inf)."""
    line = error_line("train", "--preset", "tiny", "--data", f"code={CORPUS}/code", "--out", tmp_path / "run", *args)
    assert says in line
    assert not (tmp_path / "run").exists()
