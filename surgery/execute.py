"""Execute a plan, streamed: one output tensor at a time, written as it is made.

Memory: one output tensor plus the input tensors of its op (surgery/kernels.py), whatever the model
size, plus the read-ahead of the next two outputs (runtime/read_ahead.py). That memory is pooled
(runtime/buffers.py): inputs are read straight into the slots of stacked outputs, and each buffer
carries tensor after tensor instead of being faulted in anew for each.

Output: OUT ending in .safetensors is one file; anything else a directory of shards plus
model.safetensors.index.json and config.json. Everything is written under a temporary sibling
path and renamed onto OUT at the end, so an interrupted or failed merge leaves nothing at OUT.
The bytes depend only on the inputs, the recipe and the options: same inputs and --router-seed
give the same file.

The provenance (surgery/provenance.py) carries the inputs' digests (BLAKE3 computed in background
threads while the merge runs, or reused: surgery/hashing.py). A single-file output's header is written first, so it
carries fixed-length placeholders that are overwritten with the digests before the file is
renamed into place; a directory's index is written last, with the digests.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Callable, Iterator, Mapping

import torch
from tqdm import tqdm

from bam_surgery.runtime.atomic import atomic_path
from bam_surgery.runtime.buffers import BufferPool
from bam_surgery.runtime.checkpoint import SHARD_METADATA, side_files_metadata, write_dir_config, write_side_files
from bam_surgery.runtime.errors import print_warning
from bam_surgery.runtime.read_ahead import iter_tensors
from bam_surgery.runtime.safetensors_file import patch_header
from bam_surgery.runtime.shards import write_file, write_index, write_shards

from .branches import check_branches
from .hashing import FileDigest, InputHasher
from .plan import Plan
from .plan_reader import PlanReader
from .provenance import digest_replacements, output_metadata, plan_input_files, provenance

Warn = Callable[[str], None]


def _progress(total: int, enabled: bool):
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="merge", file=sys.stderr,
                disable=not enabled, dynamic_ncols=True, leave=False)


def _released_once_written(tensors: Iterator[tuple[str, torch.Tensor]], pool: BufferPool):
    """Each tensor's memory goes back to the pool when the writer asks for the next one: the
    writers (runtime/shards.py) write a tensor and drop it before they take the next."""
    for name, tensor in tensors:
        yield name, tensor
        pool.release(tensor)
        del tensor


def _digests_of_unchanged_inputs(plan: Plan, hasher: InputHasher) -> dict[Path, FileDigest]:
    """The inputs' digests, once every input file is checked to be the file the merge opened: an
    input modified in place while the merge read it (even to the same size) fails the merge
    instead of giving an output that mixes old and new bytes under a digest matching neither."""
    digests = hasher.result()
    for inp in plan.inputs:
        inp.reader.check_unchanged()
    return digests


def execute_plan(plan: Plan, out: str | os.PathLike, *, force: bool = False, max_shard_bytes: int | None = None,
                 progress: bool = False, warn: Warn | None = None, check_branch: bool = True,
                 on_stale: Warn | None = None, side_files: Mapping[str, bytes] = {}) -> Path:
    """Run the plan into OUT (file if it ends in .safetensors, else a sharded directory; max_shard_bytes applies
    to a directory). on_stale: told when a killed run's work folder for OUT is settled (default: warn).
    side_files: {name: content} the output carries (the seed's tokenizer files, chat template, generation
    config: app.exports.export_inputs), as runtime.checkpoint.write_checkpoint carries them; check_branch: warn
    about experts that do not look branched from the seed (surgery/branches.py), once the side files are known
    to fit. OUT is checked by the caller, once (app/merge.py: the OUT policy); the final rename still never
    replaces what is not ours (runtime/atomic.py)."""
    out = Path(out)
    warn = warn or print_warning
    single_file = out.suffix == ".safetensors"
    embedded = side_files_metadata(side_files, str(out)) if single_file else {}  # a binary one refused before any read
    if check_branch:
        check_branches(plan, warn)
    pool = BufferPool()
    reader = PlanReader(plan, warn=warn, hash_inputs=False, pool=pool)
    hasher = InputHasher(plan_input_files(plan))
    entries = [(t.name, t.shape, t.dtype) for t in plan.tensors]
    try:
        with atomic_path(out, is_dir=not single_file, replace=force, on_stale=on_stale or warn) as tmp, \
                _progress(plan.total_bytes, progress) as bar:
            tensors = _released_once_written(iter_tensors(reader, [t.name for t in plan.tensors]), pool)
            on_write = lambda name: bar.update(plan[name].nbytes)  # noqa: E731
            if single_file:  # header first, with placeholders for the digests
                pending = provenance(plan, hasher.pending())
                write_file(tmp, entries, tensors, {**output_metadata(plan, None, pending), **embedded}, on_write)
                digests = _digests_of_unchanged_inputs(plan, hasher)
                patch_header(tmp, digest_replacements(pending, provenance(plan, digests)))
            else:  # the index last, with the digests
                tmp.mkdir()
                weight_map = write_shards(tmp, entries, tensors, max_shard_bytes, file_metadata=SHARD_METADATA,
                                          on_write=on_write)
                write_index(tmp, weight_map, plan.total_bytes, output_metadata(plan, _digests_of_unchanged_inputs(
                    plan, hasher)))
                write_dir_config(tmp, plan.config)
                write_side_files(tmp, side_files)
    except BaseException:
        hasher.cancel()
        raise
    return out
