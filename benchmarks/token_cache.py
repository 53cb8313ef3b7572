"""What the token cache's verification costs beside the tokenization it saves (train/tokenize.py; docs/safety.md,
"The caches"), on the repository's domain corpus.

    .venv/bin/python -m benchmarks.token_cache --tokenizer bytes
    .venv/bin/python -m benchmarks.token_cache --tokenizer SmolLM2-135M-Instruct.Q4_1.gguf   # its tokenizer rebuilt
    .venv/bin/python -m benchmarks.token_cache --tokenizer PATH/tokenizer.json --repeat 5 --copies 8

For each domain of data/domains/ (its train split, or the split --copies times over: a larger corpus), the median
over --repeat runs, each in a fresh cache folder (under --work-dir, removed at the end):
  tokenize  tokenize_source into the empty cache: read the text, tokenize it, write tokens.bin and tokens.json,
            DIGEST them, rename the entry into place (what a first train or eval on the data costs)
  lookup    tokenize_source again: the key (a sha256 of the data files and the tokenizer), the folder's and the
            entry's checks, the BLAKE3 verification of the entry, the memory map (what every later use costs)
  verify    the verification alone (the entry's files DIGESTed again and compared; runtime/cache.py)
and tokenize / verify, the share of tokenizing the verification costs. The byte tokenizer is the fastest there is
(a NumPy view of the UTF-8 bytes): its ratio is the least any tokenizer gives.
"""
from __future__ import annotations

import argparse
import gzip
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from bam_surgery.runtime import cache
from bam_surgery.train.data import Domain, open_source
from bam_surgery.train.tokenize import ENTRY_FILES, ByteTokenizer, HFTokenizer, tokenize_source

ROOT = Path(__file__).resolve().parents[1]
DOMAINS = ("code", "general", "law", "math")


def tokenizer(spec: str):
    if spec == "bytes":
        return ByteTokenizer()
    path = Path(spec)
    if path.suffix == ".gguf":  # its tokenizer rebuilt from the metadata, as every command does
        from bam_surgery.converters import open_checkpoint
        with open_checkpoint(path) as reader:
            path = next(f for f in reader.tokenizer_files() if f.name == "tokenizer.json")
    return HFTokenizer(path / "tokenizer.json" if path.is_dir() else path)


def corpus_file(domain: str, copies: int, work: Path) -> Path:
    """The domain's train split, as one .txt of `copies` copies (the split itself when 1)."""
    split = ROOT / "data" / "domains" / domain / "train.txt.gz"
    if copies == 1:
        return split
    text = gzip.decompress(split.read_bytes())
    out = work / f"{domain}-x{copies}.txt"
    with open(out, "wb") as f:
        for _ in range(copies):
            f.write(text)
    return out


def verify(tf) -> float:
    t = time.perf_counter()
    folder, key = tf.path.parent.parent, tf.path.parent.name
    assert cache._verified(folder, key, ENTRY_FILES)
    return time.perf_counter() - t


def measure(domain: str, tok, copies: int, repeat: int, work: Path) -> dict:
    data = corpus_file(domain, copies, work)
    times: dict[str, list[float]] = {"tokenize": [], "lookup": [], "verify": []}
    for r in range(repeat):
        folder = work / f"cache-{domain}-{r}"
        source = open_source(Domain(domain, str(data), 1.0), "train")
        t = time.perf_counter()
        tf = tokenize_source(source, tok, folder)
        times["tokenize"].append(time.perf_counter() - t)
        t = time.perf_counter()
        again = tokenize_source(open_source(Domain(domain, str(data), 1.0), "train"), tok, folder)
        times["lookup"].append(time.perf_counter() - t)
        assert again.path == tf.path and again.path.stat().st_mtime_ns == tf.path.stat().st_mtime_ns  # not rebuilt
        times["verify"].append(verify(tf))
        text_bytes = sum(len(d.encode()) for d in source.documents())
        entry_bytes = tf.path.stat().st_size
        shutil.rmtree(folder)
    med = {k: statistics.median(v) for k, v in times.items()}
    return dict(domain=domain, text_mb=text_bytes / 1e6, entry_mb=entry_bytes / 1e6, tokens=entry_bytes // 2, **med)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", default="bytes", help="bytes, a tokenizer.json (or its folder), or a GGUF file")
    ap.add_argument("--copies", type=int, default=1, help="each split this many times over (a larger corpus)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--domains", default=",".join(DOMAINS))
    ap.add_argument("--work-dir", default=None, help="where the caches go (default: a temporary folder)")
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench-token-cache-", dir=args.work_dir))
    os.environ["BAM_SURGERY_CACHE"] = str(work / "cache")  # a GGUF's rebuilt tokenizer, kept out of the user's
    try:
        tok = tokenizer(args.tokenizer)
        print(f"tokenizer {tok.name}, {args.copies} cop{'y' if args.copies == 1 else 'ies'} of each split, "
              f"median of {args.repeat}")
        print(f"{'domain':<8} {'text MB':>8} {'entry MB':>9} {'tokenize s':>11} {'lookup s':>9} {'verify s':>9} "
              f"{'verify GB/s':>12} {'tokenize/verify':>16} {'tokenize/lookup':>16}")
        for domain in args.domains.split(","):
            m = measure(domain, tok, args.copies, args.repeat, work)
            print(f"{domain:<8} {m['text_mb']:>8.2f} {m['entry_mb']:>9.2f} {m['tokenize']:>11.3f} "
                  f"{m['lookup']:>9.4f} {m['verify']:>9.4f} {m['entry_mb'] / 1e3 / m['verify']:>12.2f} "
                  f"{m['tokenize'] / m['verify']:>16.0f} {m['tokenize'] / m['lookup']:>16.0f}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
