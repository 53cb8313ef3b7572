"""Where the tool keeps what it can rebuild: $BAM_SURGERY_CACHE, else ~/.cache/bam-surgery.

    cache_root() / "tokens"            tokenized data (train/tokenize.py)
    cache_root() / "gguf-tokenizers"   tokenizer files rebuilt from GGUF metadata (converters/gguf_tokenizer.py)
    cache_root() / "side-files"        the side files a single-file canonical checkpoint carries in its metadata
                                       (runtime/checkpoint.py)

The rebuilt files (`cached_build`, `cached_texts`) go into one folder per entry, cache_root() / DIRECTORY / KEY,
and are trusted only by this rule (docs/safety.md, "The tokenizer cache"), checked on every use:

  the folder   cache_root() / DIRECTORY is the user's own (created 0700; owned by the effective user, and
               made 0700 again if it is not), and no folder above it (resolved) lets another user replace it:
               each is the user's or root's, writable by no one else unless sticky (/tmp);
  an entry     KEY is a folder, not a link, the user's own, 0700, holding regular files (never a link followed:
               each opened with O_NOFOLLOW below the folder's descriptor) owned by the user, and a DIGEST file
               whose sha256 of the files (names and bytes) matches what they hold now.

An entry that fails its check (a file missing or changed, a link, another owner: a partial write, a planted
entry) is rebuilt and swapped in for it, never used and never fatal. A folder that is not trusted (another
user's cache, a shared folder anyone can write) is not written to: the files are built into a private
temporary folder of this process instead (removed when it exits), and `untrusted_cache` says why, for the caller's
note. Entries are written privately and atomically: a 0700 temporary folder in DIRECTORY, renamed into place.
"""
from __future__ import annotations

import atexit
import hashlib
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Callable, Mapping, Sequence

from .atomic import rename_exchange
from .errors import CheckpointError, printable

DIGEST = "DIGEST"  # each entry's sha256 of its files, names and bytes
_PRIVATE = 0o700
_TEMP_FOLDERS: list[Path] = []  # private temporary folders of an untrusted cache, removed at exit


def cache_root() -> Path:
    root = os.environ.get("BAM_SURGERY_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "bam-surgery"


def cached_texts(directory: str, texts: Mapping[str, str], where: str) -> list[Path]:
    """`texts` {file name: text} as files of one content-addressed entry cache_root() / directory / DIGEST (the
    trust rule of the module docstring); the paths, in `texts`' order. A cache that cannot be written is one
    CheckpointError naming `where`."""
    digest = hashlib.sha256()
    for name in sorted(texts):
        digest.update(name.encode() + b"\0" + texts[name].encode() + b"\0")
    files = cached_build(directory, digest.hexdigest()[:32], list(texts), lambda: texts, where)
    assert not isinstance(files, str)
    return files


def cached_build(directory: str, key: str, names: Sequence[str], build: Callable[[], Mapping[str, str] | str],
                 where: str) -> list[Path] | str:
    """The files `names` of the entry cache_root() / directory / KEY, where KEY is a digest of everything `build`
    computes them from (the caller's inputs and code): `build()` runs only when there is no trusted entry (the
    module docstring), and its {file name: text} is written as a new entry (or, the cache untrusted, into a private
    temporary folder). A str from `build` (why there are no files) is returned as it is and nothing is written."""
    try:
        folder, problem = _checked_folder(directory)
        if problem is None and _verified(folder, key, names):
            return [folder / key / n for n in names]
    except OSError as e:
        raise _cannot(where, cache_root() / directory, e) from None
    texts = build()
    if isinstance(texts, str):
        return texts
    try:
        if problem is not None:
            return _write_private(texts)
        _write_entry(folder, key, texts)
    except OSError as e:
        raise _cannot(where, folder, e) from None
    return [folder / key / n for n in texts]


def untrusted_cache(directory: str) -> str | None:
    """Why the folder cache_root() / directory is not trusted (the module docstring), or None: it is then the
    user's own and private (created so, made so). A folder that cannot be made is not trusted either."""
    try:
        return _checked_folder(directory)[1]
    except OSError as e:
        return f"{printable(cache_root() / directory)} cannot be made ({e.strerror or e})"


def _checked_folder(directory: str) -> tuple[Path, str | None]:
    """(the folder cache_root() / directory, resolved; why it is not trusted, or None), created if missing."""
    folder = cache_root() / directory
    _make_private_folders(folder)
    real = Path(os.path.realpath(folder))
    uid = os.geteuid()
    fd = os.open(real, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if st.st_uid != uid:
            return real, f"{printable(folder)} belongs to user {st.st_uid}, not to this user ({uid})"
        if stat.S_IMODE(st.st_mode) != _PRIVATE:
            os.fchmod(fd, _PRIVATE)  # ours, made private again (a cache from before this rule was 0755)
    finally:
        os.close(fd)
    for parent in real.parents:
        st = os.lstat(parent)
        if st.st_uid not in (uid, 0):
            return real, f"{printable(parent)}, a folder above it, belongs to user {st.st_uid}"
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            return real, f"{printable(parent)}, a folder above it, is writable by other users"
    return real, None


def _make_private_folders(folder: Path) -> None:
    """`folder` and the missing folders above it, each created 0700."""
    missing = []
    for p in (folder, *folder.parents):
        if os.path.lexists(p):
            break
        missing.append(p)
    for p in reversed(missing):
        try:
            os.mkdir(p, _PRIVATE)
        except FileExistsError:  # another process made it meanwhile
            pass


def _verified(folder: Path, key: str, names: Sequence[str]) -> bool:
    """Whether the entry folder / key exists and passes the module docstring's check, read through descriptors
    that never follow a link."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
    uid = os.geteuid()
    try:
        top = os.open(folder, flags | os.O_DIRECTORY)
    except OSError:
        return False
    try:
        entry = os.open(key, flags | os.O_DIRECTORY, dir_fd=top)
    except OSError:  # absent, or a link (ELOOP), or not a folder
        os.close(top)
        return False
    try:
        st = os.fstat(entry)
        if st.st_uid != uid or stat.S_IMODE(st.st_mode) != _PRIVATE:
            return False
        contents = {}
        for name in (*names, DIGEST):
            data = _read_own(entry, name, flags, uid)
            if data is None:
                return False
            contents[name] = data
        return contents.pop(DIGEST).decode("ascii", "replace").strip() == _digest(contents)
    finally:
        os.close(entry)
        os.close(top)


def _read_own(entry: int, name: str, flags: int, uid: int) -> bytes | None:
    """The bytes of the regular file `name` of the entry's descriptor, owned by `uid`; None for anything else."""
    try:
        fd = os.open(name, flags | os.O_NONBLOCK, dir_fd=entry)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != uid:
            return None
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read()
    finally:
        os.close(fd)


def _digest(contents: Mapping[str, bytes]) -> str:
    digest = hashlib.sha256()
    for name in sorted(contents):
        data = contents[name]
        digest.update(name.encode() + b"\0" + str(len(data)).encode() + b"\0")
        digest.update(data)
    return digest.hexdigest()


def _fill(folder: Path, texts: Mapping[str, str]) -> None:
    """The files of `texts` and their DIGEST, written into the private folder `folder`."""
    contents = {name: text.encode("utf-8") for name, text in texts.items()}
    for name, data in contents.items():
        (folder / name).write_bytes(data)
    (folder / DIGEST).write_text(_digest(contents) + "\n", encoding="ascii")


def _write_entry(folder: Path, key: str, texts: Mapping[str, str]) -> None:
    """A new entry folder / key: written into a private temporary folder beside it and renamed into place; an entry
    already there that fails its check (a partial or a planted one) is swapped out for it and removed, one that
    passes (another process wrote the same files first) is kept."""
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=folder))  # 0700
    try:
        _fill(tmp, texts)
        entry = folder / key
        try:
            os.rename(tmp, entry)
            return
        except OSError:  # something is there: a good entry another process wrote, or a bad one
            if _verified(folder, key, list(texts)):
                return
        if not rename_exchange(tmp, entry):
            stale = Path(tempfile.mkdtemp(prefix=".stale-", dir=folder))
            os.rename(entry, stale / "entry")
            os.rename(tmp, entry)
            tmp = stale
    finally:
        _remove(tmp)


def _remove(path: Path) -> None:
    """A temporary or swapped-out entry of the private cache folder, never following a link inside it."""
    if os.path.islink(path) or not os.path.isdir(path):
        if os.path.lexists(path):
            os.unlink(path)
        return
    shutil.rmtree(path, ignore_errors=True)


def _write_private(texts: Mapping[str, str]) -> list[Path]:
    """`texts` in a private temporary folder of this process (an untrusted cache is not written to)."""
    tmp = Path(tempfile.mkdtemp(prefix="bam-surgery-rebuilt-"))
    if not _TEMP_FOLDERS:
        atexit.register(lambda: [shutil.rmtree(p, ignore_errors=True) for p in _TEMP_FOLDERS])
    _TEMP_FOLDERS.append(tmp)
    _fill(tmp, texts)
    return [tmp / n for n in texts]


def _cannot(where: str, folder: Path, e: OSError) -> CheckpointError:
    return CheckpointError(f"{where}: cannot write its side files under {folder} ({e.strerror or e}; set "
                           "BAM_SURGERY_CACHE to a writable folder)")
