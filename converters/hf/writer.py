"""Canonical readers -> Hugging Face model directories, streamed tensor by tensor.

    save_hf(reader, "out/llama", "llama", tokenizer_files=files)          a dense architecture
    export_architecture(reader, out, ARCHITECTURES["mixtral"], ...)       any table, Mixtral included

Every HF format (the dense architectures, Mixtral, the HF BAM remote-code model) is written here:
rows of (HF tensors <- op.inverse(canonical tensors)) from a weight table (architectures.py, run
backwards: nothing here knows an architecture by name), shards from the one shard writer
(runtime.shards), config.json and the other small files from the caller. Checks (capability,
layout, file names) run before any I/O; the directory is written under a temporary name and
renamed at the end.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

import torch

from bam_surgery.runtime.atomic import atomic_dir
from bam_surgery.runtime.config import ModelConfig
from bam_surgery.runtime.dtypes import dtype_name, main_dtype
from bam_surgery.runtime.errors import CheckpointError
from bam_surgery.runtime.read_ahead import iter_tensors
from bam_surgery.runtime.reader import Reader, StateReader, check_layout
from bam_surgery.runtime.safetensors_file import Entry
from bam_surgery.runtime.shards import INDEX_NAME, copy_side_file, total_size, write_index, write_shards

from ..base import CastOptions, ExportOptions
from .architectures import Architecture, BoundRule
from .architectures import architecture as lookup_architecture
from .architectures import bind
from .files import CONFIG_FILE, GENERATION_CONFIG, SINGLE_FILE, generation_config_text

DEFAULT_SHARD_BYTES = 5 * 1024**3
SHARD_METADATA = {"format": "pt"}  # what transformers' save_pretrained puts in each weight file
TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")  # live in config.json in HF


# ---- weights: rows of a table, streamed -------------------------------------------------------
def plan_weights(reader: Reader, rows: Sequence[BoundRule], dtype: torch.dtype | None = None) -> list[Entry]:
    """Every HF tensor (name, shape, dtype) the rows make from the reader's tensors, in row order."""
    cfg = reader.config
    entries: list[Entry] = []
    for row in rows:
        dtypes = {reader.dtype(c) for c in row.canonical}
        if len(dtypes) != 1:
            raise CheckpointError(f"{reader.where(row.canonical[0])}: tensors {', '.join(row.canonical)} have "
                                  f"different dtypes {sorted(map(str, dtypes))}; they are written as {row.hf[0]}")
        out_dtype = dtype or dtypes.pop()
        shapes = row.op.inverse_shapes([tuple(reader.shape(c)) for c in row.canonical], cfg)
        entries += [(name, shape, out_dtype) for name, shape in zip(row.hf, shapes)]
    return entries


def stream_weights(reader: Reader, rows: Sequence[BoundRule], dtype: torch.dtype | None = None
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) in plan_weights' order: the canonical tensors read ahead in a background
    thread, each row's inverse op applied (views where it can: an expert of a stacked tensor)."""
    cfg = reader.config
    source = iter_tensors(reader, [c for row in rows for c in row.canonical])
    for row in rows:
        inputs = [tensor for _, tensor in (next(source) for _ in row.canonical)]
        outputs = row.op.inverse(inputs, cfg)
        for name, tensor in zip(row.hf, outputs):
            yield name, tensor if dtype is None or tensor.dtype == dtype else tensor.to(dtype)
        tensor = inputs = outputs = None  # free this row before the next is read


def check_copies(files: Iterable[str | os.PathLike], writes: Iterable[str]) -> list[Path]:
    """Files to copy into an export by name: they exist, and none would overwrite a file the
    export writes itself (`writes`, the weights and the index) or another copy."""
    reserved, seen, out = set(writes) | {INDEX_NAME, "README.md"}, set(), []
    for p in map(Path, files):
        if not p.is_file():
            raise CheckpointError(f"{p}: tokenizer file not found")
        if p.name in reserved or p.name.endswith(".safetensors") or p.name.startswith("model-"):
            raise CheckpointError(f"{p}: a tokenizer file may not be named {p.name} (the export writes that file)")
        if p.name in seen:
            raise CheckpointError(f"{p}: two tokenizer files are named {p.name}")
        seen.add(p.name)
        out.append(p)
    return out


def write_hf_directory(out_dir: str | os.PathLike, entries: list[Entry], tensors: Iterator[tuple[str, torch.Tensor]],
                       *, texts: Mapping[str, str], copies: Sequence[Path] = (), code: Mapping[str, Path] = {},
                       max_shard_bytes: int | None = None, single_file: str | None = SINGLE_FILE,
                       always_index: bool = False, replace: bool = True) -> Path:
    """The directory, atomically: weight shards (one `single_file` when they fit, None: shard names
    even then), the index when sharded (or always), `texts` {file name: content}, then `copies`
    and `code` copied by name. replace: see runtime.atomic (False: an existing out_dir is refused)."""
    with atomic_dir(out_dir, replace=replace) as tmp:
        weight_map = write_shards(tmp, entries, tensors, max_shard_bytes, file_metadata=SHARD_METADATA,
                                  single_file=single_file)
        if always_index or len(set(weight_map.values())) > 1:
            write_index(tmp, weight_map, total_size(entries), {})
        for name, text in texts.items():
            (tmp / name).write_text(text)
        for p in copies:
            copy_side_file(p, tmp / p.name)
        for name, source in code.items():
            shutil.copyfile(source, tmp / name)
    return Path(out_dir)


def config_json(body: Mapping[str, Any], sort_keys: bool = True) -> str:
    return json.dumps(body, indent=2, sort_keys=sort_keys) + "\n"


# ---- an architecture's table, run backwards ---------------------------------------------------
def export_architecture(reader: Reader, out_dir: str | os.PathLike, arch: Architecture, *,
                        token_ids: Mapping[str, Any], texts: Mapping[str, str] = {}, copies: Sequence[Path] = (),
                        max_shard_bytes: int | None = None, dtype: torch.dtype | None = None,
                        single_file: str | None = SINGLE_FILE, always_index: bool = False, replace: bool = True) -> Path:
    """Write `reader` as `arch`: its config map gives config.json (capability errors first), its
    table the weights. `texts` are extra small files (README.md, generation_config.json)."""
    cfg = reader.config
    body = arch.config.write(cfg, arch.model_type)  # capability errors, before any I/O
    check_layout(reader)
    rows = bind(arch, cfg).active
    entries = plan_weights(reader, rows, dtype)
    copies = check_copies(copies, [CONFIG_FILE, *texts])
    model_dtype = dtype_name(main_dtype(entries))
    hf_config = {"architectures": [arch.hf_class], "model_type": arch.model_type, **body,
                 "dtype": model_dtype, **token_ids, "torch_dtype": model_dtype}  # torch_dtype: transformers < 5
    return write_hf_directory(out_dir, entries, stream_weights(reader, rows, dtype),
                              texts={CONFIG_FILE: config_json(hf_config), **texts}, copies=copies,
                              max_shard_bytes=max_shard_bytes, single_file=single_file, always_index=always_index,
                              replace=replace)


def export_native_mixture(reader: Reader, out_dir: str | os.PathLike, arch: Architecture, options: ExportOptions
                          ) -> Path:
    """A mixture as a native HF MoE architecture (Mixtral, Qwen2-MoE): shards always with shard names and an index
    (as save_pretrained writes them); generation_config.json, and its token ids in config.json (None where it has
    none, not the config class's own defaults); the card as README.md."""
    return export_with_options(reader, out_dir, arch, options, single_file=None, always_index=True)


def export_with_options(reader: Reader, out_dir: str | os.PathLike, arch: Architecture, options: ExportOptions,
                        always_generation: bool = True, **layout) -> Path:
    """`reader` as `arch` with what ExportOptions carry: the tokenizer files copied, generation_config.json from the
    generation config (always, or only when it has entries) and its token ids in config.json, the card."""
    generation = dict(options.generation or {})
    texts = {GENERATION_CONFIG: generation_config_text(generation)} \
        if generation or always_generation else {}
    if options.model_card is not None:
        texts["README.md"] = options.model_card
    dtype = options.own.dtype if isinstance(options.own, CastOptions) else None
    return export_architecture(reader, out_dir, arch, token_ids=config_token_ids(generation, reader.hf_config),
                               texts=texts, copies=options.tokenizer_files, max_shard_bytes=options.max_shard_bytes,
                               dtype=dtype, replace=options.replace, **layout)


def config_token_ids(generation: Mapping[str, Any], source_config: Mapping[str, Any] | None) -> dict[str, Any]:
    """config.json's bos/eos/pad ids: the generation config's, else the source config.json's where it is an HF
    model (a dense HF folder converted keeps its pad_token_id), else null. A source id that is not a token id
    (an integer, or a non-empty list of them) is left out rather than carried."""
    source = source_config or {}

    def token_id(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**31

    def valid(v) -> bool:
        return token_id(v) or (isinstance(v, list) and bool(v) and all(token_id(x) for x in v))
    return {k: generation[k] if k in generation else (source.get(k) if valid(source.get(k)) else None)
            for k in TOKEN_ID_KEYS}


def save_hf(source: Reader | Mapping[str, torch.Tensor], out_dir: str | os.PathLike, architecture: str, *,
            config: ModelConfig | None = None, tokenizer_files: Iterable[str | os.PathLike] = (),
            generation: Mapping[str, Any] | None = None, max_shard_bytes: int | None = DEFAULT_SHARD_BYTES,
            model_card: str | None = None, dtype: torch.dtype | None = None, replace: bool = True) -> Path:
    """Write a dense canonical model (a reader, or a state dict with `config=`) as an HF directory.

    architecture: the HF model_type to write (llama, mistral, qwen2, gpt_neox, gpt2, cohere, phi).
    tokenizer_files: copied by name; generation: generation_config.json's entries (its token ids also go to
    config.json; null where it has none). What a checkpoint carries is gathered by app/exports.py:export_inputs,
    the one owner (bam-surgery convert --format hf goes through it). model_card: markdown written as README.md.
    """
    if isinstance(source, Mapping):
        if config is None:
            raise ValueError("save_hf: a state dict needs config=ModelConfig")
        source = StateReader(source, config)
    options = ExportOptions(tokenizer_files=tuple(Path(f) for f in tokenizer_files), generation=generation,
                            model_card=model_card, max_shard_bytes=max_shard_bytes, replace=replace,
                            own=CastOptions(dtype))
    return export_with_options(source, out_dir, lookup_architecture(architecture), options, always_generation=False)
