"""Export a canonical checkpoint (dense or mixture) to a Hugging Face directory that carries its own modeling code.

    export_hf_bam(reader, "out/mix-hf", tokenizer_files=[...], model_card=text)
    AutoModelForCausalLM.from_pretrained("out/mix-hf", trust_remote_code=True)   # lm-eval, pipelines

The directory holds:
    config.json                      every ModelConfig field (same names) + architectures, auto_map, model_type, torch_dtype
    configuration_bam.py, modeling_bam.py       the remote code, copied from this package
    blocks_bam.py                    the model math modeling_bam.py imports: runtime/blocks.py, byte for byte
    generation_config.json
    model.safetensors                one file, or, with max_shard_bytes,
    model-0000i-of-0000N.safetensors + model.safetensors.index.json
    tokenizer files (copied as given), README.md (the model card, if given)

Weight names: canonical names under "model.", lm_head.* at the top level (`hf_weight_name`). Tensors are
streamed one at a time from the reader into the output shards; the directory appears only when complete.
"""
from __future__ import annotations

import dataclasses
import inspect
import json
import os
import shutil
from pathlib import Path
from typing import Iterable, Mapping

import torch

from bam_surgery.runtime.checkpoint import (SafetensorsStreamWriter, atomic_path, iter_tensors, nbytes, plan_shards, shard_name,
                                write_index)
from bam_surgery.runtime import blocks as runtime_blocks
from bam_surgery.runtime.config import ModelConfig
from bam_surgery.runtime.layout import tensor_shapes

from .configuration_bam import SUPPORTED, BamConfig

CODE_DIR = Path(__file__).parent
CODE_FILES = ("configuration_bam.py", "modeling_bam.py")
# every file of remote code in an export -> where it comes from (one copy of the model math: the runtime's)
SHIPPED_FILES = {**{name: CODE_DIR / name for name in CODE_FILES},
                 "blocks_bam.py": Path(runtime_blocks.__file__)}
ARCHITECTURE = "BamForCausalLM"
AUTO_MAP = {"AutoConfig": "configuration_bam.BamConfig", "AutoModelForCausalLM": "modeling_bam.BamForCausalLM"}
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Files the export writes itself; a tokenizer file with one of these names would overwrite them.
RESERVED = {"config.json", "generation_config.json", "README.md", SINGLE_FILE, INDEX_FILE, *SHIPPED_FILES}

# ---- names: one rule, its inverse derived ---------------------------------------------------
TRUNK_PREFIX = "model."  # BamForCausalLM.model holds everything but the output head
TOP_LEVEL = ("lm_head.",)  # canonical names that stay at the top level, unprefixed


def hf_weight_name(canonical: str) -> str:
    return canonical if canonical.startswith(TOP_LEVEL) else TRUNK_PREFIX + canonical


def canonical_weight_name(hf: str) -> str:
    if hf.startswith(TOP_LEVEL):
        return hf
    if hf.startswith(TRUNK_PREFIX) and not hf[len(TRUNK_PREFIX):].startswith(TOP_LEVEL):
        return hf[len(TRUNK_PREFIX):]
    raise KeyError(f"{hf}: not a weight name of the HF BAM format")


# ---- capability check -----------------------------------------------------------------------
def check_hf_bam(cfg: ModelConfig) -> None:
    """Raise a one-line ValueError if modeling_bam.py cannot run this config; runs before any I/O."""
    known = set(inspect.signature(BamConfig.__init__).parameters)
    for f in dataclasses.fields(cfg):
        if f.name not in known:
            raise ValueError(f"cannot export to the HF BAM format: config field {f.name!r} is unknown to "
                             "configuration_bam.py / modeling_bam.py")
    for fld, allowed in SUPPORTED.items():
        value = getattr(cfg, fld)
        if value not in allowed:
            raise ValueError(f"cannot export to the HF BAM format: {fld}={value!r} is not implemented by "
                             f"modeling_bam.py (supported: {', '.join(allowed)})")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _check_tensors(reader, cfg: ModelConfig, src: str) -> dict[str, tuple[int, ...]]:
    """The reader must hold exactly the config's canonical tensors, with their shapes, in a float dtype."""
    expected = tensor_shapes(cfg)
    present = set(reader.names())
    for name, shape in expected.items():
        if name not in present:
            raise ValueError(f"{src}: tensor {name} is missing (the config needs it)")
        if tuple(reader.shape(name)) != shape:
            raise ValueError(f"{src}: tensor {name} has shape {tuple(reader.shape(name))}, the config needs {shape}")
        if not reader.dtype(name).is_floating_point:
            raise ValueError(f"{src}: tensor {name} has dtype {reader.dtype(name)}, expected a float dtype")
    extra = sorted(present - set(expected))
    if extra:
        raise ValueError(f"{src}: tensor {extra[0]} is not part of the config's layout ({len(extra)} such tensors)")
    return expected


def _check_extra_files(tokenizer_files: Iterable[str | os.PathLike]) -> list[Path]:
    files, seen = [Path(p) for p in tokenizer_files], set()
    for p in files:
        if not p.is_file():
            raise ValueError(f"{p}: tokenizer file not found")
        if p.name in RESERVED or p.name.startswith("model-"):
            raise ValueError(f"{p}: a tokenizer file may not be named {p.name} (the export writes that file)")
        if p.name in seen:
            raise ValueError(f"{p}: two tokenizer files are named {p.name}")
        seen.add(p.name)
    return files


def hf_config_dict(cfg: ModelConfig, torch_dtype: torch.dtype,
                   generation: Mapping[str, object] | None = None) -> dict[str, object]:
    """config.json: the ModelConfig fields under their own names, plus what transformers needs to load it."""
    tokens = {k: v for k, v in (generation or {}).items() if k.endswith("_token_id")}
    return {
        "architectures": [ARCHITECTURE],
        "auto_map": dict(AUTO_MAP),
        "model_type": BamConfig.model_type,
        "torch_dtype": _dtype_name(torch_dtype),
        "use_cache": True,
        **tokens,
        **cfg.to_dict(),
    }


def config_from_hf_dict(body: Mapping[str, object]) -> ModelConfig:
    """Inverse of hf_config_dict: the ModelConfig of an exported directory's config.json."""
    if body.get("model_type") != BamConfig.model_type:
        raise ValueError(f"config.json has model_type {body.get('model_type')!r}, not {BamConfig.model_type!r}")
    return ModelConfig.from_dict({f.name: body[f.name] for f in dataclasses.fields(ModelConfig) if f.name in body})


def export_hf_bam(reader, out_dir: str | os.PathLike, tokenizer_files: Iterable[str | os.PathLike] = (),
                  model_card: str | None = None, max_shard_bytes: int | None = None,
                  dtype: torch.dtype | None = None, generation: Mapping[str, object] | None = None) -> Path:
    """Write a transformers-loadable directory at out_dir from a canonical reader.

    reader          .config, .names(), .shape(n), .dtype(n), .get(n) (CheckpointReader protocol)
    max_shard_bytes None: one model.safetensors; else shards of at most this size plus an index
    dtype           cast every tensor to this dtype (None: keep each tensor's dtype)
    generation      generation_config.json entries, e.g. {"bos_token_id": 2, "eos_token_id": 1};
                    *_token_id entries also go to config.json
    Checks everything it can (config, tensor names and shapes, extra files) before writing; the directory
    appears only when complete.
    """
    cfg: ModelConfig = reader.config
    check_hf_bam(cfg)
    if dtype is not None and not dtype.is_floating_point:
        raise ValueError(f"dtype {dtype} is not a float dtype")
    src = str(getattr(reader, "path", "checkpoint"))
    shapes = _check_tensors(reader, cfg, src)
    extra_files = _check_extra_files(tokenizer_files)
    entries = [(hf_weight_name(n), shape, dtype or reader.dtype(n)) for n, shape in shapes.items()]
    torch_dtype = dtype or reader.dtype("embed.weight")

    out_dir = Path(out_dir)
    with atomic_path(out_dir, is_dir=True) as tmp:
        tmp.mkdir(parents=True, exist_ok=True)
        shards = plan_shards(entries, max_shard_bytes)
        weight_map: dict[str, str] = {}
        for i, shard in enumerate(shards):
            fname = SINGLE_FILE if len(shards) == 1 else shard_name(i, len(shards))
            writer = SafetensorsStreamWriter(tmp / fname, shard, {"format": "pt"})
            dtypes = {hf: dt for hf, _, dt in shard}
            for canonical, tensor in iter_tensors(reader, [canonical_weight_name(e[0]) for e in shard]):
                hf = hf_weight_name(canonical)
                writer.write(hf, tensor.to(dtypes[hf]))
                weight_map[hf] = fname
            writer.close()
        if len(shards) > 1:
            write_index(tmp, weight_map, sum(nbytes(s, d) for _, s, d in entries), {})
        (tmp / "config.json").write_text(json.dumps(hf_config_dict(cfg, torch_dtype, generation), indent=2) + "\n")
        (tmp / "generation_config.json").write_text(json.dumps(dict(generation or {}), indent=2) + "\n")
        for name, source in SHIPPED_FILES.items():
            shutil.copyfile(source, tmp / name)
        for p in extra_files:
            shutil.copyfile(p, tmp / p.name)
        if model_card is not None:
            (tmp / "README.md").write_text(model_card)
    return out_dir
