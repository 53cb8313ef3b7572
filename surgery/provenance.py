"""What a merge records about itself: metadata["bam_provenance"], compact JSON.

    tool      name and version
    recipe    name, file and full text
    options   every option with its effective value
    inputs    each input: name (unique identifier: seed, code, ...), role, path, expert slot, digest
              and its files, each with bytes, digest and how the digest was obtained:
                  "digest": "blake3:<hex>", "how": "bytes"      BLAKE3 of the file's bytes
                  "digest": "sha256:<hex>", "how": "hf-blob"    a Hugging Face cache blob's name
              (surgery/hashing.py). An input of one file has that file's digest; a sharded input
              the BLAKE3 of its manifest, the lines "<digest>  <file name>" sorted by name.
    tensors   each output tensor's op and sources

The bytes depend only on the inputs, the recipe and the options (no timestamps; a digest reused from
the digest cache is the same digest, recorded the same way).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import blake3

from bam_surgery import __version__
from bam_surgery.runtime.checkpoint import PROVENANCE_KEY, file_metadata
from bam_surgery.runtime.output_path import input_files

from .hashing import ALGORITHM, FileDigest
from .plan import Plan


def tool_version() -> str:
    return __version__


def plan_input_files(plan: Plan) -> list[Path]:
    return [f for inp in plan.inputs for f in input_files(inp.reader)]


HOW = {"read": "bytes", "cache": "bytes", "hf-blob": "hf-blob"}  # FileDigest.source -> provenance "how"


def input_records(inputs, digests: dict[Path, FileDigest] | None, expert_of=lambda index: None
                  ) -> list[dict[str, Any]]:
    """Each input's record: name, role, path, expert slot (expert_of its index), digest and files (digests: each
    input file's FileDigest; None: not hashed)."""
    records = []
    for inp in inputs:
        files = []
        for f in input_files(inp.reader):
            d = digests.get(f) if digests is not None else None
            files.append({"name": f.name, "bytes": f.stat().st_size, "digest": d.text if d else None,
                          "how": HOW[d.source] if d else None})
        records.append({"index": inp.index, "name": inp.name, "role": inp.role, "path": inp.label,
                        "expert": expert_of(inp.index), "digest": input_digest(files), "files": files})
    return records


def tool_record() -> dict[str, str]:
    return {"name": "bam-surgery", "version": tool_version()}


def provenance(plan: Plan, digests: dict[Path, FileDigest] | None) -> dict[str, Any]:
    """The provenance record; digests maps each input file to its FileDigest (None: not hashed)."""
    return {
        "tool": tool_record(),
        "recipe": {"name": plan.recipe.name, "file": plan.recipe.path, "text": plan.recipe.text},
        "options": plan.resolved_options(),
        "inputs": input_records(plan.inputs, digests,
                                lambda i: plan.members.index(i) if i in plan.members else None),
        "tensors": {t.name: t.provenance() for t in plan.tensors},
    }


def input_digest(files: list[dict[str, Any]]) -> str | None:
    """One digest per input: its file's, or for a sharded input "blake3:" + the BLAKE3 of its
    manifest, the lines "<digest>  <file name>" sorted by name."""
    if not files or any(f["digest"] is None for f in files):
        return None
    if len(files) == 1:
        return files[0]["digest"]
    manifest = "".join(f"{f['digest']}  {f['name']}\n" for f in sorted(files, key=lambda f: f["name"]))
    return f"{ALGORITHM}:{blake3.blake3(manifest.encode()).hexdigest()}"


def output_metadata(plan: Plan, digests: dict[Path, str] | None, record: dict[str, Any] | None = None
                    ) -> dict[str, str]:
    """A merge output's metadata: the canonical format's entries plus the provenance record."""
    record = provenance(plan, digests) if record is None else record
    return file_metadata(plan.config, {PROVENANCE_KEY: json.dumps(record, separators=(",", ":"), sort_keys=True)})


def digest_replacements(pending: dict[str, Any], final: dict[str, Any]) -> dict[str, str]:
    """{placeholder: digest} between a record made with placeholders and the final one."""
    changes = {}
    for before, after in zip(pending["inputs"], final["inputs"]):
        pairs = [(before["digest"], after["digest"])]
        pairs += [(a["digest"], b["digest"]) for a, b in zip(before["files"], after["files"])]
        changes.update((a, b) for a, b in pairs if a is not None and a != b)  # None: an input without files
    return changes
