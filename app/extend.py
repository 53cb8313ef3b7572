"""The extend use case: specialists added to a trained mixture (`bam-surgery extend`).

    result = extend("runs/bam/", [("math", "math.safetensors")], "bam-plus-math/",
                    options=ExtendOptions(router_init="domain", calibration="math=data/math,general=data/general"))
    result.path, result.extension.config

Walk: the inputs opened (a train run folder as its newest checkpoint; headers only) and named, the extension
planned and checked (surgery/extend.py), the new router rows from data (--router-init prompts | domain), OUT checked,
the inputs hashed, and the canonical checkpoint written (one tensor at a time) with the mixture's side files
(tokenizer, chat template, generation config) and a provenance that keeps the mixture's record whole and appends
this extension to it.
"""
from __future__ import annotations

import json
import os
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from bam_surgery.runtime.checkpoint import PROVENANCE_KEY, write_checkpoint
from bam_surgery.runtime.output_path import check_output_path
from bam_surgery.runtime.sizes import parse_size
from bam_surgery.surgery.errors import BamSurgeryError
from bam_surgery.surgery.extend import (Extension, extended_provenance, extension_record, extension_rows,
                                        plan_extension)
from bam_surgery.surgery.hashing import InputHasher
from bam_surgery.surgery.names import input_names
from bam_surgery.surgery.options import ExtendOptions
from bam_surgery.surgery.plan_reader import PlanReader
from bam_surgery.surgery.provenance import input_records, plan_input_files, tool_record

from .exports import carried_files, export_inputs
from .inputs import open_input
from .reporter import Reporter


@dataclass(frozen=True)
class ExtendResult:
    extension: Extension  # what was written (its readers closed: its shapes and config are there to show)
    path: Path


def extend(mixture: str, experts: Sequence[tuple[str | None, str]], out: str | os.PathLike, *,
           options: ExtendOptions = ExtendOptions(), max_shard_size: str | None = None, force: bool = False,
           allow_pickle: bool = False, reporter: Reporter | None = None) -> ExtendResult:
    """Add `experts` ([(name or None, checkpoint)], dense specialists branched from the mixture's seed) to the
    trained `mixture`, into OUT (canonical: a .safetensors file, or a folder of shards). reporter: the new rows'
    progress lines and OUT the moment it is in place, before the inputs are closed (default: Reporter())."""
    reporter = reporter or Reporter()
    if not experts:
        raise BamSurgeryError("--experts: give at least one specialist to add")
    shard_bytes = parse_size(max_shard_size) if max_shard_size else None
    if shard_bytes and str(out).endswith(".safetensors"):
        raise BamSurgeryError(f"--max-shard-size: {out} is a single .safetensors file; give a directory path to "
                              "write shards")
    out = Path(out)
    with ExitStack() as opened:
        readers = [opened.enter_context(open_input(spec, allow_pickle)) for spec in (mixture, *(s for _, s in experts))]
        names = input_names([mixture, *(s for _, s in experts)], ["mixture", *(n for n, _ in experts)])
        ext = extension_rows(plan_extension(readers[0], readers[1:], names, options), reporter.log)
        check_output_path(out, force, [(inp.label, inp.reader) for inp in ext.inputs])
        digests = InputHasher(plan_input_files(ext)).result()
        record = extension_record(ext, input_records(ext.inputs, digests), tool_record())
        prov = json.dumps(extended_provenance(ext, record), separators=(",", ":"), sort_keys=True)
        carried = carried_files(export_inputs(readers[0], "canonical", warn=reporter.warning))
        path = write_checkpoint(PlanReader(ext, hash_inputs=False), out, {PROVENANCE_KEY: prov}, shard_bytes,
                                replace=force, side_files=carried)
        reporter.written(path)
    return ExtendResult(ext, path)
