"""Resolve a checkpoint spec to a lazy reader with canonical tensor names.

Accepted specs (everything that reads a checkpoint goes through `open_checkpoint`):
    mix.safetensors            canonical file (config JSON in the safetensors metadata)
    mix/                       canonical directory (config.json has "bam_config")
    RUN/                       a training run folder: its newest checkpoint (run_folder.py)
    path/to/llama/             Hugging Face model directory (config.json has "model_type")
    path/to/export/            our Mixtral (model_type mixtral) or HF BAM (bam_mixture) exports
    model.gguf                 a GGUF file (llama.cpp, Ollama; gguf_reader.py), or any part of a split GGUF
                               (model-00001-of-00003.gguf); a folder holding one GGUF (no config.json) too
    org/name  org/name@rev     Hugging Face hub id: resolved with huggingface_hub.snapshot_download
                               (uses the local cache; honours HF_HUB_OFFLINE, HF_HOME, HF_HUB_CACHE)
Pickle weights (.bin) are read only with allow_pickle=True (the CLI's --allow-pickle).
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from bam_surgery.runtime.checkpoint import CONFIG_KEY, CheckpointError, CheckpointReader
from bam_surgery.runtime.jsonfile import read_json
from bam_surgery.runtime.reader import Reader
from bam_surgery.runtime.shards import INDEX_NAME

from .gguf_file import SPLIT
from .gguf_reader import GGUFCheckpointReader
from .hf.files import TOKENIZER_FILES, read_hf_config
from .hf.reader import HFCheckpointReader
from .hf_bam.reader import BamHFReader
from .run_folder import resolve_run_folder

# org/name with an optional @revision (branch, tag or commit)
HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<revision>[\w./-]+))?$")
# model*.safetensors: not the duplicate weights some repos also carry (e.g. consolidated.safetensors)
HUB_PATTERNS = ["config.json", "model*.safetensors", INDEX_NAME, *TOKENIZER_FILES]
HUB_PICKLE_PATTERNS = ["pytorch_model*.bin", "pytorch_model.bin.index.json"]
PICKLE_SUFFIXES = (".bin", ".pt", ".pth")
GGUF_SUFFIX = ".gguf"
FILE_SUFFIXES = (".safetensors", ".json", GGUF_SUFFIX, *PICKLE_SUFFIXES)  # a spec ending so is a path, never a hub id
HF_WEIGHT_FILE = re.compile(r"^model(-\d+-of-\d+)?\.safetensors$")


def open_checkpoint(spec: str | os.PathLike, allow_pickle: bool = False) -> Reader:
    """The reader (runtime.reader protocol) of a checkpoint spec."""
    path = Path(resolve_run_folder(os.fspath(spec)))
    if path.is_dir():
        return _open_directory(path, allow_pickle)
    if path.is_file():
        if path.suffix in PICKLE_SUFFIXES:
            if not allow_pickle:
                raise CheckpointError(f"{path}: pickle weights are not loaded by default; pass --allow-pickle "
                                      "to load them (torch.load with weights_only=True)")
            if (path.parent / "config.json").is_file():
                return _open_directory(path.parent, allow_pickle)
            raise CheckpointError(f"{path}: a pickle file needs its model directory (with config.json); "
                                  "pass the directory")
        if path.suffix == GGUF_SUFFIX:
            return GGUFCheckpointReader(path)
        if path.suffix != ".safetensors":
            raise CheckpointError(f"{path}: not a checkpoint (expected .safetensors, .gguf or a model directory)")
        if HF_WEIGHT_FILE.match(path.name) and _is_hf_directory(path.parent):
            return _open_directory(path.parent, allow_pickle)  # a weight file of an HF model: open the model
        return CheckpointReader(path)
    match = HUB_ID.match(str(spec))
    if match and not str(spec).startswith((".", "/", "~")) and path.suffix not in FILE_SUFFIXES:
        repo, revision = match.group("repo"), match.group("revision")
        if ".." in repo or (revision is not None and (".." in revision.split("/") or revision.startswith("/"))):
            raise CheckpointError(f"{spec}: a hub id may not contain '..' (the revision names a branch, tag "
                                  "or commit, never a path)")
        return _open_directory(_snapshot(repo, revision, allow_pickle), allow_pickle)
    raise CheckpointError(f"{spec}: no such file or directory (and not a hub id of the form org/name[@revision])")


def _open_directory(path: Path, allow_pickle: bool) -> Reader:
    if not (path / "config.json").is_file():
        models = _gguf_models(path)
        if len(models) == 1:
            return GGUFCheckpointReader(models[0], folder=path)  # a file of the folder: its link rule
        if models:
            raise CheckpointError(f"{path}: holds {len(models)} GGUF models ({', '.join(p.name for p in models[:4])}"
                                  f"{', ...' if len(models) > 4 else ''}); pass one of them")
        raise CheckpointError(f"{path}: no config.json (neither a canonical nor a Hugging Face model directory) "
                              "and no .gguf file")
    body = read_hf_config(path)
    cfg_file = path / "config.json"
    if CONFIG_KEY in body:
        return CheckpointReader(path)
    if body.get("model_type") == "bam_mixture":  # an `--format hf` mixture export read back
        return BamHFReader(path)
    if "model_type" in body:  # an HF architecture, Mixtral (e.g. a btx export read back) included
        return HFCheckpointReader(path, allow_pickle=allow_pickle)
    raise CheckpointError(f"{cfg_file}: has neither {CONFIG_KEY!r} (canonical) nor 'model_type' (Hugging Face)")


def _gguf_models(path: Path) -> list[Path]:
    """The GGUF models in a folder: each single file, and the first part of each split one."""
    files = sorted(p for p in path.glob(f"*{GGUF_SUFFIX}") if p.is_file())
    return [p for p in files if (m := SPLIT.match(p.name)) is None or int(m.group("no")) == 1]


def _is_hf_directory(path: Path) -> bool:
    try:
        body = read_json(path / "config.json", expect=dict)
    except CheckpointError:
        return False
    return "model_type" in body and CONFIG_KEY not in body


def _truthy(value: str | None) -> bool:
    return (value or "").strip().upper() in ("1", "ON", "YES", "TRUE")


def _snapshot(repo_id: str, revision: str | None, allow_pickle: bool) -> Path:
    """Local snapshot directory of a hub repo (downloading config, safetensors and tokenizer files if allowed)."""
    from huggingface_hub import constants, snapshot_download  # lazy: 0.3 s at start-up, for hub ids only

    # read the environment now (huggingface_hub reads it once, at import)
    offline = _truthy(os.environ.get("HF_HUB_OFFLINE")) or constants.HF_HUB_OFFLINE
    cache_dir = os.environ.get("HF_HUB_CACHE") or (
        os.path.join(os.environ["HF_HOME"], "hub") if os.environ.get("HF_HOME") else constants.HF_HUB_CACHE)
    where = f"{repo_id}@{revision}" if revision else repo_id
    try:
        local = snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, local_files_only=offline,
                                  allow_patterns=HUB_PATTERNS + (HUB_PICKLE_PATTERNS if allow_pickle else []))
    except Exception as e:  # huggingface_hub raises many types (offline, 404, gated, network)
        mode = "offline, from the cache only" if offline else "online"
        raise CheckpointError(f"{where}: not a local path, and resolving it as a hub id ({mode}, cache "
                              f"{cache_dir}) failed: {type(e).__name__}: {' '.join(str(e).split())[:300]}") from None
    return Path(local)
