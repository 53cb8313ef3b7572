"""Lazy reader of a Hugging Face model directory that speaks canonical names.

    r = HFCheckpointReader("path/to/llama")        # config.json + model.safetensors (or shards + index)
    r.config                                      # ModelConfig, from config.json via the config map
    r.names(), r.shape(n), r.dtype(n)             # canonical, from the HF headers only
    r.get("layers.0.attn.q.weight")               # reads only the HF tensor(s) this one comes from

Opening reads config.json and the safetensors headers, binds the architecture's table to the
config, and checks it both ways: every HF tensor the config needs is present, every HF tensor
present is consumed (or dropped on purpose), and every canonical shape derived from the HF
shapes matches `runtime.layout.tensor_shapes(config)`. Pickle weights (`pytorch_model*.bin`) are
read only with allow_pickle=True, through torch.load(weights_only=True, mmap=True).
"""
from __future__ import annotations

import os
import pickle
import re
import warnings
from pathlib import Path

import torch

from bam_surgery.runtime.config import ConfigError
from bam_surgery.runtime.errors import CheckpointError
from bam_surgery.runtime.layout import tensor_shapes
from bam_surgery.runtime.reader import ShapeTableReader
from bam_surgery.runtime.safetensors_file import FileIdentity, SafetensorsFile

from .architectures import Architecture, Binding, BoundRule, architecture, bind
from .files import read_hf_config, tokenizer_files_in, weight_files

# what torch's weights_only unpickler names when it refuses a pickle ("... unsupported GLOBAL posix.system ...")
# ("Unsupported global: GLOBAL numpy.core..." too: the name after both words, never "GLOBAL" itself)
_REFUSED_GLOBAL = re.compile(r"(?:GLOBAL|global:?)\s+(?:GLOBAL\s+)?([\w.]+)")


class _PickleFile:
    def __init__(self, file: Path):
        try:
            # torch's own warnings on the way (a refused or legacy pickle) would print besides the one error line
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                try:
                    state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
                except RuntimeError:  # the legacy (non-zip) format cannot be memory-mapped
                    state = torch.load(file, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:  # the weights-only unpickler refused something
            found = _REFUSED_GLOBAL.search(str(e))
            what = f"it calls {found.group(1)}" if found else "it holds more than tensors"
            raise CheckpointError(f"{file}: refused to load this pickle: {what}, and bam-surgery loads pickles "
                                  "only with torch's weights-only unpickler, which builds tensors and plain "
                                  "containers and never runs code from the file; convert it to safetensors with "
                                  "a tool you trust, or use the model's .safetensors weights") from None
        except Exception as e:
            raise CheckpointError(f"{file}: unreadable pickle checkpoint ({' '.join(str(e).split())[:200]})") from None
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise CheckpointError(f"{file}: expected a dict of tensors (a state dict)")
        self.state = state
        self.meta = {k: (tuple(v.shape), v.dtype) for k, v in state.items()}
        self.identity = FileIdentity.of(os.stat(file))

    def get(self, key: str) -> torch.Tensor:
        return self.state[key]


class HFCheckpointReader(ShapeTableReader):
    """The reader protocol (runtime.reader) over a Hugging Face model directory.

    `architecture` is the directory's model_type; `table` its weight-mapping table."""

    def __init__(self, directory: str | os.PathLike, allow_pickle: bool = False):
        self.path = self.source_dir = Path(directory)
        hf_config = read_hf_config(self.path)
        cfg_file = self.path / "config.json"
        try:
            self.table: Architecture = architecture(hf_config.get("model_type"))
            self.config, notes = self.table.config.read(hf_config, name=self.table.model_type)
        except ConfigError as e:  # CapabilityError included: keep the type, name the file
            raise type(e)(f"{cfg_file}: {e}") from None
        self.hf_config = hf_config
        self.architecture = self.table.model_type
        self.metadata: dict[str, str] = {"format": "hf", "model_type": self.architecture, "source": str(self.path)}
        if notes:
            self.metadata["notes"] = "; ".join(notes)

        self._files: dict[Path, SafetensorsFile | _PickleFile] = {}
        self._source: dict[str, tuple[Path, str]] = {}  # HF name (normalized) -> (file, key in file)
        files, index, is_pickle = weight_files(self.path, allow_pickle)
        opener = _PickleFile if is_pickle else SafetensorsFile
        for file in files:
            if not file.is_file():
                raise CheckpointError(f"{file}: file not found (listed in the index)")
            self._files[file] = opener(file)
        try:
            self.binding: Binding = bind(self.table, self.config)
        except ConfigError as e:
            raise type(e)(f"{cfg_file}: {e}") from None
        self._known = self.binding.known()
        stored = (list(index.items()) if index is not None
                  else [(k, f) for f, h in self._files.items() for k in h.meta])
        for key, file in stored:
            if key not in self._files[file].meta:
                raise CheckpointError(f"{file}: tensor {key} is missing (the index lists it here)")
            self._take(key, file)
        if index is not None:  # a tensor the index does not list would be left out without a word
            listed = set(index.items())
            for file, handle in self._files.items():
                for key in handle.meta:
                    if (key, file) not in listed:
                        raise CheckpointError(f"{file}: tensor {key} is not listed in the index")
        self._check_and_derive_shapes()
        self._cache: tuple[BoundRule | None, list[torch.Tensor]] = (None, [])

    # -- opening ---------------------------------------------------------------------------
    def _take(self, key: str, file: Path) -> None:
        """Map a stored HF key to its table name (base-model checkpoints lack the prefix; old names)."""
        arch, b, known = self.table, self.binding, self._known
        candidates = [key, arch.base_prefix + key]
        for old, new in arch.alias_prefixes.items():
            candidates += [new + c[len(old):] for c in list(candidates) if c.startswith(old)]
        name = next((c for c in candidates if c in known), None)
        if name is None:
            raise CheckpointError(f"{file}: tensor {key} is not part of the {arch.model_type} mapping "
                                  "(unknown key)")
        if name in b.inactive:
            raise CheckpointError(f"{file}: tensor {key} is present but config.json implies the model has no "
                                  f"{', '.join(b.inactive[name].canonical)} (check the config's bias/tie flags)")
        if name in self._source:
            raise CheckpointError(f"{file}: tensor {key} duplicates {self._source[name][1]} "
                                  f"in {self._source[name][0]}")
        self._source[name] = (file, key)

    def _check_and_derive_shapes(self) -> None:
        expected = tensor_shapes(self.config)
        self._shape: dict[str, tuple[int, ...]] = {}
        self._dtype: dict[str, torch.dtype] = {}
        for br in self.binding.active:
            for n in br.hf:
                if n not in self._source:
                    raise CheckpointError(f"{self.path}: tensor {n} is missing "
                                          f"(needed for canonical {', '.join(br.canonical)})")
            metas = [self._files[f].meta[k] for f, k in (self._source[n] for n in br.hf)]
            where = f"{self._source[br.hf[0]][0]}: tensor {self._source[br.hf[0]][1]}"
            dtypes = sorted({str(m[1]) for m in metas})
            if len(dtypes) > 1:  # e.g. the experts of one stacked tensor
                raise CheckpointError(f"{where}: the tensors that make {', '.join(br.canonical)} have mixed "
                                      f"dtypes {dtypes}")
            try:
                shapes = br.op.forward_shapes([m[0] for m in metas], self.config)
            except (ValueError, RuntimeError) as e:
                raise CheckpointError(f"{where}: {e}") from None
            for c, s in zip(br.canonical, shapes):
                if s != expected[c]:
                    raise CheckpointError(f"{where} has shape {list(metas[0][0])}, which gives {c} {list(s)}; "
                                          f"config.json implies {list(expected[c])}")
                self._shape[c], self._dtype[c] = s, metas[0][1]
        self._shape = {c: self._shape[c] for c in expected}  # canonical order

    # -- reader protocol -------------------------------------------------------------------
    def dtype(self, name: str) -> torch.dtype:
        return self._dtype[name]

    def file_of(self, name: str) -> Path | None:
        if name not in self.binding.producer:
            return None
        br, _ = self.binding.producer[name]
        return self._source[br.hf[0]][0]

    def files(self) -> list[Path]:
        return list(self._files)

    def check_unchanged(self) -> None:
        for file, handle in self._files.items():
            handle.identity.check_path(file)

    def hf_name_of(self, name: str) -> tuple[str, ...]:
        """The HF tensor(s) a canonical tensor is made from (for messages and plans)."""
        return self.binding.producer[name][0].hf

    def get(self, name: str) -> torch.Tensor:
        if name not in self.binding.producer:
            raise CheckpointError(f"{self.path}: tensor {name} is missing")
        br, j = self.binding.producer[name]
        if self._cache[0] is br:  # a fused HF tensor feeds several canonical ones: split it once
            return self._cache[1][j]
        inputs = [self._files[f].get(k) for f, k in (self._source[n] for n in br.hf)]
        outputs = [t.contiguous() for t in br.op.forward(inputs, self.config)]
        self._cache = (br, outputs) if len(outputs) > 1 else (None, [])
        return outputs[j]

    def tokenizer_files(self) -> list[Path]:
        return tokenizer_files_in(self.path)

    def close(self) -> None:
        self._files.clear()
        self._cache = (None, [])
