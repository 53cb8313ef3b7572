"""Export a canonical checkpoint (dense or mixture) to a Hugging Face directory that carries its own modeling code.

    export_hf_bam(reader, "out/mix-hf", tokenizer_files=[...], model_card=text)
    AutoModelForCausalLM.from_pretrained("out/mix-hf", trust_remote_code=True)   # lm-eval, pipelines

The directory holds:
    config.json                      every ModelConfig field (same names) + architectures, auto_map, model_type, torch_dtype
    configuration_bam.py, modeling_bam.py, schema_bam.py    the remote code, copied from this package
                                     (schema_bam.py: fields, supported values, the transformers range)
    blocks_bam.py                    the model math modeling_bam.py imports: runtime/blocks.py, byte for byte
    routers.py                       the router kinds blocks_bam.py imports: runtime/routers.py, byte for byte
    config_rules.py                  the properties both config classes derive: runtime/config_rules.py, byte for byte
    deltanet.py                      the Gated DeltaNet's math blocks_bam.py imports: runtime/deltanet.py, byte for byte
    generation_config.json
    model.safetensors                one file, or, with max_shard_bytes,
    model-0000i-of-0000N.safetensors + model.safetensors.index.json
    tokenizer files (copied as given), README.md (the model card, if given)

Weight names: canonical names under "model.", lm_head.* at the top level (`hf_weight_name`), written
as identity rows by the HF directory writer (converters/hf/writer.py) that every HF format uses.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Iterable, Mapping

import torch

from bam_surgery.runtime import blocks as runtime_blocks
from bam_surgery.runtime import config_rules as runtime_config_rules
from bam_surgery.runtime import deltanet as runtime_deltanet
from bam_surgery.runtime import routers as runtime_routers
from bam_surgery.runtime.config import PRESET_NOTES, PRESETS, ModelConfig
from bam_surgery.runtime.dtypes import FLOAT_DTYPES, dtype_name, main_dtype
from bam_surgery.runtime.layout import tensor_shapes
from bam_surgery.runtime.reader import Reader, check_layout

from ..base import CapabilityError
from ..carry import Column, anything, supported_values, values
from . import schema_bam
from ..hf.architectures import BoundRule
from ..hf.files import CONFIG_FILE, GENERATION_CONFIG
from ..hf.ops import IDENTITY
from ..hf.writer import check_copies, plan_weights, stream_weights, write_hf_directory

CODE_DIR = Path(__file__).parent
CODE_FILES = ("configuration_bam.py", "modeling_bam.py", "schema_bam.py")
# every file of remote code in an export -> where it comes from (one copy of the model math: the runtime's)
SHIPPED_FILES = {**{name: CODE_DIR / name for name in CODE_FILES},
                 "blocks_bam.py": Path(runtime_blocks.__file__), "routers.py": Path(runtime_routers.__file__),
                 "config_rules.py": Path(runtime_config_rules.__file__), "deltanet.py": Path(runtime_deltanet.__file__)}
ARCHITECTURE = "BamForCausalLM"
AUTO_MAP = {"AutoConfig": "configuration_bam.BamConfig", "AutoModelForCausalLM": "modeling_bam.BamForCausalLM"}

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


def weight_rows(cfg: ModelConfig) -> list[BoundRule]:
    """The export as table rows (converters.hf.writer): each canonical tensor under its HF name, as is."""
    return [BoundRule((hf_weight_name(c),), (c,), IDENTITY, None) for c in tensor_shapes(cfg)]


# ---- what the export carries ----------------------------------------------------------------
# HF BAM's column of the table of what runs where (converters/carry.py): modeling_bam.py runs the runtime's own model
# math (blocks.py, shipped byte for byte), so it carries every value the runtime does, the values schema_bam.py lists
# (generated from ModelConfig: schema_text)
COLUMN = Column("hf", tuple(values(f, schema_bam.SUPPORTED[f]) if f in schema_bam.SUPPORTED else anything(f)[0]
                            for f in schema_bam.FIELDS))


def check_hf_bam(cfg: ModelConfig) -> None:
    """Raise a one-line CapabilityError if modeling_bam.py cannot run this config; runs before any I/O."""
    for f in dataclasses.fields(cfg):
        if f.name not in schema_bam.FIELDS:
            raise CapabilityError(f"cannot export to the HF BAM format: config field {f.name!r} is unknown to "
                                  "configuration_bam.py / modeling_bam.py")
    for row in COLUMN.failures(cfg):
        fld, allowed = row.fields[0], row.allowed
        raise CapabilityError(f"cannot export to the HF BAM format: {fld}={getattr(cfg, fld)!r} is not implemented by "
                              f"modeling_bam.py (supported: {', '.join(map(str, allowed))})")


# ---- the schema, generated from the model config ----------------------------------------------
SCHEMA_BEGIN = "# ---- generated from runtime/config.py ModelConfig"
SCHEMA_END = "# ---- end of the generated part"
SCHEMA_FILE = CODE_DIR / "schema_bam.py"


def schema_text(text: str) -> str:
    """schema_bam.py's text with its FIELDS and SUPPORTED made again from ModelConfig, the way blocks.py is shipped
    byte for byte: every field, same names, order and defaults (the sizes ModelConfig requires get the tiny preset's
    as placeholders; an export always sets every field), and each field of a fixed set of values its values (less
    those the field never takes). write_schema() writes it; tests/converters/test_hf_bam_export.py holds the file
    equal to it."""
    head, _, rest = text.partition(SCHEMA_BEGIN)
    return head + "\n".join(_schema_lines()) + rest.partition(SCHEMA_END)[2]


def _schema_lines() -> list[str]:
    placeholders = {k: v for k, v in PRESETS["tiny"].items() if k not in PRESET_NOTES}
    out = [f"{SCHEMA_BEGIN} (converters/hf_bam/export.py:schema_text; a test holds it equal)",
           "# Every field of bam-surgery's ModelConfig, same names, order and defaults; None for n_kv_heads / head_dim",
           "# means n_heads / d_model // n_heads. The sizes ModelConfig requires get placeholders: an export always sets",
           "# every field.", "FIELDS = {", "    # ---- dense architecture ----"]
    for f in dataclasses.fields(ModelConfig):
        if f.name == "ffn_experts":
            out.append("    # ---- mixture ----")
        value = placeholders[f.name] if f.default is dataclasses.MISSING else f.default
        out.append(f"    {json.dumps(f.name)}: {_literal(value)},")
    out += ["}", "", "# What modeling_bam.py implements, per config field of a fixed set of values. The exporter refuses "
            "configs", "# outside it (export.py:check_hf_bam), and so does BamConfig when a config.json is edited by "
            "hand.", "SUPPORTED = {"]
    for name, allowed in supported_values().items():
        out.append(f"    {json.dumps(name)}: ({', '.join(map(_literal, allowed))}),")
    return out + ["}", SCHEMA_END]


def _literal(value) -> str:
    """A Python literal of a default (strings in double quotes, as the file's other strings)."""
    return json.dumps(value) if isinstance(value, str) else repr(value)


def write_schema() -> None:
    """Rewrite schema_bam.py from ModelConfig (after a config field is added or its values change):
    .venv/bin/python -c 'from bam_surgery.converters.hf_bam.export import write_schema; write_schema()'"""
    SCHEMA_FILE.write_text(schema_text(SCHEMA_FILE.read_text(encoding="utf-8")), encoding="utf-8")


def hf_config_dict(cfg: ModelConfig, torch_dtype: torch.dtype,
                   generation: Mapping[str, object] | None = None) -> dict[str, object]:
    """config.json: the ModelConfig fields under their own names, plus what transformers needs to load it."""
    tokens = {k: v for k, v in (generation or {}).items() if k.endswith("_token_id")}
    return {
        "architectures": [ARCHITECTURE],
        "auto_map": dict(AUTO_MAP),
        "model_type": schema_bam.MODEL_TYPE,
        "torch_dtype": dtype_name(torch_dtype),
        # the oldest transformers the remote code runs under; configuration_bam.py refuses older ones at load
        # time and the range is in bam_transformers (the model card says it too)
        "transformers_version": schema_bam.TRANSFORMERS_MIN,
        "bam_transformers": {"requires": schema_bam.TRANSFORMERS_RANGE, "tested": list(schema_bam.TRANSFORMERS_TESTED)},
        "use_cache": True,
        **tokens,
        **cfg.to_dict(),
    }


def config_from_hf_dict(body: Mapping[str, object]) -> ModelConfig:
    """Inverse of hf_config_dict: the ModelConfig of an exported directory's config.json."""
    if body.get("model_type") != schema_bam.MODEL_TYPE:
        raise ValueError(f"config.json has model_type {body.get('model_type')!r}, not {schema_bam.MODEL_TYPE!r}")
    return ModelConfig.from_dict({f.name: body[f.name] for f in dataclasses.fields(ModelConfig) if f.name in body})


def export_hf_bam(reader: Reader, out_dir: str | os.PathLike, tokenizer_files: Iterable[str | os.PathLike] = (),
                  model_card: str | None = None, max_shard_bytes: int | None = None,
                  dtype: torch.dtype | None = None, generation: Mapping[str, object] | None = None,
                  replace: bool = True) -> Path:
    """Write a transformers-loadable directory at out_dir from a canonical reader.

    reader          any reader (runtime.reader protocol)
    max_shard_bytes None: one model.safetensors; else shards of at most this size plus an index
    dtype           cast every tensor to this dtype (None: keep each tensor's dtype)
    generation      generation_config.json entries, e.g. {"bos_token_id": 2, "eos_token_id": 1};
                    *_token_id entries also go to config.json
    Checks everything it can (config, tensor names, shapes and dtypes, extra files) before writing;
    the directory appears only when complete.
    """
    cfg = reader.config
    check_hf_bam(cfg)
    if dtype is not None and dtype not in FLOAT_DTYPES:
        raise CapabilityError(f"dtype {dtype} is not a float dtype")
    check_layout(reader, dtypes=FLOAT_DTYPES)
    rows = weight_rows(cfg)
    entries = plan_weights(reader, rows, dtype)
    texts = {CONFIG_FILE: json.dumps(hf_config_dict(cfg, main_dtype(entries), generation), indent=2) + "\n",
             GENERATION_CONFIG: json.dumps(dict(generation or {}), indent=2) + "\n"}
    if model_card is not None:
        texts["README.md"] = model_card
    copies = check_copies(tokenizer_files, [*texts, *SHIPPED_FILES])
    return write_hf_directory(out_dir, entries, stream_weights(reader, rows, dtype), texts=texts, copies=copies,
                              code=SHIPPED_FILES, max_shard_bytes=max_shard_bytes,
                              replace=replace)
