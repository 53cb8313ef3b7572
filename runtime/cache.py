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
from typing import Callable, Mapping, Sequence

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
        _write_folder(folder, texts, where)
    return [folder / n for n in texts]


def cached_build(directory: str, key: str, names: Sequence[str], build: Callable[[], Mapping[str, str] | str],
                 where: str) -> list[Path] | str:
    """The files `names` of the folder cache_root() / directory / KEY, where KEY is a digest of everything `build`
    computes them from (the caller's inputs and code): `build()` runs only when the folder is missing, and its
    {file name: text} is written as cached_texts writes (once, atomically). A str from `build` (why there are no
    files) is returned as it is and nothing is written."""
    folder = cache_root() / directory / key
    if all((folder / n).is_file() for n in names):
        return [folder / n for n in names]
    texts = build()
    if isinstance(texts, str):
        return texts
    _write_folder(folder, texts, where)
    return [folder / n for n in texts]


def _write_folder(folder: Path, texts: Mapping[str, str], where: str) -> None:
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
