"""Lazy reader of a GGUF file (llama.cpp, Ollama) that speaks canonical names.

    r = GGUFCheckpointReader(Path("model.gguf"))   # or any part of model-00001-of-00003.gguf
    r.config                                      # ModelConfig, from {arch}.* metadata through gguf_table.hparams
    r.get("layers.0.attn.q.weight")               # that one tensor, dequantized, in canonical layout
    r.tokenizer_files()                           # tokenizer.json, tokenizer_config.json, generation_config.json

Opening parses and checks the header, metadata and tensor directory (gguf_file.parse_gguf: nothing trusted before it
is checked against the file) and maps every tensor through the table the export uses (gguf_table: names, the config
keys, the architecture's RoPE and gating); every tensor must be one of the model the metadata describes, with its
shape, and every tensor of that model must be there. The architectures are gguf_table.ARCHS (llama, Mixtral-shaped
llama mixtures, qwen2, qwen2moe, qwen3, qwen3moe, olmo2, phi3 with its fused attn_qkv and ffn_up, smollm3, gemma2,
gemma3, qwen35 and qwen35moe (gguf_table's LINEAR section: the Gated DeltaNet tensors back in transformers' order,
a_log = log(-ssm_a)), gemma4 (its GEMMA4 section)); each row gives the QK-norm, norm position, layers without RoPE and Gemma's features (its norms, stored as
1 + w, read as (1 + w) norms: w = v - 1 in float32; its sliding windows, their RoPE and attention scale from
gguf_table.windows_of and attn_scale_dim), and gguf_table.scaled_rope_of the scaled RoPE from the
rope.scaling.* keys and the frequency-factor tensors (rope_freqs, rope_factors_long / _short), which are the
config's, not the model's. A part of a fused tensor is its rows. `get` reads one tensor from the memory map and
dequantizes it with gguf.quants.dequantize (every type the installed gguf dequantizes: Q4_0 ... Q8_0, the K-quants,
the IQ types, BF16); F32 / F16 / BF16 tensors keep their dtype, quantized ones come back as float32, so a model is
never in memory as a whole. Q and K of an architecture that rotates pairs (llama, smollm3) are permuted back to
rotate-halves rows (gguf_table.rope_halves, exact). The tokenizer is rebuilt from tokenizer.ggml.* (gguf_tokenizer.py).
"""
from __future__ import annotations

import math
import os
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from bam_surgery.runtime.cache import untrusted_cache
from bam_surgery.runtime.checkpoint import PROVENANCE_KEY
from bam_surgery.runtime.config import ConfigError, ModelConfig
from bam_surgery.runtime.errors import CheckpointError, printable
from bam_surgery.runtime.jsonfile import parse_json, read_json
from bam_surgery.runtime.layout import tensor_shapes
from bam_surgery.runtime.reader import ShapeTableReader
from bam_surgery.runtime.safetensors_file import FileIdentity

from .byte_tokenizer import TOKENIZER_KEY, UNAVAILABLE
from .gguf_file import GGUFFile, TensorInfo, open_gguf, parse_gguf, split_files
from .gguf_metadata import INTEGER, NUMBER, STRING, MetadataError, metadata_value
from .gguf_table import (ARCHS, ROPE_TENSORS, SOFTCAP_DEFAULTS, GGUFArch, attn_scale_dim, fused_of, geometry_fields,
                         gguf_module, hparams, is_norm, linear_fields, linear_tensor, rope_halves, rope_heads,
                         rope_tensor_name, scaled_rope_of, split_heads, tensor_layout, tensor_names, windows_of)
from .gguf_tokenizer import DIRECTORY as TOKENIZER_CACHE
from .gguf_tokenizer import rebuild_tokenizer

BAM_CONFIG = "bam_surgery.config"  # our export's record of the config (its tie_embeddings says output.weight is a copy)
_KEPT = {0: torch.float32, 1: torch.float16, 30: torch.bfloat16}  # GGMLQuantizationType F32, F16, BF16


@lru_cache(maxsize=None)
def dequantizable(qtype: int) -> bool:
    """Whether the installed gguf dequantizes this type (tried on one zero block)."""
    gguf = gguf_module()
    if qtype in _KEPT:
        return True
    try:
        kind = gguf.GGMLQuantizationType(qtype)
        block, size = gguf.GGML_QUANT_SIZES[kind]
        gguf.quants.dequantize(np.zeros((1, size), dtype=np.uint8), kind)
    except (NotImplementedError, ValueError, KeyError):
        return False
    return True


def _type_name(qtype: int) -> str:
    gguf = gguf_module()
    try:
        return gguf.GGMLQuantizationType(qtype).name
    except ValueError:
        return str(qtype)


class GGUFCheckpointReader(ShapeTableReader):
    """The reader protocol (runtime.reader) over a GGUF file or a split GGUF."""

    def __init__(self, path: str | os.PathLike, folder: str | os.PathLike | None = None):
        """`folder`: the model folder the file was found in (open_checkpoint of a folder); a split GGUF's parts are
        always files of the named part's folder. Either way each part is opened by the folder rule of every weight
        file (gguf_file.open_gguf)."""
        self.path = Path(path)
        self.parts = split_files(self.path)
        self._folder = Path(folder) if folder is not None else self.path.parent if len(self.parts) > 1 else None
        parsed = [parse_gguf(p, self._folder) for p in self.parts]
        self._identity = {p: FileIdentity.of(part.stat) for p, part in zip(self.parts, parsed)}
        self._maps: dict[int, np.memmap] = {}
        head = parsed[0]
        fields = head.fields
        where = str(self.parts[0])
        self._check_split(parsed)
        arch_name = metadata_value(fields, "general.architecture", STRING, where=where)
        if arch_name not in ARCHS:
            raise CheckpointError(f"{where}: llama.cpp architecture {printable(arch_name)[:40]!r} is not one this "
                                  f"reader maps ({', '.join(ARCHS)})")
        self.arch: GGUFArch = ARCHS[arch_name]
        found: dict[str, tuple[int, TensorInfo]] = {}
        for i, part in enumerate(parsed):
            for t in part.tensors:
                if t.name in found:
                    raise CheckpointError(f"{part.path}: tensor {printable(t.name)} is also in "
                                          f"{self.parts[found[t.name][0]]}")
                if not dequantizable(t.qtype):
                    raise CheckpointError(f"{part.path}: tensor {printable(t.name)} has type {_type_name(t.qtype)}, "
                                          "which is no weight type gguf dequantizes")
                found[t.name] = (i, t)
        self._rope_note: str | None = None
        self.config = self._config(fields, found, where)
        self._map(found)
        self.architecture = self.arch.hf_mixture if self.config.ffn_experts else self.arch.hf_dense
        context = metadata_value(fields, f"{arch_name}.context_length", INTEGER, None, low=0, where=where)
        self._tokenizer, note = rebuild_tokenizer(fields, where, context)
        # the token ids an HF config.json carries (bos / eos / pad): the rebuilt generation_config.json's
        self.hf_config = read_json(self._tokenizer[-1], expect=dict) if self._tokenizer else None
        self.metadata = {"format": "gguf", "source": str(self.path), "gguf_architecture": arch_name}
        notes = [f"tokenizer not rebuilt: {note} (the commands that need it take --tokenizer)"] if note else []
        if note and "tokenizer.ggml.model" in fields:  # a tokenizer it carries: never read as bytes in its place
            self.metadata[TOKENIZER_KEY] = f"{UNAVAILABLE}{note}"
        problem = untrusted_cache(TOKENIZER_CACHE) if self._tokenizer else None
        if problem:
            notes.append(f"tokenizer rebuilt into a private temporary folder, not the cache: {problem} (set "
                         "BAM_SURGERY_CACHE to a folder of your own)")
        notes += [self._rope_note] if self._rope_note else []
        if notes:
            self.metadata["notes"] = "; ".join(notes)
        provenance = metadata_value(fields, "bam_surgery.provenance", STRING, None, where=where)
        if provenance is not None:
            self.metadata[PROVENANCE_KEY] = provenance

    # -- opening ---------------------------------------------------------------------------
    def _check_split(self, parsed: list[GGUFFile]) -> None:
        if len(parsed) == 1:
            return
        for i, part in enumerate(parsed):
            count = metadata_value(part.fields, "split.count", INTEGER, None, where=str(part.path))
            no = metadata_value(part.fields, "split.no", INTEGER, None, where=str(part.path))
            if count != len(parsed) or no != i:
                raise CheckpointError(f"{part.path}: split.count {count} / split.no {no}; the file name says part "
                                      f"{i + 1} of {len(parsed)} (split.no counts from 0)")

    def _config(self, fields: dict, found: dict[str, tuple[int, TensorInfo]], where: str) -> ModelConfig:
        arch = self.arch.name
        values, own = self._key_fields(fields, found, where)
        for cap in ("attn_softcap", "final_softcap"):  # what llama.cpp's arch applies, its default where absent
            mode = getattr(self.arch, cap)
            value = values.pop(cap, SOFTCAP_DEFAULTS[cap] if mode == "always" else None)
            if mode == "always" or (mode == "optional" and value):  # gemma3: a final soft-cap of 0 is none
                values[cap] = value
        missing = [f for f in ("d_model", "n_layers", "n_heads", "ffn_hidden") if f not in values]
        if missing:
            names = {h.field: h.key.format(arch=arch) for h in hparams()}
            raise CheckpointError(f"{where}: metadata has no {names[missing[0]]}")
        if not 0 < values["n_layers"] <= len(found):
            raise CheckpointError(f"{where}: {arch}.block_count {values['n_layers']} with {len(found)} tensors")
        if "vocab_size" not in values and "token_embd.weight" in found:
            values["vocab_size"] = found["token_embd.weight"][1].shape[0]
        rotary = values.pop("rotary_dim", None)
        head_dim = values.get("head_dim") or (values["d_model"] // values["n_heads"] if values["n_heads"] > 0 else 1)
        if rotary is not None and not 0 < rotary <= head_dim:
            raise CheckpointError(f"{where}: {arch}.rope.dimension_count is {rotary}, expected from 1 to the head size "
                                  f"{head_dim} (the dimensions of each head RoPE rotates)")
        has = {n for n in found}
        recorded = _recorded_config(fields)
        tied = "output.weight" not in has
        if not tied and self.arch.output_always:  # our export writes a tied embedding once more (qwen2moe, olmo2)
            tied = recorded.get("tie_embeddings") is True
        values.update(self._architecture_fields(has, values["n_layers"]), tie_embeddings=tied, name=arch,
                      rotary_fraction=own.get("rotary_fraction",
                                              (rotary / head_dim) if rotary is not None and head_dim else 1.0))
        if self.arch.attn_scale_layers and values["n_heads"] > 0:
            scale = attn_scale_dim(arch, values["d_model"], values["n_heads"], values["n_layers"], head_dim)
            kept = recorded.get("attn_scale_dim")  # our record's spelling (an HF config's query_pre_attn_scalar)
            values["attn_scale_dim"] = kept if (kept or head_dim) == scale else scale if scale != head_dim else None
        if self.arch.linear_attention:
            try:
                values.update(linear_fields(arch, fields, values["n_layers"]))
            except ValueError as e:
                raise CheckpointError(f"{where}: {e}") from None
        if values.get("ffn_experts"):
            if self.arch.gate_norm is None:
                raise CheckpointError(f"{where}: {arch}.expert_count is set, but llama.cpp's {arch} has no experts")
            values["gate_norm"] = self.arch.gate_norm
        try:
            plain = ModelConfig(**values)
            scaled, self._rope_note = scaled_rope_of(arch, fields, self._rope_tensors(found, where), plain,
                                                     recorded.get("scaled_rope"))
            plain = plain.replace(scaled_rope=scaled) if scaled is not None else plain
            windows = windows_of(arch, fields, plain)
            return plain.replace(**windows) if windows else plain
        except MetadataError as e:
            raise CheckpointError(f"{where}: {e}") from None
        except (ConfigError, TypeError, ValueError) as e:
            raise CheckpointError(f"{where}: its metadata describes no valid model: {' '.join(str(e).split())}") \
                from None

    def _key_fields(self, fields: dict, found: dict[str, tuple[int, TensorInfo]], where: str) -> tuple[dict, dict]:
        """(config fields from the {arch}.* keys gguf_table.hparams lists, and the architecture's own: Gemma 4's
        per-layer arrays and global head size, its GEMMA4 section, which override those)."""
        arch = self.arch.name
        own, consumed = {}, set()
        if self.arch.per_layer_geometry:
            try:
                own, consumed = geometry_fields(arch, fields, set(found))
            except ValueError as e:
                raise CheckpointError(f"{where}: {e}") from None
        values = _hparam_values({k: v for k, v in fields.items() if k not in consumed}, self.arch, where)
        values.update(own)
        return values, own

    def _architecture_fields(self, has: set[str], n_layers: int) -> dict:
        """The config fields the architecture fixes, and the biases its tensors show."""
        row = self.arch
        return dict(qkv_bias="blk.0.attn_q.bias" in has or "blk.0.attn_qkv.bias" in has,
                    o_bias="blk.0.attn_output.bias" in has, ffn_bias="blk.0.ffn_up.bias" in has, qk_norm=row.qk_norm,
                    norm_position=row.norm_position, nope_layers=row.nope_layers(n_layers), activation=row.activation,
                    scale_embeddings=row.scale_embeddings, norm_unit_offset=row.unit_offset_norms)

    def _rope_tensors(self, found: dict[str, tuple[int, TensorInfo]], where: str) -> dict[str, np.ndarray]:
        """The RoPE frequency-factor tensors of the file (gguf_table.ROPE_TENSORS), taken out of `found` (they are
        the config's, not the model's): float32 vectors."""
        out = {}
        for member in sorted({m for members in ROPE_TENSORS.values() for m in members}):
            name = rope_tensor_name(member)
            if name not in found:
                continue
            i, t = found.pop(name)
            if t.qtype != 0 or len(t.shape) != 1:
                raise CheckpointError(f"{self.parts[i]}: tensor {name} is {_type_name(t.qtype)} of shape "
                                      f"{list(t.shape)}, not a float32 vector")
            out[name] = read_tensor(self._bytes(i), t).numpy()
        return out

    def _map(self, found: dict[str, tuple[int, TensorInfo]]) -> None:
        cfg = self.config
        expected = tensor_shapes(cfg)
        layout, _ = tensor_layout(self.arch.name, cfg)
        output = tensor_names(self.arch.name, cfg.n_layers).get("lm_head.weight")
        self._source: dict[str, tuple[int, TensorInfo, int]] = {}  # canonical -> (part, tensor, first row)
        for name, (i, t) in found.items():
            where = f"{self.parts[i]}: tensor {printable(name)}"
            if name == output and cfg.tie_embeddings:
                continue  # the tied embedding written once more (qwen2moe, olmo2)
            held = layout.get(name)
            if held is None:
                raise CheckpointError(f"{where} is not part of llama.cpp's {self.arch.name} for the model its metadata "
                                      "describes (unknown tensor)")
            want = (sum(expected[c][0] for c in held), *expected[held[0]][1:])
            if _squeezed(t.shape) != _squeezed(want):
                raise CheckpointError(f"{where} has shape {list(t.shape)}; the metadata implies {list(want)} "
                                      f"for {' + '.join(held)}")
            row = 0
            for c in held:
                self._source[c] = (i, t, row)
                row += expected[c][0]
        names = {c: n for n, held in layout.items() for c in held}
        for c in expected:
            if c not in self._source:
                raise CheckpointError(f"{self.parts[0]}: tensor {names.get(c, c)} is "
                                      f"missing (needed for {c})")
        self._shape = expected

    # -- reader protocol -------------------------------------------------------------------
    def dtype(self, name: str) -> torch.dtype:
        if self._unit_offset(name):
            return torch.float32
        return _KEPT.get(self._source[name][1].qtype, torch.float32)

    def _unit_offset(self, name: str) -> bool:
        """Whether `name` is a (1 + w) norm stored as 1 + w (gguf_table's WINDOWS section): read as v - 1 in float32."""
        return self.config.norm_unit_offset and is_norm(name)

    def file_of(self, name: str) -> Path | None:
        return self.parts[self._source[name][0]] if name in self._source else None

    def files(self) -> list[Path]:
        return list(self.parts)

    def tokenizer_files(self) -> list[Path]:
        return list(self._tokenizer)

    def check_unchanged(self) -> None:
        for part, identity in self._identity.items():
            identity.check_path(part)

    def get(self, name: str) -> torch.Tensor:
        if name not in self._source:
            raise CheckpointError(f"{self.path}: tensor {name} is missing")
        i, t, row = self._source[name]
        tensor = read_tensor(self._bytes(i), t)
        shape = self._shape[name]
        fused = fused_of(self.arch.name, name)
        if fused is not None and fused.per_head:  # qwen35's attn_q: each head's query, then its gate
            tensor = split_heads(tensor.reshape(-1, *shape[1:]), self.config.n_heads, len(fused.parts), row // shape[0])
        elif tensor.numel() != math.prod(shape):  # one part of a fused tensor (phi3's attn_qkv, ffn_up): its rows
            tensor = tensor.reshape(-1, *shape[1:])[row:row + shape[0]].clone()
        tensor = linear_tensor(name, tensor.reshape(shape), self.config, to_gguf=False)
        heads = rope_heads(name, self.config, self.arch.name)
        if self._unit_offset(name):
            tensor = tensor.to(torch.float32) - 1.0
        return (rope_halves(tensor, heads) if heads else tensor).contiguous()

    def _bytes(self, i: int) -> np.memmap:
        """Part i's bytes: a memory map of the file opened again by the rule it was parsed by (gguf_file.open_gguf)
        and checked, on that descriptor, to be the file parsed (FileIdentity: not replaced or rewritten since)."""
        if i not in self._maps:
            part = self.parts[i]
            with open_gguf(part, self._folder) as f:
                self._identity[part].check(os.fstat(f.fileno()), part)
                self._maps[i] = np.memmap(f, dtype=np.uint8, mode="r")
        return self._maps[i]

    def close(self) -> None:
        self._maps.clear()


def _recorded_config(fields: dict) -> dict:
    """Our export's record of the config (bam_surgery.config), or {}: what the file's own keys cannot say (a tied
    embedding also written as output.weight, Llama 3's RoPE parameters) is taken from it only where it agrees with
    the file."""
    try:
        return parse_json(metadata_value(fields, BAM_CONFIG, STRING, "{}"), BAM_CONFIG, expect=dict)
    except (CheckpointError, MetadataError):
        return {}


def _hparam_values(fields: dict, row: GGUFArch, where: str) -> dict:
    """The ModelConfig fields of the file's {arch}.* keys (gguf_table.hparams; the keys of fields the architecture's
    record carries only there), each checked by the one rule of GGUF values: u32 keys non-negative integers, f32 keys
    finite numbers. Two keys of one field must agree (key_length and value_length: the runtime has one head size for
    keys and values), but for the experts' width, which replaces the dense one (qwen2moe's
    expert_feed_forward_length). A key that holds a field's reciprocal (granite's logit_scale) is read as 1 / it."""
    values: dict = {}
    given: dict[str, str] = {}
    for h in hparams():
        key = h.key.format(arch=row.name)
        if key not in fields or (h.carried and h.field not in row.carries):
            continue
        value = metadata_value(fields, key, INTEGER if h.kind == "u32" else NUMBER, low=0 if h.kind == "u32" else None,
                               where=where)
        if h.field == "attn_scale" and not value:  # llama.cpp's 0: 1/sqrt(head_dim)
            continue
        if h.reciprocal:
            if not value:
                raise CheckpointError(f"{where}: {key} is 0, which llama.cpp divides by")
            value = 1.0 / value
        if h.field in values and values[h.field] != value and h.field != "ffn_hidden":
            raise CheckpointError(f"{where}: {key} is {value} but {given[h.field]} is {values[h.field]}; the runtime "
                                  f"computes one {h.field} for both (a model whose keys and values differ in size is "
                                  "not one it reads)")
        values[h.field], given[h.field] = value, key
    return values


def read_tensor(data: np.ndarray, t: TensorInfo) -> torch.Tensor:
    """Tensor `t` from a file's bytes (a memory map), in memory of its own: F32 / F16 / BF16 as they are, any other
    type dequantized to float32 by gguf.quants.dequantize; shaped as the file declares it."""
    gguf = gguf_module()
    raw = data[t.start:t.start + t.nbytes]
    if t.qtype in _KEPT:
        view = raw.view(np.int16 if t.qtype == 30 else np.float32 if t.qtype == 0 else np.float16)
        tensor = torch.from_numpy(view.copy())
        return (tensor.view(torch.bfloat16) if t.qtype == 30 else tensor).reshape(t.shape)
    kind = gguf.GGMLQuantizationType(t.qtype)
    rows = raw.reshape(gguf.quant_shape_to_byte_shape(t.shape, kind))
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(rows, kind), dtype=np.float32)).reshape(t.shape)


def _squeezed(shape: tuple[int, ...]) -> tuple[int, ...]:
    """A shape without leading 1s (llama.cpp writes the shared expert's gate [1, D] as [D] or [D, 1])."""
    shape = tuple(shape)
    while len(shape) > 1 and shape[0] == 1:
        shape = shape[1:]
    return shape
