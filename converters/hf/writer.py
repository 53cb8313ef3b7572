"""Canonical dense model -> Hugging Face model directory, streamed tensor by tensor.

    save_hf(reader, "out/llama", "llama", tokenizer_from=hf_reader)

The HF names, shapes and reshapes come from the architecture's import table run backwards
(`op.inverse`), and config.json from the same config spec run backwards: nothing here knows an
architecture by name. Capability checks (a mixture, a parallel block for llama, ...) run before
any I/O. Output: config.json, model.safetensors (or shards + model.safetensors.index.json),
tokenizer files copied from `tokenizer_from`; written to a temporary directory, renamed at the end.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Mapping

import torch

from bam_surgery.runtime.checkpoint import (CheckpointError, SafetensorsStreamWriter, atomic_path, nbytes, plan_shards,
                                shard_name, write_index)
from bam_surgery.runtime.config import ModelConfig
from bam_surgery.runtime.layout import tensor_shapes

from .architectures import architecture as lookup_architecture
from .architectures import bind
from .config_map import model_config_to_hf
from .reader import TOKENIZER_FILES, read_hf_config

DEFAULT_SHARD_BYTES = 5 * 1024**3
_DTYPE_NAME = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
               torch.float64: "float64"}
# token ids live in the model's config.json in HF; carried over from the tokenizer's source
_TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


class _StateReader:
    """The reader protocol over an in-memory canonical state dict."""

    def __init__(self, state: Mapping[str, torch.Tensor], config: ModelConfig):
        self.state, self.config = state, config

    def names(self):
        return list(self.state)

    def shape(self, name):
        return tuple(self.state[name].shape)

    def dtype(self, name):
        return self.state[name].dtype

    def get(self, name):
        return self.state[name]


def _tokenizer_source(tokenizer_from) -> tuple[list[Path], dict]:
    """(tokenizer files, HF config.json of that source or {}) from a reader or a directory."""
    if tokenizer_from is None:
        return [], {}
    if hasattr(tokenizer_from, "tokenizer_files"):
        return list(tokenizer_from.tokenizer_files()), dict(getattr(tokenizer_from, "hf_config", {}) or {})
    if not isinstance(tokenizer_from, (str, os.PathLike)):
        raise CheckpointError(f"{getattr(tokenizer_from, 'path', tokenizer_from)}: has no tokenizer files "
                              "(pass an HF model directory or its reader)")
    d = Path(tokenizer_from)
    if not d.is_dir():
        raise CheckpointError(f"{d}: tokenizer source is not a directory")
    hf = read_hf_config(d) if (d / "config.json").is_file() else {}
    return [d / n for n in TOKENIZER_FILES if (d / n).is_file()], hf


def save_hf(source, out_dir: str | os.PathLike, architecture: str, tokenizer_from=None, *,
            config: ModelConfig | None = None, max_shard_bytes: int | None = DEFAULT_SHARD_BYTES,
            model_card: str | None = None) -> Path:
    """Write a dense canonical model (a reader, or a state dict with `config=`) as an HF directory.

    architecture: the HF model_type to write (llama, mistral, qwen2, gpt_neox, gpt2, cohere, phi).
    tokenizer_from: a reader with tokenizer_files() (an HF input) or a directory; its tokenizer files
    are copied and its config's bos/eos/pad token ids carried over.
    model_card: markdown written as README.md.
    """
    if isinstance(source, Mapping):
        if config is None:
            raise ValueError("save_hf: a state dict needs config=ModelConfig")
        source = _StateReader(source, config)
    cfg: ModelConfig = source.config
    arch = lookup_architecture(architecture)
    body = model_config_to_hf(cfg, arch.config, arch.model_type)  # capability errors, before any I/O
    binding = bind(arch, cfg)
    expected = tensor_shapes(cfg)
    names = set(source.names())
    for c in expected:
        if c not in names:
            raise CheckpointError(f"{getattr(source, 'path', 'source')}: tensor {c} is missing")
        if tuple(source.shape(c)) != expected[c]:
            raise CheckpointError(f"{getattr(source, 'path', 'source')}: tensor {c} has shape "
                                  f"{list(source.shape(c))}, config implies {list(expected[c])}")
    extra = sorted(names - set(expected))
    if extra:
        raise CheckpointError(f"{getattr(source, 'path', 'source')}: tensor {extra[0]} is not part of a dense "
                              f"{arch.model_type} model")

    # plan: every HF tensor with its shape and dtype, in model order
    entries: list[tuple[str, tuple[int, ...], torch.dtype]] = []
    rule_of = {}
    for br in binding.active:
        dtypes = {source.dtype(c) for c in br.canonical}
        if len(dtypes) != 1:
            raise CheckpointError(f"tensors {', '.join(br.canonical)} have different dtypes {sorted(map(str, dtypes))}; "
                                  f"they are fused into {br.hf[0]}")
        (dtype,) = dtypes
        for n, s in zip(br.hf, br.op.inverse_shapes([expected[c] for c in br.canonical], cfg)):
            entries.append((n, s, dtype))
            rule_of[n] = br
    main_dtype = max({e[2] for e in entries}, key=lambda d: sum(nbytes(e[1], e[2]) for e in entries if e[2] == d))
    tok_files, tok_config = _tokenizer_source(tokenizer_from)
    hf_config = {"architectures": [arch.hf_class], "model_type": arch.model_type, **body,
                 "dtype": _DTYPE_NAME.get(main_dtype, str(main_dtype).removeprefix("torch.")),
                 **{k: tok_config[k] for k in _TOKEN_ID_KEYS if k in tok_config}}
    hf_config["torch_dtype"] = hf_config["dtype"]  # the key transformers < 5 reads

    out_dir = Path(out_dir)
    with atomic_path(out_dir, is_dir=True) as tmp:
        tmp.mkdir(parents=True, exist_ok=True)
        shards = plan_shards(entries, max_shard_bytes)
        weight_map: dict[str, str] = {}
        pending: dict[str, torch.Tensor] = {}  # HF outputs of the current row not yet written
        for i, shard in enumerate(shards):
            fname = "model.safetensors" if len(shards) == 1 else shard_name(i, len(shards))
            writer = SafetensorsStreamWriter(tmp / fname, shard, {"format": "pt"})
            for n, _, _ in shard:
                if n not in pending:
                    br = rule_of[n]
                    outs = br.op.inverse([source.get(c) for c in br.canonical], cfg)
                    pending = dict(zip(br.hf, outs))
                writer.write(n, pending.pop(n))
                weight_map[n] = fname
            writer.close()
        if len(shards) > 1:
            write_index(tmp, weight_map, sum(nbytes(s, d) for _, s, d in entries), {})
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
        for f in tok_files:
            shutil.copy2(f, tmp / f.name)
        if model_card is not None:
            (tmp / "README.md").write_text(model_card)
    return out_dir
