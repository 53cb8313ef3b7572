"""Where the tool keeps what it can rebuild, and the one rule by which it trusts what it finds there.

    cache_root()        $BAM_SURGERY_CACHE, else ~/.cache/bam-surgery
    / "tokens"          tokenized data (train/tokenize.py; or the folder --token-cache names)
    / "gguf-tokenizers" tokenizer files rebuilt from GGUF metadata (converters/gguf_tokenizer.py)
    / "side-files"      the side files a single-file canonical checkpoint carries in its metadata
                        (runtime/checkpoint.py)
    / "input-digests"   the merge's BLAKE3 digests of its input files, for the provenance (surgery/digests.py)

Everything cached is an entry: one folder per entry, FOLDER / KEY, holding the entry's files and a DIGEST of them
(`cached_files`, `cached_build`, `cached_texts` build one when none is trusted; `find_entry` only looks;
`replace_entry` writes a new version of a mutable one). FOLDER is cache_root() / DIRECTORY, or a folder the user
named (an absolute path: --token-cache). An entry is trusted only by this rule (docs/safety.md, "The caches"),
checked on every use:

  the folder   FOLDER is the user's own (created 0700; owned by the effective user, and made 0700 again if it is
               not), and no folder above it (resolved) lets another user replace it: each is the user's or root's,
               writable by no one else unless sticky (/tmp);
  an entry     KEY is a folder, not a link, the user's own, 0700, holding regular files (never a link followed:
               each opened with O_NOFOLLOW below the folder's descriptor) owned by the user, and a DIGEST file whose
               BLAKE3 of the files (names, sizes and bytes, streamed: time linear in their size, memory bounded)
               matches what they hold now; and whatever the caller checks beyond that (`usable`).

An entry that fails its check (a file missing or changed, a link, another owner: a partial write, a planted
entry) is rebuilt and swapped in for it, never used and never fatal. A folder that is not trusted (another
user's cache, a shared folder anyone can write) is not written to: the files are built into a private
temporary folder of this process instead (removed when it exits), and `untrusted_cache` says why, for the caller's
note. Entries are written privately and atomically: a 0700 temporary folder in FOLDER, renamed into place.
"""
from __future__ import annotations

import atexit
import hashlib
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

import blake3

from .atomic import rename_exchange
from .errors import CheckpointError, printable

DIGEST = "DIGEST"  # each entry's BLAKE3 of its files: names, sizes and bytes
_PRIVATE = 0o700
_CHUNK = 16 << 20  # bytes hashed at a time
_DIGEST_BYTES = 256  # a DIGEST file holds 64 hex digits and a newline; more is not a DIGEST of ours
_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
_TEMP_FOLDERS: list[Path] = []  # private temporary folders of an untrusted cache, removed at exit

Write = Callable[[Path], "str | None"]  # fills a private folder with the entry's files; a str: why there are none
Usable = Callable[[list[Path]], bool]  # the caller's check of a verified entry's files


def cache_root() -> Path:
    root = os.environ.get("BAM_SURGERY_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "bam-surgery"


def cache_folder(directory: str | Path) -> Path:
    """The folder of a cache: cache_root() / directory, or `directory` itself when it is an absolute path."""
    return Path(directory) if Path(directory).is_absolute() else cache_root() / directory


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
    """The text files `names` of the entry cache_root() / directory / KEY, where KEY is a digest of everything
    `build` computes them from (the caller's inputs and code): `build()` runs only when there is no trusted entry,
    and its {file name: text} (the files `names`) is the new entry (`cached_files`). A str from `build` (why there
    are no files) is returned as it is and nothing is kept."""
    def write(folder: Path) -> str | None:
        texts = build()
        if isinstance(texts, str):
            return texts
        for name in names:
            (folder / name).write_bytes(texts[name].encode("utf-8"))
        return None
    return cached_files(directory, key, names, write, where)


def cached_files(directory: str | Path, key: str, names: Sequence[str], write: Write, where: str, *,
                 usable: Usable | None = None, hint: str = "set BAM_SURGERY_CACHE to a writable folder"
                 ) -> list[Path] | str:
    """The files `names` of the entry cache_folder(directory) / KEY, KEY a digest of everything they are computed
    from: the trusted entry if there is one (the module docstring; `usable`, given the verified files, checks
    their content too), else `write(folder)` fills a new private folder with them, which becomes the entry (or,
    the cache untrusted, stays a private temporary folder of this process). A str from `write` (why there are
    no files) is returned as it is and nothing is kept; whatever `write` raises leaves nothing either. A cache
    that cannot be written is one CheckpointError naming `where` and the folder, ending with `hint`."""
    folder = cache_folder(directory)
    try:
        real, problem = _checked_folder(folder)
        if problem is None:
            if (found := _trusted(real, key, names, usable)) is not None:
                return found
            why = _new_entry(real, key, names, write, lambda: _trusted(real, key, names, usable) is not None)
            return why if why is not None else [real / key / n for n in names]
        tmp = _private_folder(None)
        try:
            why = write(tmp)
        except BaseException:
            _remove(tmp)
            raise
        if why is not None:
            _remove(tmp)
            return why
        return [tmp / n for n in names]
    except OSError as e:
        raise _cannot(where, folder, e, hint) from None


def find_entry(directory: str | Path, key: str, names: Sequence[str], usable: Usable | None = None
               ) -> list[Path] | None:
    """The files `names` of the trusted entry cache_folder(directory) / KEY (the module docstring), or None: none
    there, one that fails its check, a folder not trusted, or one that cannot be read or made."""
    try:
        real, problem = _checked_folder(cache_folder(directory), create=False)
        return _trusted(real, key, names, usable) if problem is None else None
    except OSError:  # no such folder among them
        return None


def replace_entry(directory: str | Path, key: str, names: Sequence[str], write: Write) -> bool:
    """A new version of the mutable entry cache_folder(directory) / KEY: `write(folder)` fills a private folder
    with the files `names`, swapped in for whatever entry is there. False, with nothing written, where the folder
    is not trusted or the entry cannot be written (a cache that only misses: the caller goes on)."""
    try:
        real, problem = _checked_folder(cache_folder(directory))
        return problem is None and _new_entry(real, key, names, write, lambda: False) is None
    except OSError:
        return False


def untrusted_cache(directory: str | Path) -> str | None:
    """Why the folder cache_folder(directory) is not trusted (the module docstring), for the caller's note, or
    None: it is the user's own and private (created so, made so), or it cannot be made at all (`cached_files`
    then refuses in one line, which is what the user needs to hear, not a note)."""
    try:
        return _checked_folder(cache_folder(directory))[1]
    except OSError:
        return None


def _checked_folder(folder: Path, create: bool = True) -> tuple[Path, str | None]:
    """(the folder, resolved; why it is not trusted, or None), created if missing (else FileNotFoundError)."""
    if create:
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


def _trusted(folder: Path, key: str, names: Sequence[str], usable: Usable | None) -> list[Path] | None:
    """The files of the entry folder / key if it passes the module docstring's check, else None."""
    if not _verified(folder, key, names):
        return None
    files = [folder / key / n for n in names]
    return files if usable is None or usable(files) else None


def _verified(folder: Path, key: str, names: Sequence[str]) -> bool:
    """Whether the entry folder / key exists and passes the module docstring's check, read through descriptors
    that never follow a link."""
    uid = os.geteuid()
    try:
        top = os.open(folder, _FLAGS | os.O_DIRECTORY)
    except OSError:
        return False
    try:
        entry = os.open(key, _FLAGS | os.O_DIRECTORY, dir_fd=top)
    except OSError:  # absent, or a link (ELOOP), or not a folder
        os.close(top)
        return False
    try:
        st = os.fstat(entry)
        if st.st_uid != uid or stat.S_IMODE(st.st_mode) != _PRIVATE:
            return False
        stored = _small_file(entry, DIGEST, uid)
        return stored is not None and stored.decode("ascii", "replace").strip() == _entry_digest(entry, names, uid)
    finally:
        os.close(entry)
        os.close(top)


def _open_own(entry: int, name: str, uid: int) -> int | None:
    """A descriptor of the regular file `name` below the folder descriptor `entry`, owned by `uid`, opened without
    following a link; None for anything else (the caller closes it)."""
    try:
        fd = os.open(name, _FLAGS | os.O_NONBLOCK, dir_fd=entry)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and st.st_uid == uid:
            return fd
    except OSError:
        pass
    os.close(fd)
    return None


def _small_file(entry: int, name: str, uid: int) -> bytes | None:
    """The bytes of a DIGEST file (_open_own), or None: not one of ours, or larger than a DIGEST is."""
    fd = _open_own(entry, name, uid)
    if fd is None:
        return None
    with os.fdopen(fd, "rb", buffering=0) as f:
        data = f.read(_DIGEST_BYTES + 1)
    return data if len(data) <= _DIGEST_BYTES else None


class _Digest:
    """An entry's digest: BLAKE3 over its files in name order, each as its name, its size and its bytes."""

    def __init__(self):
        self._h = blake3.blake3(max_threads=blake3.blake3.AUTO)

    def file(self, name: str, size: int, chunks: Iterable[bytes | memoryview]) -> bool:
        """One file, in name order; False if its chunks do not add up to `size` (it changed while read)."""
        self._h.update(name.encode("utf-8", "surrogateescape") + b"\0" + str(size).encode() + b"\0")
        n = 0
        for chunk in chunks:
            self._h.update(chunk)
            n += len(chunk)
        return n == size

    def hex(self) -> str:
        return self._h.hexdigest()


def _digest(contents: Mapping[str, bytes]) -> str:
    """The DIGEST of files given as {name: bytes} (what an entry of these files holds)."""
    d = _Digest()
    for name in sorted(contents):
        d.file(name, len(contents[name]), [contents[name]])
    return d.hex()


def _entry_digest(entry: int, names: Sequence[str], uid: int) -> str | None:
    """The DIGEST of the files `names` below the folder descriptor `entry`, each read in chunks of _CHUNK bytes
    (time linear in their size, memory bounded); None if one is not a regular file of `uid`'s (_open_own)."""
    d = _Digest()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    for name in sorted(names):
        fd = _open_own(entry, name, uid)
        if fd is None:
            return None
        with os.fdopen(fd, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            if not d.file(name, size, (view[:n] for n in iter(lambda: f.readinto(buf), 0))):
                return None
    return d.hex()


def _private_folder(folder: Path | None) -> Path:
    """A new private (0700) temporary folder: in the cache folder `folder`, whence it is renamed into place as an
    entry; or, for a cache not trusted (None), a folder of this process's own, removed when it exits."""
    if folder is not None:
        return Path(tempfile.mkdtemp(prefix=".tmp-", dir=folder))
    tmp = Path(tempfile.mkdtemp(prefix="bam-surgery-rebuilt-"))
    if not _TEMP_FOLDERS:
        atexit.register(lambda: [shutil.rmtree(p, ignore_errors=True) for p in _TEMP_FOLDERS])
    _TEMP_FOLDERS.append(tmp)
    return tmp


def _new_entry(folder: Path, key: str, names: Sequence[str], write: Write, keep: Callable[[], bool]) -> str | None:
    """`write` into a private folder of the trusted cache folder, sealed and installed as the entry folder / key
    (_install, `keep` deciding over an entry already there); what `write` says instead, with nothing kept."""
    tmp = _private_folder(folder)
    try:
        why = write(tmp)
        if why is None:
            _seal(tmp, names)
            _install(folder, key, tmp, keep)
        return why
    finally:
        _remove(tmp)


def _seal(tmp: Path, names: Sequence[str]) -> None:
    """The DIGEST of the files `names` the private folder `tmp` holds, written beside them."""
    fd = os.open(tmp, _FLAGS | os.O_DIRECTORY)
    try:
        digest = _entry_digest(fd, names, os.geteuid())
    finally:
        os.close(fd)
    if digest is None:
        raise OSError(f"{tmp}: an entry's file is missing or not a regular file")
    (tmp / DIGEST).write_text(digest + "\n", encoding="ascii")


def _install(folder: Path, key: str, tmp: Path, keep: Callable[[], bool]) -> None:
    """The sealed private folder `tmp` renamed into place as the entry folder / key. An entry already there is
    kept if `keep()` (it passes its check: another process wrote the same files first), else (a partial or a
    planted one; a mutable entry's older version) swapped out for it in one rename. `tmp` is left for the caller
    to remove: gone, or holding what was swapped out."""
    entry = folder / key
    try:
        os.rename(tmp, entry)
        return
    except OSError:  # something is there: a good entry another process wrote, or a bad one
        if keep():
            return
    if not rename_exchange(tmp, entry):
        stale = Path(tempfile.mkdtemp(prefix=".stale-", dir=folder))
        os.rename(entry, stale / "entry")
        os.rename(tmp, entry)
        os.rename(stale, tmp)


def _remove(path: Path) -> None:
    """A temporary or swapped-out entry of the private cache folder, never following a link inside it."""
    if os.path.islink(path) or not os.path.isdir(path):
        if os.path.lexists(path):
            os.unlink(path)
        return
    shutil.rmtree(path, ignore_errors=True)


def _cannot(where: str, folder: Path, e: OSError, hint: str) -> CheckpointError:
    return CheckpointError(f"{where}: cannot write the cache under {printable(folder)} ({e.strerror or e}; {hint})")
