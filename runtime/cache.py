"""Where the tool keeps what it can rebuild: $BAM_SURGERY_CACHE, else ~/.cache/bam-surgery.

    cache_root() / "tokens"            tokenized data (train/tokenize.py)
    cache_root() / "gguf-tokenizers"   tokenizer files rebuilt from GGUF metadata (converters/gguf_tokenizer.py)
    cache_root() / "side-files"        the side files a single-file canonical checkpoint carries in its metadata
                                       (runtime/checkpoint.py)
"""
from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import Mapping

from .errors import CheckpointError


def cache_root() -> Path:
    root = os.environ.get("BAM_SURGERY_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "bam-surgery"


def cached_texts(directory: str, texts: Mapping[str, str], where: str) -> list[Path]:
    """`texts` {file name: text} as files of one content-addressed folder cache_root() / directory / DIGEST,
    written once, atomically (a folder renamed into place; another process writing the same files first wins);
    the paths, in `texts`' order. A cache that cannot be written is one CheckpointError naming `where`."""
    digest = hashlib.sha256()
    for name in sorted(texts):
        digest.update(name.encode() + b"\0" + texts[name].encode() + b"\0")
    folder = cache_root() / directory / digest.hexdigest()[:32]
    if not all((folder / n).is_file() for n in texts):
        try:
            folder.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=folder.parent))
            for name, text in texts.items():
                (tmp / name).write_text(text, encoding="utf-8")
            try:
                os.rename(tmp, folder)
            except OSError:  # another process wrote the same files first
                for name in texts:
                    (tmp / name).unlink()
                tmp.rmdir()
        except OSError as e:
            raise CheckpointError(f"{where}: cannot write its side files under {folder.parent} "
                                  f"({e.strerror or e}; set BAM_SURGERY_CACHE to a writable folder)") from None
    return [folder / n for n in texts]
