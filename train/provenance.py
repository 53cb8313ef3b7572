"""Provenance of trained checkpoints, and expert names.

A trained checkpoint keeps its init checkpoint's `bam_provenance` record (the merge's: tool, recipe,
options, inputs, tensors) and appends its own record to the list under "training", oldest first;
"experts" holds the expert names ({"ffn": [...], "attn": [...]}), so every later run, eval and
`inspect` uses the same names. A checkpoint without provenance (a Hugging Face model, a random init)
gets a record with "training" and "experts" only.

Expert names, first match: the record's "experts"; else the merge inputs (input with "expert": e
names expert e: its "name", else its path's file stem; a fine-grained merge's G experts of slot e are
"NAME.0" .. "NAME.{G-1}"); else "expert{e}". FFN experts beyond the merge's members (copies of the seed's FFN,
--extra-ffn-experts) are "expert{e}".
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bam_surgery.converters.byte_tokenizer import TOKENIZER_KEY
from bam_surgery.runtime.checkpoint import provenance_inputs
from bam_surgery.runtime.config import ModelConfig
from bam_surgery.runtime.errors import CheckpointError
from bam_surgery.runtime.jsonfile import parse_json

PROVENANCE_KEY = "bam_provenance"


def read_provenance(metadata: dict[str, str] | None) -> dict[str, Any] | None:
    raw = (metadata or {}).get(PROVENANCE_KEY)
    if raw is None:
        return None
    try:  # bounded (runtime/jsonfile.py): 50,000-deep nesting was a RecursionError
        return parse_json(raw, PROVENANCE_KEY, expect=dict)
    except CheckpointError:
        return None


def _stem(path: str) -> str:
    name = Path(str(path).rstrip("/\\").split("@")[0]).name
    for suffix in (".safetensors", ".gz"):
        name = name.removesuffix(suffix)
    return name


def expert_names(provenance: dict[str, Any] | None, cfg: ModelConfig) -> dict[str, list[str]]:
    """{"ffn": [E_ffn names], "attn": [E_attn names]} (lists empty for dense parts)."""
    prov = provenance or {}
    given = prov.get("experts")
    options = prov.get("options") if isinstance(prov.get("options"), dict) else {}
    fine = options.get("ffn_granularity", 1)  # a fine-grained merge: FFN expert e is part e % G of slot e // G
    fine = fine if isinstance(fine, int) and not isinstance(fine, bool) and fine > 0 else 1
    out: dict[str, list[str]] = {}
    for kind, n in (("ffn", cfg.ffn_experts), ("attn", cfg.attn_experts)):
        G = fine if kind == "ffn" and n % fine == 0 else 1
        names = [f"expert{e}" for e in range(n)]
        if isinstance(given, dict) and isinstance(given.get(kind), list) and len(given[kind]) == n:
            names = [str(x) for x in given[kind]]
        else:
            for inp in provenance_inputs(prov):
                e = inp.get("expert")
                if isinstance(e, int) and not isinstance(e, bool) and 0 <= e * G < n:
                    label = inp.get("name") or (_stem(inp["path"]) if inp.get("path") else None)
                    if label:
                        names[e * G:(e + 1) * G] = [str(label)] if G == 1 else [f"{label}.{g}" for g in range(G)]
        out[kind] = _unique(names)
    return out


def _unique(names: list[str]) -> list[str]:
    seen: dict[str, int] = {}
    for n in names:
        seen[n] = seen.get(n, 0) + 1
    return [f"{n}-{e}" if seen[n] > 1 else n for e, n in enumerate(names)]


def chain(init_provenance: dict[str, Any] | None, record: dict[str, Any], experts: dict[str, list[str]]
          ) -> dict[str, Any]:
    """The trained checkpoint's provenance: the init's record, this run appended under "training"."""
    prov = dict(init_provenance or {})
    history = prov.get("training") if isinstance(prov.get("training"), list) else []
    prov["training"] = [*history, record]
    prov["experts"] = experts
    return prov


def dumps(prov: dict[str, Any]) -> str:
    return json.dumps(prov, separators=(",", ":"), sort_keys=True)
