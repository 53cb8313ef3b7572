"""Issue 33: the files a training run reads back on `--resume` (run.json, metrics.jsonl, the trainer state's
metadata) and the files it is started from (--model-config), damaged, deep, huge or not files at all: one line
`bam-surgery: error: ...` naming the file (and line or field), exit status 2, never a traceback or a hang."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from conftest import cli_error_line, error_line as error_line_of
from test_train_cli import SMALL, train_args  # tests/cli: the tiny run's arguments

from bam_surgery.runtime import Model, preset, save_model
from bam_surgery.runtime.safetensors_file import SafetensorsFile
from bam_surgery.train.checkpoints import TRAINER_FILE, TRAINER_KEY

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]  # one short training run per module


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A run folder of 2 steps with a checkpoint at each."""
    from conftest import run_cli

    root = tmp_path_factory.mktemp("finished")
    model = Model(preset("tiny", **SMALL, ffn_experts=2, attn_experts=2))
    model.reset_parameters(seed=1)
    init = save_model(model, root / "mix.safetensors")
    run_cli(*train_args(init, root / "run", root / "cache", None, "--save-every", 1))
    return root / "run"


def copy_of(finished: Path, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(finished, run, symlinks=True)
    return run


def resume(run: Path) -> str:
    return cli_error_line("train", "--out", run, "--resume", "--steps", 3)


RUN_JSON = {
    "list": (b"[1, 2]", "expected a JSON object"),
    "garbage": (b"\x00\xffgarbage", "not UTF-8"),
    "no-init": (None, "field 'init' is missing"),
    "init-list": ({"init": [1]}, "field 'init' must be an object"),
    "experts-str": ({"experts": "ab"}, "field 'experts' must be an object"),
    "tokenizer-fingerprint": ({"tokenizer": {"name": "x", "fingerprint": 5}}, "field 'fingerprint' must be a string"),
    "tokenizer-eos": ({"tokenizer": {"name": "x", "fingerprint": "y", "eos_id": "0"}}, "field 'eos_id' must be an integer"),
    "deep": (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    "deep-64": (b'{"init": ' + b"[" * 100 + b"]" * 100 + b"}", "nested more than 64 deep"),
}


@pytest.mark.parametrize("case", sorted(RUN_JSON))
def test_a_damaged_run_json(finished, tmp_path, case):
    run = copy_of(finished, tmp_path)
    body, needle = RUN_JSON[case]
    if body is None:
        info = json.loads((run / "run.json").read_text())
        del info["init"]
        body = json.dumps(info).encode()
    elif isinstance(body, dict):
        body = json.dumps({**json.loads((run / "run.json").read_text()), **body}).encode()
    (run / "run.json").write_bytes(body)
    line = resume(run)
    assert "run.json" in line and needle in line, line


def test_a_run_json_that_is_a_device(finished, tmp_path):
    run = copy_of(finished, tmp_path)
    (run / "run.json").unlink()
    (run / "run.json").symlink_to("/dev/zero")
    assert "run.json: not a regular file" in resume(run)


METRICS = {
    "list": (b"[1, 2]\n", "line 2: a JSON list, not an object"),
    "null": (b"null\n", "line 2: a JSON NoneType, not an object"),
    "string-step": (b'{"kind": "train", "step": "1"}\n', "line 2: a train record whose step is \"1\""),
    "deep": (b"[" * 100_000 + b"]" * 100_000 + b"\n", "line 2: JSON nested too deeply"),
    "digits": (b'{"kind": "train", "step": ' + b"9" * 5000 + b"}\n", "line 2: not valid here: an integer has too many"),
    "not-utf8": (b'{"kind": "train", "step": 1, "x": "\xff"}\n', "line 2: not UTF-8"),
}


@pytest.mark.parametrize("case", sorted(METRICS))
def test_a_damaged_metrics_jsonl(finished, tmp_path, case):
    run = copy_of(finished, tmp_path)
    metrics = run / "metrics.jsonl"
    first = metrics.read_bytes().split(b"\n")[0]
    body, needle = METRICS[case]
    metrics.write_bytes(first + b"\n" + body)
    line = resume(run)
    assert "metrics.jsonl " in line and needle in line, line


def test_metrics_jsonl_as_a_fifo_or_a_sparse_file(finished, tmp_path):
    run = copy_of(finished, tmp_path)
    metrics = run / "metrics.jsonl"
    metrics.unlink()
    os.mkfifo(metrics)  # opened for reading, it used to wait for a writer forever
    assert "metrics.jsonl: not a regular file" in resume(run)
    metrics.unlink()
    with open(metrics, "wb") as f:
        f.truncate(4 << 30)  # 4 GB of zeros, no newline: a MemoryError when read whole
    assert "metrics.jsonl line 1: longer than" in resume(run)


@pytest.mark.parametrize("meta,needle", [("[1]", "expected a JSON object"), ("[" * 50_000 + "]" * 50_000, "nested"),
                                         ('{"step": ' + "9" * 5000 + "}", "too many digits")])
def test_a_damaged_trainer_state(finished, tmp_path, meta, needle):
    from safetensors.torch import save_file

    run = copy_of(finished, tmp_path)
    trainer = run / "checkpoints" / "step-00000002" / TRAINER_FILE
    f = SafetensorsFile(trainer)
    tensors = {k: f.get(k) for k in f.keys()}
    save_file(tensors, str(trainer), metadata={**f.metadata, TRAINER_KEY: meta})
    line = resume(run)
    assert f"{TRAINER_FILE}: {TRAINER_KEY}" in line and needle in line, line


@pytest.mark.parametrize("name", ["cfg.json", "cfg.yaml"])
def test_model_config_that_is_a_device_or_a_fifo(tmp_path, name):
    link = tmp_path / name
    link.symlink_to("/dev/zero")  # a MemoryError when read whole
    line = cli_error_line("train", "--model-config", link, "--data", "code=x", "--out", tmp_path / "run")
    assert f"{name}: not a regular file" in line
    assert not (tmp_path / "run").exists()


# ---- a run folder killed before its first checkpoint (issue 33) --------------------------------------------
def killed_before_its_first_checkpoint(finished: Path, tmp_path: Path, in_checkpoint: bool = False) -> Path:
    """The folder a fresh `train --out RUN` killed with kill -9 after writing config.yaml, run.json and its
    first metrics leaves (in_checkpoint: killed while writing its first checkpoint, whose work folder stays)."""
    run = copy_of(finished, tmp_path)
    shutil.rmtree(run / "checkpoints")
    (run / "checkpoints").mkdir()
    (run / ".config.yaml.x1y2.partial").write_text("half")  # write_text_atomic's file, cut short
    if in_checkpoint:
        work = run / "checkpoints" / ".step-00000001.bam-surgery.partial"
        (work / "step-00000001").mkdir(parents=True)
        (work / "lock").write_text("12345\n")
        (work / "step-00000001" / "model.safetensors").write_bytes(b"half")
    return run


def again(finished: Path, run: Path, *extra, code: int | None = 0):
    from conftest import run_cli

    root = finished.parent
    return run_cli(*train_args(root / "mix.safetensors", run, root / "cache", None, *extra), code=code)


@pytest.mark.parametrize("in_checkpoint", [False, True])
def test_a_run_killed_before_its_first_checkpoint_is_started_again_by_the_same_train(finished, tmp_path,
                                                                                     in_checkpoint):
    run = killed_before_its_first_checkpoint(finished, tmp_path, in_checkpoint)
    result = again(finished, run)
    assert "left by a run stopped before its first checkpoint" in result.output
    assert (run / "checkpoints" / "step-00000002").is_dir()
    assert not list(run.glob(".*.partial")) and not list((run / "checkpoints").glob(".*"))


def test_a_run_killed_between_run_json_and_config_yaml_is_started_again(finished, tmp_path):
    """run.json is written first, so a run killed before its config.yaml lands is still recognised as the tool's."""
    run = killed_before_its_first_checkpoint(finished, tmp_path)
    (run / "config.yaml").unlink()
    (run / "metrics.jsonl").unlink()
    result = again(finished, run)
    assert "left by a run stopped before its first checkpoint" in result.output
    assert (run / "checkpoints" / "step-00000002").is_dir()


def test_run_json_lands_before_config_yaml(finished, tmp_path, monkeypatch):
    """The order that makes the test above the only state a kill between the two can leave."""
    from bam_surgery.train import loop

    order = []
    real = loop.write_text_atomic
    monkeypatch.setattr(loop, "write_text_atomic", lambda path, text: (order.append(Path(path).name), real(path, text)))
    again(finished, tmp_path / "fresh")
    assert order.index("run.json") < order.index("config.yaml"), order


def test_resume_of_a_run_killed_before_its_first_checkpoint_says_what_to_do(finished, tmp_path):
    run = killed_before_its_first_checkpoint(finished, tmp_path)
    line = resume(run)
    assert "no checkpoint yet" in line and "without --resume" in line and f"--out {run}" in line, line


@pytest.mark.parametrize("case", ["a-users-file", "not-our-run-json", "a-link"])
def test_a_run_folder_with_what_the_tool_did_not_write_is_not_touched(finished, tmp_path, case):
    run = killed_before_its_first_checkpoint(finished, tmp_path)
    if case == "a-users-file":
        (run / "notes.txt").write_text("mine")
    elif case == "not-our-run-json":
        (run / "run.json").write_text(json.dumps({"tool": {"name": "other"}, "init": {}}))
    else:
        (run / "metrics.jsonl").unlink()
        (run / "metrics.jsonl").symlink_to(tmp_path / "elsewhere.jsonl")
    before = sorted(p.name for p in run.iterdir())
    line = error_line_of(again(finished, run, code=2))
    assert "run folder exists" in line, line
    assert sorted(p.name for p in run.iterdir()) == before


def test_the_document_separator_is_recorded_and_kept_on_resume(finished, tmp_path):
    """run.json and the model card say which token separated the documents and why; a resumed run keeps its own
    separator (here one the rule would not choose today) rather than the rule's."""
    from conftest import run_cli

    info = json.loads((finished / "run.json").read_text())
    assert (info["tokenizer"]["eos_id"], info["tokenizer"]["eos_reason"]) == (0, "the byte tokenizer's end of text (id 0)")
    card = finished / "checkpoints" / "step-00000002" / "README.md"
    assert "- Document separator: the byte tokenizer's end of text (id 0)" in card.read_text()
    run = copy_of(finished, tmp_path)
    info["tokenizer"].update(eos_id=5, eos_reason="--eos-id 5", fingerprint="bytes-v1-eos5")
    (run / "run.json").write_text(json.dumps(info))
    run_cli("train", "--out", run, "--resume", "--steps", 3)
    assert json.loads((run / "run.json").read_text())["tokenizer"]["eos_id"] == 5
