"""The files of a Hugging Face model directory: which names hold what, and how to list them.

    config.json                                   read_hf_config
    model.safetensors | model-0000i-of-0000N.safetensors + model.safetensors.index.json
    pytorch_model*.bin (+ pytorch_model.bin.index.json)   only with allow_pickle
    tokenizer files, chat_template.jinja, generation_config.json   TOKENIZER_FILES (runtime.shards.SIDE_FILES)

Weights and side files may be symbolic links only to files inside the folder, or, in the Hugging
Face cache, to the blobs of the same repository (runtime.shards.folder_file); any other link is
refused before anything is read, so that no export carries a file from elsewhere.
"""
from __future__ import annotations

import json
from pathlib import Path

from bam_surgery.runtime.errors import CheckpointError
from bam_surgery.runtime.jsonfile import read_json
from bam_surgery.runtime.shards import (INDEX_NAME, SIDE_FILES, folder_file, read_index, shard_path, side_file,  # noqa: F401
                                       side_files_in)

CONFIG_FILE = "config.json"
GENERATION_CONFIG = "generation_config.json"
SINGLE_FILE = "model.safetensors"  # the weights of an unsharded directory
PICKLE_INDEX = "pytorch_model.bin.index.json"
# What a model directory carries besides config and weights; copied into exports of it.
TOKENIZER_FILES = SIDE_FILES


def generation_config_text(generation) -> str:
    """generation_config.json's text of a generation config's entries (the HF formats, the canonical folder and the
    ONNX folder write it alike)."""
    return json.dumps(dict(generation), indent=2, sort_keys=True) + "\n"


def check_token_ids(where: str | Path, key: str, value, error: type[Exception] = CheckpointError) -> None:
    """The one rule of a token id read from a config (generation_config.json, config.json, the generation config a
    GGUF's tokenizer is rebuilt with), for every reader of one: an integer from 0 to 2**31 - 1, a non-empty list of
    them, or null; anything else (the string "2", true, []) is `error` naming the file and the key."""
    def one(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**31
    if not (value is None or one(value) or (isinstance(value, list) and bool(value) and all(one(v) for v in value))):
        raise error(f"{where}: {key}: expected a token id (an integer, a non-empty list of integers or null), got "
                    f"{str(value)[:60]!r}")


def read_hf_config(directory: Path) -> dict:
    cfg_file = directory / CONFIG_FILE
    if not cfg_file.is_file():
        raise CheckpointError(f"{directory}: no config.json (not a Hugging Face model directory)")
    return read_json(cfg_file, expect=dict)


def tokenizer_files_in(directory: Path) -> list[Path]:
    """The tokenizer files (and chat template, generation config) present in a model directory."""
    return side_files_in(directory)


def weight_files(directory: Path, allow_pickle: bool = False) -> tuple[list[Path], dict[str, Path] | None, bool]:
    """(weight files, index {HF name: file} or None, is_pickle). Prefers safetensors over pickles."""
    def from_index(index: Path) -> dict[str, Path]:
        weight_map, _ = read_index(index)
        files = {f: shard_path(directory, f, index) for f in set(weight_map.values())}  # each name checked once
        return {k: files[f] for k, f in weight_map.items()}

    def listing(index: dict[str, Path], is_pickle: bool):
        return list(dict.fromkeys(index.values())), index, is_pickle

    def inside(files: list[Path]) -> list[Path]:
        return [folder_file(directory, f, "a weight file") for f in files]

    if (directory / INDEX_NAME).is_file():
        return listing(from_index(directory / INDEX_NAME), False)
    single = directory / SINGLE_FILE
    if single.is_file():
        return inside([single]), None, False
    shards = sorted(directory.glob("model-*-of-*.safetensors"))
    if shards:
        return inside(shards), None, False
    pickle_index = directory / PICKLE_INDEX
    pickles = inside([pickle_index] if pickle_index.is_file() else sorted(directory.glob("pytorch_model*.bin")))
    if pickles:
        if not allow_pickle:
            raise CheckpointError(f"{pickles[0]}: pickle weights (.bin) are not loaded by default; pass "
                                  "--allow-pickle to load them (torch.load with weights_only=True)")
        return listing(from_index(pickle_index), True) if pickle_index.is_file() else (pickles, None, True)
    raise CheckpointError(f"{directory}: no weights found (model.safetensors, shards with "
                          f"{INDEX_NAME}, or pytorch_model.bin)")
