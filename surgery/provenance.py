"""What a merge records about itself: metadata["bam_provenance"], compact JSON.

    tool      name and version
    recipe    name, file and full text
    options   every option with its effective value
    inputs    each input: name (unique identifier: seed, code, ...), role, path, expert slot, sha256 (of its file, or of its manifest
              "<sha256>  <file name>" lines, sorted, for a sharded input) and its files
    tensors   each output tensor's op and sources

The bytes depend only on the inputs, the recipe and the options (no timestamps).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from bam_surgery.runtime.checkpoint import PROVENANCE_KEY, file_metadata
from bam_surgery.runtime.reader import Reader

from .plan import Plan


def tool_version() -> str:
    from bam_surgery import __version__
    return __version__


def input_files(reader: Reader) -> list[Path]:
    """The files a reader reads, resolved (what provenance hashes and OUT may not overwrite)."""
    return [Path(f).resolve() for f in reader.files()]


def plan_input_files(plan: Plan) -> list[Path]:
    return [f for inp in plan.inputs for f in input_files(inp.reader)]


def provenance(plan: Plan, digests: dict[Path, str] | None) -> dict[str, Any]:
    """The provenance record; digests maps each input file to its sha256 (None: not hashed)."""
    inputs = []
    for inp in plan.inputs:
        files = [{"name": f.name, "bytes": f.stat().st_size,
                  "sha256": digests.get(f) if digests is not None else None} for f in input_files(inp.reader)]
        inputs.append({"index": inp.index, "name": inp.name, "role": inp.role, "path": inp.label,
                       "expert": plan.members.index(inp.index) if inp.index in plan.members else None,
                       "sha256": input_digest(files), "files": files})
    return {
        "tool": {"name": "bam-surgery", "version": tool_version()},
        "recipe": {"name": plan.recipe.name, "file": plan.recipe.path, "text": plan.recipe.text},
        "options": plan.resolved_options(),
        "inputs": inputs,
        "tensors": {t.name: t.provenance() for t in plan.tensors},
    }


def input_digest(files: list[dict[str, Any]]) -> str | None:
    """One sha256 per input: its file's, or for a sharded input the sha256 of its manifest, the lines
    "<sha256>  <file name>" sorted by name (what `sha256sum` prints)."""
    if not files or any(f["sha256"] is None for f in files):
        return None
    if len(files) == 1:
        return files[0]["sha256"]
    manifest = "".join(f"{f['sha256']}  {f['name']}\n" for f in sorted(files, key=lambda f: f["name"]))
    return hashlib.sha256(manifest.encode()).hexdigest()


def output_metadata(plan: Plan, digests: dict[Path, str] | None, record: dict[str, Any] | None = None
                    ) -> dict[str, str]:
    """A merge output's metadata: the canonical format's entries plus the provenance record."""
    record = provenance(plan, digests) if record is None else record
    return file_metadata(plan.config, {PROVENANCE_KEY: json.dumps(record, separators=(",", ":"), sort_keys=True)})


def placeholders(files: list[Path]) -> dict[Path, str]:
    """Stand-in digests for a header written before the inputs are hashed: 64 characters, like a
    hex sha256, so swapping in the digests keeps the header's length (a sharded input's manifest
    digest, computed from these, is 64 hex characters too)."""
    return {f: f"sha256-pending-{k:06d}".ljust(64, "-") for k, f in enumerate(files)}


def digest_replacements(pending: dict[str, Any], final: dict[str, Any]) -> dict[str, str]:
    """{placeholder: digest} between a record made with placeholders and the final one."""
    changes = {}
    for before, after in zip(pending["inputs"], final["inputs"]):
        pairs = [(before["sha256"], after["sha256"])]
        pairs += [(a["sha256"], b["sha256"]) for a, b in zip(before["files"], after["files"])]
        changes.update((a, b) for a, b in pairs if a is not None)  # None: an input without files
    return changes
