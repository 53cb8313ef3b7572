"""The run folder and its checkpoints.

    RUN/
      config.yaml                 the resolved TrainConfig (what --resume reads back)
      run.json                    what the run resolved once: world size, accumulation, tokenizer, data
      metrics.jsonl               one line per step ({"kind": "train", ...}) and per evaluation ("eval")
      loss.png lr.png eval.png    `bam-surgery plot RUN` (and the end of the run)
      checkpoints/
        step-00000200/            a canonical checkpoint directory (loads with load_model / open_checkpoint)
          config.json  model.safetensors.index.json  model-00001-of-00001.safetensors
          trainer.safetensors     optimizer moments and step per parameter, RNG; metadata "bam_trainer":
                                  step, tokens, data position (JSON); the same bytes for the same run
          timing.json             {"elapsed_s": seconds of training steps so far}: the one file that differs
                                  between two runs of the same config
          tokenizer.json ...      the tokenizer the run used (absent for the byte-level one)
          README.md               model card: experts, training summary, last evaluation
        latest                    the newest checkpoint's folder name (for people and scripts)

A checkpoint is written into a temporary folder beside its final name and renamed into place when
complete; `latest` is then replaced atomically, and only after that are checkpoints beyond the newest
`keep_last` removed (the final one of a run is never removed). A crash at any point leaves every
complete checkpoint as it was.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from bam_surgery.runtime import check_layout
from bam_surgery.runtime.atomic import atomic_path, write_text_atomic
from bam_surgery.runtime.checkpoint import CheckpointError, CheckpointReader
from bam_surgery.runtime.checkpoint import save_checkpoint as write_canonical
from bam_surgery.runtime.safetensors_file import SafetensorsFile, SafetensorsStreamWriter
from bam_surgery.runtime.shards import copy_side_file
from bam_surgery.runtime.config import ConfigError
from bam_surgery.converters.run_folder import (CHECKPOINTS, is_run_folder, latest_checkpoint,  # noqa: F401
                                               list_checkpoints, resolve_run_folder, step_dir_name)
from bam_surgery.runtime.jsonfile import json_field, parse_json, read_json

from .errors import TrainError

LATEST = "latest"
TRAINER_FILE = "trainer.safetensors"
TRAINER_KEY = "bam_trainer"
TIMING_FILE = "timing.json"


def resolve_checkpoint(spec: str) -> str:
    """A run folder stands for its latest checkpoint; anything else is returned as is."""
    try:
        return resolve_run_folder(spec)
    except CheckpointError as e:
        raise TrainError(str(e)) from None


def _write_trainer_state(path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    entries = [(k, tuple(v.shape), v.dtype) for k, v in tensors.items()]
    with SafetensorsStreamWriter(path, entries, {TRAINER_KEY: json.dumps(meta, sort_keys=True)}) as w:
        for k, v in tensors.items():
            w.write(k, v.contiguous())


def save_run_checkpoint(run: Path, step: int, model_state: dict[str, torch.Tensor], model_config,
                        metadata: dict[str, str], trainer_tensors: dict[str, torch.Tensor],
                        trainer_meta: dict[str, Any], extra_files: list[Path], card: str,
                        elapsed_s: float = 0.0) -> Path:
    """Write RUN/checkpoints/step-N atomically and point `latest` at it. The wall-clock time goes to
    timing.json, apart from the trainer state, so that the state is reproducible byte for byte."""
    root = Path(run) / CHECKPOINTS
    target = root / step_dir_name(step)
    if target.exists():
        raise TrainError(f"{target}: exists already; refusing to overwrite a checkpoint")
    with atomic_path(target, is_dir=True) as tmp:
        write_canonical(model_state, model_config, tmp, metadata)
        _write_trainer_state(tmp / TRAINER_FILE, trainer_tensors, trainer_meta)
        (tmp / TIMING_FILE).write_text(json.dumps({"elapsed_s": elapsed_s}) + "\n", encoding="utf-8")
        for f in extra_files:
            copy_side_file(f, tmp / f.name)
        (tmp / "README.md").write_text(card, encoding="utf-8")
    write_text_atomic(root / LATEST, target.name + "\n")
    return target


def prune_checkpoints(run: Path, keep_last: int, protect: set[int] = frozenset()) -> list[Path]:
    """Remove all but the newest keep_last checkpoints (and those in protect); returns what went."""
    found = list_checkpoints(run)
    latest = latest_checkpoint(run)
    gone = []
    for step, path in found[:-keep_last] if keep_last else found:
        if step in protect or path == latest:
            continue
        shutil.rmtree(path)
        gone.append(path)
    return gone


def read_run_checkpoint(path: Path) -> tuple[dict[str, torch.Tensor], Any, dict[str, str],
                                              dict[str, torch.Tensor], dict[str, Any]]:
    """(model state, model config, model metadata, trainer tensors, trainer meta) of a checkpoint
    folder; anything unreadable is a TrainError naming the file."""
    path = Path(path)
    try:
        with CheckpointReader(path) as reader:
            check_layout(reader)
            state = {n: reader.get(n) for n in reader.names()}
            cfg, metadata = reader.config, dict(reader.metadata)
        trainer = SafetensorsFile(path / TRAINER_FILE)
        meta = parse_json(trainer.metadata[TRAINER_KEY], f"{path / TRAINER_FILE}: {TRAINER_KEY}", expect=dict,
                          error=TrainError)
        tensors = {k: trainer.get(k) for k in trainer.keys()}
        elapsed = checkpoint_elapsed(path)
        if elapsed is not None:
            meta["elapsed_s"] = elapsed
    except (CheckpointError, ConfigError) as e:
        raise TrainError(f"cannot resume from {path}: {e}") from None
    except (KeyError, OSError) as e:
        raise TrainError(f"cannot resume from {path}: {path / TRAINER_FILE} is unreadable "
                         f"({type(e).__name__}: {e})") from None
    return state, cfg, metadata, tensors, meta


def checkpoint_elapsed(path: Path) -> float | None:
    """Seconds of training steps up to a checkpoint, over every attempt (its timing.json; checkpoints
    written before that file existed keep it in the trainer state's metadata); None if unknown."""
    path = Path(path)
    try:
        if (path / TIMING_FILE).is_file():
            return float(read_json(path / TIMING_FILE, expect=dict)["elapsed_s"])
        if (path / TRAINER_FILE).is_file():
            meta = parse_json(SafetensorsFile(path / TRAINER_FILE).metadata.get(TRAINER_KEY, "{}"), TRAINER_KEY,
                              expect=dict)
            return float(meta.get("elapsed_s", 0.0))
    except (OSError, ValueError, KeyError, TypeError, CheckpointError):
        pass
    return None


# run.json's fields a resumed run takes over, with their types (the rest is a record, read by people)
RUN_INFO_FIELDS = {"tool": dict, "init": dict, "experts": dict, "tokenizer": dict, "data": list}


def read_run_info(path: Path) -> dict[str, Any]:
    """A run folder's run.json for --resume: an object holding each of RUN_INFO_FIELDS with its type, the init's
    provenance an object or null and the tokenizer's name and fingerprint strings; else a TrainError naming the
    file and the field (a run.json that is a list, garbage, /dev/zero or nested 100k deep was a traceback)."""
    where = str(path)
    body = read_json(path, expect=dict, error=TrainError)
    for key, kind in RUN_INFO_FIELDS.items():
        if json_field(body, key, kind, where, error=TrainError) is None:
            raise TrainError(f"{where}: field {key!r} is missing; the run folder was not written by this tool's train")
    json_field(body["init"], "provenance", dict, f"{where}: init", error=TrainError)
    for key in ("name", "fingerprint"):
        if json_field(body["tokenizer"], key, str, f"{where}: tokenizer", error=TrainError) is None:
            raise TrainError(f"{where}: field 'tokenizer.{key}' is missing")
    json_field(body["tokenizer"], "eos_id", int, f"{where}: tokenizer", error=TrainError)  # the run's separator
    json_field(body["tokenizer"], "eos_reason", str, f"{where}: tokenizer", error=TrainError)
    return body
