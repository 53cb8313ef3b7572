"""The hostile GGUF files of issue 42, and the largest files the reader's bounds let through, each opened by
`bam-surgery inspect` in a child process: wall time, peak RSS (and its anonymous part: the
file-backed rest is the page cache of the file's memory map), exit status and the line it printed.

    .venv/bin/python -m benchmarks.hostile_gguf [--work bench-out/hostile-gguf] [--smoke]

Files (written by this script from a tiny Llama exported here, values placed byte by byte):

  baseline            the tiny Llama as exported (what every other row costs beyond: the interpreter, torch)
  arch-array          general.architecture an array of strings (was a TypeError)
  pre-array           tokenizer.ggml.pre an array (was a TypeError)
  yarn-inf            rope.scaling.original_context_length inf (was an OverflowError)
  a1500, a4096        SentencePiece "a", "aa", ... up to 1,500 / 4,096 a's (were 29 s and 5.0 GB / a MemoryError
                      at 8 GB after 16 s)
  a465                the same, up to 465 a's: the largest the merge derivation's bound takes (built, cached)
  scores-60M          tokenizer.ggml.scores of 60 M floats, 240 MB (was a MemoryError at 6.1 GB)
  floats-256MB        one array of 64 M floats, under the 256 MiB metadata bound
  strings-2M          2,097,152 strings of 118 bytes, 256 MiB: the most array strings the parser decodes
  vocab-512K          a byte-level BPE of 524,288 tokens: the largest vocabulary rebuilt

--smoke writes and opens the small ones only. Timing figures are the machine's: run on a quiet one for records.
"""
from __future__ import annotations

import argparse
import struct
import sys
from pathlib import Path

import numpy as np

from benchmarks.measure import REPO, Step, measure

STRING, ARRAY = 8, 9
FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def gguf_string(s: str | bytes) -> bytes:
    """A GGUF string: its 8-byte length, then its bytes (a str as UTF-8, lone surrogates kept: a hostile file)."""
    b = s.encode("utf-8", "surrogatepass") if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def _value(vtype: int, value, itype: int | None) -> bytes:
    if vtype == STRING:
        return gguf_string(value)
    if vtype == ARRAY:
        head = struct.pack("<IQ", itype, len(value))
        if itype == STRING:
            return head + b"".join(gguf_string(v) for v in value)
        with np.errstate(invalid="ignore", over="ignore"):  # float64 values past float32's range: inf
            return head + np.asarray(value).astype(np.dtype(FORMATS[itype])).tobytes()
    return struct.pack(FORMATS[vtype], value)


def write_gguf(path: Path, fields: dict, tensors: list) -> Path:
    """A GGUF file of `fields` {key: (value type, value, array item type or None)}, in order, any value under any key,
    and `tensors` [(name, numpy array, GGML type)] (their bytes as they are), written byte by byte, 32-byte aligned
    (tests/converters/test_gguf_hostile.py writes its files with it too)."""
    kv = b"".join(gguf_string(k) + struct.pack("<I", t) + _value(t, v, i) for k, (t, v, i) in fields.items())
    infos, data, offset = b"", [], 0
    for name, array, qtype in tensors:
        dims = list(reversed(array.shape))
        infos += gguf_string(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, qtype, offset)
        raw = array.tobytes()
        raw += b"\0" * (-len(raw) % 32)
        data.append(raw)
        offset += len(raw)
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(fields)) + kv + infos
    with open(path, "wb") as f:
        f.write(head + b"\0" * (-len(head) % 32))
        for raw in data:
            f.write(raw)
    return path


def tiny_llama(work: Path) -> tuple[dict, list]:
    """(fields, tensors) of a tiny Llama exported by bam-surgery (byte tokenizer), read back by its own parser."""
    import torch

    from bam_surgery.converters.base import ExportOptions
    from bam_surgery.converters.export import exporter
    from bam_surgery.converters.gguf_file import parse_gguf
    from bam_surgery.runtime.config import ModelConfig
    from bam_surgery.runtime.layout import tensor_shapes
    from bam_surgery.runtime.reader import StateReader

    cfg = ModelConfig(vocab_size=256, d_model=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_hidden=128,
                      max_positions=128, rope_theta=10000.0, norm_eps=1e-6, name="tiny")
    gen = torch.Generator().manual_seed(0)
    state = {n: torch.randn(s, generator=gen) * 0.05 for n, s in tensor_shapes(cfg).items()}
    path = exporter("gguf").write(StateReader(state, cfg), work / "base.gguf", ExportOptions(gguf_dtype="f32"))
    parsed = parse_gguf(path)
    fields = {k: (parsed.types[k][0], v, parsed.types[k][1]) for k, v in parsed.fields.items()}
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    tensors = [(t.name, np.frombuffer(raw[t.start:t.start + t.nbytes], np.float32).reshape(t.shape), 0)
               for t in parsed.tensors]
    return fields, tensors


def with_vocabulary(base: tuple[dict, list], tokens: list[str], spm: bool, scores=None) -> tuple[dict, list]:
    """base with its tokenizer replaced (a SentencePiece or a byte-level BPE of `tokens`) and its embeddings
    resized to match."""
    fields, tensors = base
    fields = {k: v for k, v in fields.items() if not k.startswith("tokenizer.") and k != "llama.vocab_size"}
    n = len(tokens)
    fields.update({"tokenizer.ggml.model": (STRING, "llama" if spm else "gpt2", None),
                   "tokenizer.ggml.tokens": (ARRAY, tokens, STRING),
                   "tokenizer.ggml.token_type": (ARRAY, np.ones(n, np.int32), 5),
                   "tokenizer.ggml.eos_token_id": (4, 0, None)})
    if spm:
        fields["tokenizer.ggml.scores"] = (ARRAY, np.zeros(n, np.float32) if scores is None else scores, 6)
    else:
        fields["tokenizer.ggml.pre"] = (STRING, "gpt-2", None)
        fields["tokenizer.ggml.merges"] = (ARRAY, [], STRING)
    tensors = [(name, np.full((n, a.shape[1]), 0.01, np.float32) if name in ("token_embd.weight", "output.weight")
                else a, qtype) for name, a, qtype in tensors]
    return fields, tensors


def one_array(path: Path, itype: int, n: int, item: bytes) -> Path:
    """A GGUF holding one array of n items of `item`'s bytes (a string of them, or raw numbers)."""
    with open(path, "wb") as f:
        f.write(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + gguf_string("x.a") + struct.pack("<IIQ", ARRAY, itype, n))
        chunk = item * min(n, 1 << 16)
        for start in range(0, n, 1 << 16):
            f.write(chunk if start + (1 << 16) <= n else item * (n - start))
    return path


def files(work: Path, smoke: bool) -> dict[str, Path]:
    base = tiny_llama(work)
    fields, tensors = base
    yarn = {"llama.rope.scaling.type": (STRING, "yarn", None), "llama.rope.scaling.factor": (6, 4.0, None)}
    out = {"baseline": work / "base.gguf",
           "arch-array": write_gguf(work / "arch-array.gguf", {
               **fields, "general.architecture": (ARRAY, ["llama", "x"], STRING)}, tensors),
           "pre-array": write_gguf(work / "pre-array.gguf", {
               **fields, "tokenizer.ggml.pre": (ARRAY, ["gpt-2"], STRING)}, tensors),
           "yarn-inf": write_gguf(work / "yarn-inf.gguf", {
               **fields, **yarn, "llama.rope.scaling.original_context_length": (6, float("inf"), None)}, tensors),
           "a465": write_gguf(work / "a465.gguf", *with_vocabulary(base, ["a" * n for n in range(1, 466)], True))}
    if smoke:
        return out
    for length in (1500, 4096):
        out[f"a{length}"] = write_gguf(work / f"a{length}.gguf",
                                       *with_vocabulary(base, ["a" * n for n in range(1, length + 1)], True))
    out["scores-60M"] = write_gguf(work / "scores-60M.gguf", *with_vocabulary(
        base, [f"<0x{b:02X}>" for b in range(256)], True, scores=np.zeros(60_000_000, np.float32)))
    out["floats-256MB"] = one_array(work / "floats-256MB.gguf", 6, 64_000_000, b"\0\0\0\0")
    out["strings-2M"] = one_array(work / "strings-2M.gguf", STRING, 1 << 21, struct.pack("<Q", 118) + b"x" * 118)
    byte_level = [chr(0x100 + i) for i in range(256)]
    out["vocab-512K"] = write_gguf(work / "vocab-512K.gguf", *with_vocabulary(
        base, byte_level + [f"t{i}" for i in range((1 << 19) - 256)], False))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=REPO / "bench-out" / "hostile-gguf")
    parser.add_argument("--smoke", action="store_true", help="the small files only (a check of the script)")
    args = parser.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    cache = args.work / "cache"
    print(f"{'file':14} {'MB':>7} {'rc':>3} {'wall s':>7} {'peak RSS MB':>12} {'anon MB':>8}  line")
    for name, path in files(args.work, args.smoke).items():
        cmd = ["env", f"BAM_SURGERY_CACHE={cache}", sys.executable, "-m", "bam_surgery", "inspect", str(path)]
        log = args.work / f"{name}.log"
        step = measure(Step("gguf", name, "inspect", cmd, "warm"), [path], log, cold=False)
        lines = log.read_text(errors="replace").splitlines()
        said = next((ln for ln in lines if ln.startswith("bam-surgery: error:") or "tokenizer not rebuilt" in ln),
                    "opened")
        print(f"{name:14} {path.stat().st_size / 2**20:7.1f} {step.rc:3} {step.wall_s:7.2f} {step.peak_rss_mb:12.0f}"
              f" {step.peak_anon_mb:8.0f}  {said.strip()[:110]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
