"""Where the tool keeps what it can rebuild: $BAM_SURGERY_CACHE, else ~/.cache/bam-surgery.

    cache_root() / "tokens"            tokenized data (train/tokenize.py)
    cache_root() / "gguf-tokenizers"   tokenizer files rebuilt from GGUF metadata (converters/gguf_tokenizer.py)
"""
from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    root = os.environ.get("BAM_SURGERY_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "bam-surgery"
