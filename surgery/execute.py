"""Execute a plan, streamed: one output tensor at a time, written as it is made.

Memory: one output tensor plus the input tensors of its op (a mean keeps a float32 accumulator and
one input; a stack its output and one input), whatever the model size. Inputs are read through
their readers one tensor at a time and dropped after use.

Output: OUT ending in .safetensors is one file; anything else a directory of shards plus
model.safetensors.index.json and config.json. Everything is written under a temporary sibling
path and renamed onto OUT at the end, so an interrupted or failed merge leaves nothing at OUT.
The bytes depend only on the inputs, the recipe and the options (no timestamps): same inputs and
--router-seed give the same file.

Provenance (metadata key "bam_provenance", compact JSON): tool version, the recipe (name and full
text), the resolved options, every input with the sha256 of its files, and each output tensor's op
and sources. Hashing reads every input byte once more and costs ~1 s of CPU per GB (sha256 with
SHA-NI); it runs in background threads (at most half the cores) while the merge reads the same
files, so the page cache serves one of the two readers. Measured on 2 cores, warm cache, four
0.6 GB bf16 inputs: 6.4 s without hashing, 6.9 s with. A single-file output's header is written
first, so it carries fixed-length placeholders that are overwritten with the digests before the
file is renamed into place.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import torch

from bam_surgery.runtime.checkpoint import (CONFIG_KEY, FORMAT, SafetensorsStreamWriter, atomic_path, iter_tensors, plan_shards,
                                shard_name, write_dir_config, write_index)

from .errors import BamSurgeryError, InputError
from .plan import Plan, Source, TensorOp, file_label

PROVENANCE_KEY = "bam_provenance"
# Relative distance ||W_e - W_s|| / ||W_s|| above which an expert is reported as evidently not
# branched from the seed. Continued pre-training moves weights by a few percent to a few tens of
# percent; two independently initialized models of the same scale sit near sqrt(2) ~ 1.41.
FAR_FROM_SEED = 0.5
_HASH_CHUNK = 16 << 20

Warn = Callable[[str], None]


def tool_version() -> str:
    from bam_surgery import __version__
    return __version__


def parse_size(text: str) -> int:
    """'2GB' -> 2_000_000_000, '500MiB' -> 524_288_000, '1000' -> 1000 bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*", str(text), re.IGNORECASE)
    if not m:
        raise BamSurgeryError(f"--max-shard-size: cannot read {text!r}; write e.g. 2GB, 500MB or 1GiB")
    unit = (m.group(2) or "").lower()
    scale = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
             "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}[unit]
    size = int(float(m.group(1)) * scale)
    if size <= 0:
        raise BamSurgeryError(f"--max-shard-size: must be positive, got {text!r}")
    return size


# ---- reading inputs ------------------------------------------------------------------------------
def _where(plan: Plan, src: Source) -> str:
    inp = plan.inputs[src.input]
    return file_label(inp.reader, src.name, inp.label)


def all_finite(x: torch.Tensor) -> bool:
    """No NaN or Inf in x. aminmax propagates NaN and surfaces +-Inf as the min/max; it runs in the
    input's dtype, ~10x faster than isfinite().all() on bf16. Every input tensor goes through this."""
    if x.numel() == 0:
        return True
    lo, hi = torch.aminmax(x)
    return math.isfinite(float(lo)) and math.isfinite(float(hi))


def read_source(plan: Plan, src: Source, allow_nonfinite: bool, warn: Warn | None = None) -> torch.Tensor:
    """One input tensor, checked against its header and for non-finite values."""
    reader = plan.inputs[src.input].reader
    try:
        x = reader.get(src.name)
    except Exception as e:
        raise InputError(f"{_where(plan, src)}: tensor {src.name} could not be read ({' '.join(str(e).split())})"
                         ) from e
    if tuple(x.shape) != tuple(reader.shape(src.name)):
        raise InputError(f"{_where(plan, src)}: tensor {src.name} has shape {list(x.shape)}, its header says "
                         f"{list(reader.shape(src.name))}")
    if not all_finite(x):
        bad = int((~torch.isfinite(x)).sum())
        msg = f"{_where(plan, src)}: tensor {src.name} has {bad} non-finite value(s) (NaN or Inf)"
        if not allow_nonfinite:
            raise InputError(msg + "; fix the input or pass --allow-nonfinite to merge anyway")
        if warn:
            warn(msg + " (kept: --allow-nonfinite)")
    return x


# ---- ops: one function per plan op; `read` returns one input tensor, each dropped after its use ----
Read = Callable[[Source], torch.Tensor]


def _stack(t: TensorOp, read: Read) -> torch.Tensor:  # out [E, *shape]: slot e from source e
    out = torch.empty(t.shape, dtype=t.dtype)
    last_use = {s: e for e, s in enumerate(t.sources)}
    held: dict[Source, torch.Tensor] = {}  # a source used by several slots (the seed's FFN copies)
    for e, s in enumerate(t.sources):
        x = held.pop(s) if s in held else read(s)
        out[e].copy_(x)
        if last_use[s] > e:
            held[s] = x
        del x
    return out


def _mean(t: TensorOp, read: Read) -> torch.Tensor:  # sum_i w_i x_i, accumulated in float32
    acc = None
    for w, s in zip(t.weights, t.sources):
        x = read(s)
        if acc is None:
            acc = x.to(torch.float32) * w  # a new tensor: the reader's is never modified
        else:
            acc.add_(x, alpha=w)  # promotes x to float32 element by element, no temporary copy
        del x
    return acc.to(t.dtype)


def _copy(t: TensorOp, read: Read) -> torch.Tensor:
    return read(t.sources[0]).to(t.dtype)


def _normal(t: TensorOp, read: Read) -> torch.Tensor:  # generator seeded per tensor (plan.router_rng_seed)
    gen = torch.Generator().manual_seed(t.rng_seed)
    return (torch.randn(t.shape, generator=gen, dtype=torch.float32) * t.std).to(t.dtype)


def _zeros(t: TensorOp, read: Read) -> torch.Tensor:
    return torch.zeros(t.shape, dtype=t.dtype)


OP_TABLE: dict[str, Callable[[TensorOp, Read], torch.Tensor]] = {
    "stack": _stack, "mean": _mean, "copy": _copy, "normal": _normal, "zeros": _zeros}


def run_op(t: TensorOp, read: Read) -> torch.Tensor:
    """Compute one output tensor."""
    if t.op not in OP_TABLE:
        raise ValueError(f"{t.name}: unknown op {t.op!r}; the ops are {', '.join(OP_TABLE)}")
    out = OP_TABLE[t.op](t, read)
    if tuple(out.shape) != t.shape or out.dtype != t.dtype:
        raise AssertionError(f"{t.name}: op {t.op} made {tuple(out.shape)} {out.dtype}, planned {t.shape} {t.dtype}")
    return out


# ---- provenance ----------------------------------------------------------------------------------
def input_files(reader: Any) -> list[Path]:
    files = getattr(reader, "files", None)
    return [Path(f).resolve() for f in files()] if callable(files) else []


def provenance(plan: Plan, digests: dict[Path, str] | None) -> dict[str, Any]:
    """The provenance record; digests maps each input file to its sha256 (None: not hashed)."""
    inputs = []
    for inp in plan.inputs:
        files = [{"name": f.name, "bytes": f.stat().st_size,
                  "sha256": digests.get(f) if digests is not None else None} for f in input_files(inp.reader)]
        inputs.append({"index": inp.index, "role": inp.role, "path": inp.label,
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
    record = provenance(plan, digests) if record is None else record
    return {"format": FORMAT, CONFIG_KEY: plan.config.to_json(),
            PROVENANCE_KEY: json.dumps(record, separators=(",", ":"), sort_keys=True)}


class InputHasher:
    """sha256 of every input file, computed in background threads (hashlib releases the GIL)."""

    def __init__(self, files: list[Path], workers: int = 4):
        self.files = list(dict.fromkeys(files))
        self._cancel = threading.Event()
        # half the cores at most: the merge itself needs the others
        workers = max(1, min(workers, len(self.files), (os.cpu_count() or 2) // 2))
        self._pool = ThreadPoolExecutor(max_workers=workers,
                                        thread_name_prefix="bam-hash")
        self._futures = {f: self._pool.submit(self._hash, f) for f in self.files}

    def _hash(self, path: Path) -> str:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(_HASH_CHUNK):
                if self._cancel.is_set():
                    raise RuntimeError("cancelled")
                h.update(chunk)
        return h.hexdigest()

    def result(self) -> dict[Path, str]:
        try:
            return {f: fut.result() for f, fut in self._futures.items()}
        except OSError as e:
            raise InputError(f"{e.filename}: could not be read for hashing ({e.strerror})") from e
        finally:
            self._pool.shutdown(wait=True)

    def cancel(self) -> None:
        self._cancel.set()
        self._pool.shutdown(wait=True, cancel_futures=True)


class PlanReader:
    """A plan seen as a checkpoint reader: .config, .names(), .shape(), .dtype(), .get(), .metadata.

    get(name) executes that tensor's op on demand (reading its inputs), so an exporter can write
    any format straight from the inputs. .metadata carries the provenance, with the inputs' sha256:
    the first access hashes every input file (a full read of the inputs; pass hash_inputs=False to
    leave the digests out).
    """

    def __init__(self, plan: Plan, allow_nonfinite: bool | None = None, warn: Warn | None = None,
                 hash_inputs: bool = True):
        self.plan = plan
        self.config = plan.config
        self.path = None
        self.allow_nonfinite = plan.options.allow_nonfinite if allow_nonfinite is None else allow_nonfinite
        self.warn = warn
        self.hash_inputs = hash_inputs
        self._metadata: dict[str, str] | None = None

    def names(self) -> list[str]:
        return [t.name for t in self.plan.tensors]

    def __contains__(self, name: str) -> bool:
        try:
            self.plan[name]
        except KeyError:
            return False
        return True

    def shape(self, name: str) -> tuple[int, ...]:
        return self.plan[name].shape

    def dtype(self, name: str) -> torch.dtype:
        return self.plan[name].dtype

    def get(self, name: str) -> torch.Tensor:
        return run_op(self.plan[name], lambda s: read_source(self.plan, s, self.allow_nonfinite, self.warn))

    @property
    def metadata(self) -> dict[str, str]:
        if self._metadata is None:
            digests = None
            if self.hash_inputs:
                digests = InputHasher([f for i in self.plan.inputs for f in input_files(i.reader)]).result()
            self._metadata = output_metadata(self.plan, digests)
        return self._metadata

    def close(self) -> None:
        pass


# ---- branch check --------------------------------------------------------------------------------
def sampled_names(cfg) -> list[str]:
    """A few matrices spread over depth and over attention/FFN: enough to tell a branch from a stranger."""
    L = cfg.n_layers
    return list(dict.fromkeys(["layers.0.attn.q.weight", f"layers.{L // 2}.attn.o.weight",
                               f"layers.{L // 2}.ffn.down.weight", f"layers.{L - 1}.ffn.up.weight"]))


_SAMPLED_ROWS = 256  # rows per sampled matrix that enter the distance (evenly spaced)


def _rows(x: torch.Tensor) -> torch.Tensor:
    step = max(1, x.shape[0] // _SAMPLED_ROWS)
    return x[::step].to(torch.float32)


def distances_to_seed(plan: Plan) -> dict[int, float]:
    """Relative distance sqrt(sum ||W_e - W_s||^2 / sum ||W_s||^2) of each expert input to the seed,
    over evenly spaced rows of sampled_names (reads those few tensors of each input; the merge reads
    them again from the page cache)."""
    if len(plan.inputs) < 2:
        return {}
    allow = plan.options.allow_nonfinite
    seed_sq = 0.0
    diff_sq = {inp.index: 0.0 for inp in plan.inputs[1:]}
    for name in sampled_names(plan.dense_config):
        s = _rows(read_source(plan, Source(0, name), allow))
        seed_sq += float(s.square().sum())
        for inp in plan.inputs[1:]:
            x = _rows(read_source(plan, Source(inp.index, name), allow))
            diff_sq[inp.index] += float((x - s).square().sum())
            del x
        del s
    return {i: math.sqrt(d / seed_sq) if seed_sq > 0 else math.inf for i, d in diff_sq.items()}


def check_branches(plan: Plan, warn: Warn, threshold: float = FAR_FROM_SEED) -> dict[int, float]:
    dist = distances_to_seed(plan)
    seed = plan.inputs[0].label
    for i, d in dist.items():
        label = plan.inputs[i].label
        if d > threshold:
            warn(f"{label}: relative distance to the seed {seed} is {d:.3g} (> {threshold} on "
                 f"{len(sampled_names(plan.dense_config))} sampled matrices); it does not look branched "
                 "from this seed, and its experts will not fit the averaged norms and embeddings")
        elif d == 0.0:
            warn(f"{label}: identical to the seed {seed} on the sampled matrices; is it the seed again?")
    return dist


# ---- execute -------------------------------------------------------------------------------------
def _progress(total: int, enabled: bool):
    from tqdm import tqdm
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="merge", file=sys.stderr,
                disable=not enabled, dynamic_ncols=True, leave=False)


# What a directory may hold for --force to replace it: a checkpoint's or an export's own files, nothing else.
_CHECKPOINT_FILES = re.compile(r"^(config\.json|model\.safetensors\.index\.json|.*\.safetensors|"
                               r"generation_config\.json|tokenizer.*|special_tokens_map\.json|.*\.model|"
                               r"vocab\.json|merges\.txt|added_tokens\.json|README\.md|"
                               r"configuration_bam\.py|modeling_bam\.py|blocks_bam\.py)$")


def check_output_path(out: Path, force: bool, inputs: list[tuple[str, Any]]) -> None:
    """Refuse an existing OUT without --force, a directory OUT holding anything but checkpoint files,
    and an OUT that is (or contains) one of the inputs, given as (label, reader) pairs."""
    if out.exists() or out.is_symlink():
        if not force:
            raise BamSurgeryError(f"{out}: already exists; pass --force to replace it")
        if out.is_dir() and not out.is_symlink():
            stray = sorted(p.name for p in out.iterdir() if not (p.is_file() and _CHECKPOINT_FILES.match(p.name)))
            if stray:
                raise BamSurgeryError(f"{out}: is a directory holding more than a checkpoint ({stray[0]}); "
                                      "--force only replaces checkpoints, remove it yourself or pick another OUT")
    resolved = out.resolve()
    for label, reader in inputs:
        for f in input_files(reader) + ([Path(label)] if label else []):
            try:
                same = f.resolve() == resolved or resolved in f.resolve().parents
            except OSError:
                same = False
            if same:
                raise BamSurgeryError(f"{out}: is input {label}; write the output somewhere else")


def plan_inputs(plan: Plan) -> list[tuple[str, Any]]:
    return [(inp.label, inp.reader) for inp in plan.inputs]


def execute_plan(plan: Plan, out: str | os.PathLike, *, force: bool = False, max_shard_bytes: int | None = None,
                 progress: bool = False, warn: Warn | None = None, check_branch: bool = True) -> Path:
    """Run the plan into OUT (file if it ends in .safetensors, else a sharded directory)."""
    out = Path(out)
    warn = warn or (lambda msg: print(f"bam-surgery: warning: {msg}", file=sys.stderr))
    single_file = out.suffix == ".safetensors"
    if single_file and max_shard_bytes:
        raise BamSurgeryError(f"--max-shard-size: {out} is a single .safetensors file; give a directory "
                              "path to write shards")
    check_output_path(out, force, plan_inputs(plan))
    if check_branch:
        check_branches(plan, warn)
    reader = PlanReader(plan, warn=warn, hash_inputs=False)
    hasher = InputHasher([f for i in plan.inputs for f in input_files(i.reader)])
    try:
        with atomic_path(out, is_dir=not single_file) as tmp, _progress(plan.total_bytes, progress) as bar:
            if single_file:
                _write_file(plan, reader, tmp, hasher, bar)
            else:
                _write_dir(plan, reader, tmp, hasher, bar, max_shard_bytes)
    except BaseException:
        hasher.cancel()
        raise
    return out


def _placeholders(files: list[Path]) -> dict[Path, str]:
    # 64 characters, like a hex sha256, so swapping in the digest keeps the header's length (a sharded
    # input's manifest digest, computed from these, is 64 hex characters too)
    return {f: f"sha256-pending-{k:06d}".ljust(64, "-") for k, f in enumerate(files)}


def _write_file(plan: Plan, reader: PlanReader, path: Path, hasher: InputHasher, bar) -> None:
    pending = provenance(plan, _placeholders(hasher.files))
    entries = [(t.name, t.shape, t.dtype) for t in plan.tensors]
    with SafetensorsStreamWriter(path, entries, output_metadata(plan, None, pending)) as writer:
        for name, x in iter_tensors(reader, [t.name for t in plan.tensors]):
            writer.write(name, x)
            del x
            bar.update(plan[name].nbytes)
    final = provenance(plan, hasher.result())
    changes = {}
    for before, after in zip(pending["inputs"], final["inputs"]):
        pairs = [(before["sha256"], after["sha256"])]
        pairs += [(a["sha256"], b["sha256"]) for a, b in zip(before["files"], after["files"])]
        changes.update((a, b) for a, b in pairs if a is not None)  # None: a reader without files()
    _patch_header(path, changes)


def _patch_header(path: Path, replace: dict[str, str]) -> None:
    """Overwrite same-length placeholders in a safetensors header in place."""
    with open(path, "r+b") as f:
        n = int.from_bytes(f.read(8), "little")
        header = f.read(n)
        for old, new in replace.items():
            old_b, new_b = old.encode(), new.encode()
            if len(old_b) != len(new_b) or header.count(old_b) < 1:  # once per input naming the file
                raise AssertionError(f"{path}: cannot patch header placeholder {old}")
            header = header.replace(old_b, new_b)
        f.seek(8)
        f.write(header)
        f.flush()
        os.fsync(f.fileno())


def _write_dir(plan: Plan, reader: PlanReader, directory: Path, hasher: InputHasher, bar,
               max_shard_bytes: int | None) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    entries = [(t.name, t.shape, t.dtype) for t in plan.tensors]
    shards = plan_shards(entries, max_shard_bytes)
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards):
        fname = shard_name(i, len(shards))
        with SafetensorsStreamWriter(directory / fname, shard, {"format": FORMAT}) as writer:
            for name, x in iter_tensors(reader, [e[0] for e in shard]):
                writer.write(name, x)
                del x
                weight_map[name] = fname
                bar.update(plan[name].nbytes)
    write_index(directory, weight_map, plan.total_bytes, output_metadata(plan, hasher.result()))
    write_dir_config(directory, plan.config)
