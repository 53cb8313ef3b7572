"""Atomic outputs: write under a work folder beside the target, rename onto it only on success.

    with atomic_path("out/mix.safetensors", replace=False) as tmp:   # write the file at tmp
        ...
    with atomic_dir("out/mix", replace=True) as tmp:                  # fill the folder tmp
        ...
    write_text_atomic("run/checkpoints/latest", "step-00000005\n")  # a small file a run rewrites

While a run writes OUT, one work folder sits beside it, named after it, so the next run on the
same OUT finds it:

    out/.mix.bam-surgery.partial/        mode 0700, removed at the end
        lock                             flock()ed by the writing process, holding its pid
        mix                              the new output (file or folder): being written, or complete
                                         and not yet renamed onto OUT
        replaced                         with replace=True (two-step fallback): the previous OUT, moved aside
        exchanging                       with replace=True (one exchange): "DEV INO" of the new output,
                                         written before OUT and work/mix are swapped
        discarded                        the previous OUT once the new one is in place: being removed

The commit protocol. Each state is a set of names on disk, so a run killed in any state leaves
a work folder from which the next run on the same OUT (its lock is free then) tells the state
and settles it (`_settle`, one rule for the writing run's own clean-up and for the next run):
nothing at OUT is ever removed, `replaced` is only put back or, once the new output is at OUT,
discarded, and what is removed outright (`mix`, `discarded`) never was at OUT after the run
started. No state holds neither the old nor the new output. Step names (in brackets) are where
`step_hook` is called, so that tests can interrupt or kill the commit at each of them.

  S1 writing  [ready]    work/{lock, mix}; OUT: the old output, or nothing.
                         Interrupt or kill -9: `mix` is removed (by this run, or by the next);
                         OUT untouched. "nothing was written" is true.
  S2x swap    [recorded, replace=True and something is at OUT, where renameat2(RENAME_EXCHANGE) works
               exchanged] (Linux >= 3.15, most local file systems): the new output's identity is written
                         to work/exchanging [recorded], then OUT and work/mix are swapped in ONE call
                         [exchanged]: OUT is never absent, it holds the old output until the instant it
                         holds the new one. work/mix is then the previous output, checked with
                         runtime.outputs.not_own_output (what is checked is exactly what would be
                         discarded); not ours: swapped back at once, the run fails. The settling rule:
                         OUT being the recorded identity means the swap happened (work/mix is the
                         previous output: checked, renamed to `discarded`, S4); otherwise work/mix is
                         the recorded new output, never at OUT (removed, as in S1); neither: both are
                         kept and the run fails naming them. A record cut short by a kill means no swap
                         yet. Where the exchange is refused (EINVAL, ENOSYS, ENOTSUP) or renameat2 is
                         missing, the two-step fallback below (S2, S3) runs instead.
  S2 aside    [aside,    (fallback) replace=True and something is at OUT: OUT renamed to work/replaced
               checked]  (one rename, so what is checked is exactly what would be discarded), then
                         checked with runtime.outputs.not_own_output. work/{lock, mix, replaced};
                         OUT: nothing. Interrupt or kill -9: `replaced` is renamed back onto OUT
                         (no-replace), then `mix` is removed; the old output is back, untouched
                         (a next run then checks OUT as if it had found it there: without --force
                         it stops at "already exists").
                         Something at OUT by then (a user's): both are kept, the run fails in one
                         line naming work/replaced. Not our own output: put back at once, the run
                         fails.
  S3 landed   [landed]   `mix` renamed onto OUT (no-replace). work/{lock, replaced} (or
                         work/{lock} when OUT was empty); OUT: the new output, complete.
                         `replaced` without `mix` means the new output landed: `replaced` (checked
                         in S2, and again here) is renamed to `discarded`. An interrupt from here on
                         raises InterruptedAfterWrite ("... was written"), never "nothing was
                         written". Where renameat2 is missing a file lands by os.link then unlink
                         [linked]: `mix` and OUT the same file means landed too.
  S4 discard  [discarding] work/{lock, discarded}: `discarded` is removed (by this run, or by the
                         next: it is the previous output, which --force asked to replace).
  S5 unlock   [removed,  work/{lock}, then nothing: the lock file is unlinked, the folder removed
               unlocked] (the next run finds a lock file alone, or no folder: nothing to settle).

Guarantees:
* A failed or interrupted run (an exception, Ctrl-C, SIGTERM) leaves OUT as it was (S1, S2) or
  holding the new output (S3 on), no work folder and no parent folders it created (a Ctrl-C inside
  the clean-up itself, S4-S5, leaves the folder as kill -9 would, for the next run to settle). A disk
  too full for the lock file or its pid is such a failure too: one OutputWriteError naming OUT.
* kill -9 leaves the work folder; its lock dies with the process, so the next run on the same OUT
  settles it as above (and says so through `on_stale`). A work folder whose lock is held belongs
  to a run that is alive: the second run fails in one line and removes nothing. A work folder
  holding a name the protocol does not use is not ours: the run fails and removes nothing. Two runs
  on one OUT: one wins, the other fails, nothing is lost.
* The final rename never replaces what appeared at OUT while the run wrote (another program, a
  user): with replace=False it is an OutputError; with replace=True it is moved aside, checked,
  and put back untouched unless it is this tool's own output (S2).
* --force replaces OUT with one renameat2(RENAME_EXCHANGE) where the kernel and file system have it
  (S2x), so a kill -9 or SIGTERM anywhere in the commit leaves OUT holding the old or the new output;
  only the two-step fallback (S2) has a window, between its two renames, where OUT is absent until the
  next run on OUT puts the old output back.
* Renames that must not replace use renameat2(RENAME_NOREPLACE) on Linux (ctypes; glibc >= 2.28),
  the one call that refuses atomically for files and folders alike. Where it is missing (other
  systems, file systems without it) a file is placed with os.link (fails if the name exists, also
  atomic) and a folder with os.rename, which POSIX refuses over a file or a non-empty folder (it
  may replace an empty folder: nothing is lost).
* A folder output gets runtime.outputs.MARKER listing its files (how --force recognises it).
* Files and folders are created with the process umask (only the work folder itself is 0700).
"""
from __future__ import annotations

import ctypes
import errno
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from .errors import OutputError, OutputWriteError
from .locks import acquire_lock, file_identity, write_pid
from .outputs import not_own_output, write_marker

PARTIAL_SUFFIX = ".bam-surgery.partial"
LOCK = "lock"
REPLACED = "replaced"
DISCARDED = "discarded"
EXCHANGING = "exchanging"
_EXISTS = (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR)

# The named steps of the commit, in order (see the states above); "recorded" and "exchanged" only where the
# exchange works, "aside" and "checked" only where it does not, "linked" only where renameat2 is missing.
COMMIT_STEPS = ("ready", "recorded", "aside", "checked", "linked", "exchanged", "landed", "discarding", "removed",
                "unlocked")
# Called with each step's name as the commit reaches it; tests set it to interrupt (raise) or kill there.
step_hook: Callable[[str], None] | None = None


def _step(name: str) -> None:
    if step_hook is not None:
        step_hook(name)


class InterruptedAfterWrite(KeyboardInterrupt):
    """Ctrl-C after the new output was in place (S3 on): OUT holds it, complete; only the clean-up of
    the work folder was cut short (the next run on the same OUT finishes it)."""

    def __init__(self, target: Path) -> None:
        self.target = target
        self.message = f"interrupted after {target} was written (it is complete)"
        super().__init__(self.message)


def work_folder(target: Path) -> Path:
    """The work folder of a target: `.{name}.bam-surgery.partial` beside it."""
    return target.parent / f".{target.name}{PARTIAL_SUFFIX}"


def _target(target: str | os.PathLike) -> Path:
    """An absolute target whose last component is a real name (never '', '.' or '..')."""
    raw = os.fspath(target)
    name = Path(raw).name
    if raw in ("", ".", "..") or raw.endswith(("/.", "/..")) or name in ("", ".", ".."):
        raise OutputError(f"{raw or repr(raw)}: not a name an output can be written to (give a file or folder "
                          "name, e.g. out/mix.safetensors)")
    return Path(os.path.abspath(raw))


@contextmanager
def atomic_path(target: str | os.PathLike, is_dir: bool = False, *, replace: bool = True,
                on_stale: Callable[[str], None] | None = None) -> Iterator[Path]:
    """Yield the path to write (a file, or with is_dir a folder the caller creates); rename it
    onto `target` only if the block succeeds.

    replace: an existing target (now or at the end) may be replaced if it is this tool's own output
    (runtime.outputs.not_own_output); False: any existing target is an OutputError.
    on_stale: told (one line) when a killed run's work folder for the same target is removed.
    """
    target = _target(target)
    _check_existing(target, replace)
    created = _make_parents(target)
    work = work_folder(target)
    item = work / target.name
    lock_fd = None
    ok = committing = landed = False
    try:
        try:
            lock_fd, restored = _acquire(work, target, on_stale)
            if restored:  # the previous output is back at OUT: as if it had been there from the start
                _check_existing(target, replace)
            try:
                yield item
                if is_dir and item.is_dir():
                    write_marker(item)
                committing = os.path.lexists(item)
                _commit(item, target, work, replace)
            except OSError as e:
                err = _as_output_error(e, target, work)
                if err is e:
                    raise
                raise err from e
            ok = True
        finally:
            if committing:  # before the clean-up removes `item`: did the new output reach OUT?
                landed = _landed(item, target, work)
            if lock_fd is not None and _release(work, target, lock_fd):
                landed = False  # swapped back: what had come to OUT while this run wrote is there again
            if not ok and not landed:
                remove_created_folders(created)
    except KeyboardInterrupt as e:
        if landed and not isinstance(e, InterruptedAfterWrite):
            raise InterruptedAfterWrite(target) from None
        raise


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Replace the small text file `path` whole, or leave it as it was: the text goes to a
    `.NAME.*.partial` file beside it, renamed over it once complete. For files a run rewrites as it
    goes (the pipeline's records, a training run's `latest`, a truncated metrics.jsonl), not outputs
    (no work folder, no lock, no --force check). On any failure (a full disk, Ctrl-C) the partial file
    is removed; an OSError becomes an OutputWriteError naming `path`."""
    path = Path(path)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    except OSError as e:
        raise _write_error(path, e) from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if isinstance(e, OSError) and e.errno is not None:
            raise _write_error(path, e) from None
        raise
    return path


def _write_error(path: Path, e: OSError) -> OSError:
    if isinstance(e, OutputError):
        return e
    reason = e.strerror or os.strerror(e.errno)
    return OutputWriteError(f"{path}: could not be written ({reason}); nothing was left there", e.errno)


@contextmanager
def atomic_dir(target: str | os.PathLike, *, replace: bool = True,
               on_stale: Callable[[str], None] | None = None) -> Iterator[Path]:
    """atomic_path for a folder, created empty (with the umask's permissions)."""
    with atomic_path(target, is_dir=True, replace=replace, on_stale=on_stale) as tmp:
        tmp.mkdir()
        yield tmp


# ---- before: the target and the work folder ----------------------------------------------------
def _check_existing(target: Path, replace: bool) -> None:
    if not os.path.lexists(target):
        return
    if not replace:
        raise OutputError(f"{target}: already exists; pass --force to replace it")
    reason = not_own_output(target)
    if reason:
        raise OutputError(f"{target}: {reason}; only outputs of bam-surgery are replaced (--force), remove it "
                          "yourself or write elsewhere")


def remove_created_folders(folders: list[Path]) -> None:
    """Remove folders a run created, deepest first, while they are empty: the first one that is not (or
    cannot be removed) stops it, so nothing a run did not create, and nothing inside, is ever removed."""
    for d in folders:
        try:
            d.rmdir()
        except OSError:
            break


def _make_parents(target: Path) -> list[Path]:
    """Create the target's missing parent folders; return them, deepest first."""
    created: list[Path] = []
    p = target.parent
    while not os.path.lexists(p):
        created.append(p)
        p = p.parent
    if not p.is_dir():
        raise OutputError(f"{target}: cannot be written: {p} is a file, not a folder")
    for d in reversed(created):
        try:
            d.mkdir()
        except FileExistsError:
            pass
        except OSError as e:
            remove_created_folders(created[created.index(d) + 1:])
            raise OutputError(f"{target}: cannot create folder {d} ({e.strerror})") from None
    return created


def _acquire(work: Path, target: Path, on_stale: Callable[[str], None] | None) -> tuple[int, bool]:
    """Create (or take over from a killed run) the target's work folder and lock it; returns the lock's
    descriptor and whether a killed run's previous output was put back at the target."""
    fresh = True
    try:
        os.mkdir(work, 0o700)
    except FileExistsError:
        fresh = False
    except OSError as e:
        raise OutputError(f"{target}: cannot be written: cannot create {work} ({e.strerror})") from None
    if not work.is_dir() or work.is_symlink():
        raise OutputError(f"{target}: {work} is in the way and is not a work folder of bam-surgery; remove it")
    try:
        fd = acquire_lock(work / LOCK, target)  # runtime/locks.py: the one lock of every output
    except OutputError:
        if fresh:  # e.g. no inode left for the lock (a full disk): the empty folder this run made goes again
            _rmdir_quietly(work)
        raise
    restored = False
    if not fresh:  # a killed run's leftovers: ours only if it holds nothing but what we put there
        try:
            leftovers = [n for n in os.listdir(work) if n != LOCK]
            foreign = [n for n in leftovers if n not in (target.name, REPLACED, DISCARDED, EXCHANGING)]
            if foreign:
                raise OutputError(f"{target}: {work} holds {foreign[0]}, which bam-surgery did not put there; "
                                  "remove that folder yourself")
            restored = _settle(work, target)
        except BaseException:
            os.close(fd)
            raise
        if on_stale is not None and restored:
            on_stale(f"put the previous {target} back from {work}, where an interrupted run had moved it aside")
        elif on_stale is not None and leftovers:
            on_stale(f"removed {work}, left by an interrupted run on the same output")
    try:
        write_pid(fd)
    except OSError as e:  # a disk too full for a pid: settled above, so the folder holds the lock alone
        _release(work, target, fd)
        raise OutputWriteError(f"{target}: could not be written ({e.strerror or os.strerror(e.errno)}); "
                               f"nothing was left there", e.errno) from None
    return fd, restored


def _settle(work: Path, target: Path) -> bool:
    """Bring a work folder in any state of the commit protocol back to S5 less the lock: put a displaced
    previous output back at the target if the new one never landed, else discard it; remove what never
    was at the target. Returns whether the previous output was put back. Used by the writing run's own
    clean-up and by the next run on a killed run's folder alike. Raises OutputError, keeping everything,
    where the previous output can be neither put back nor proven replaced."""
    item, aside, discarded = work / target.name, work / REPLACED, work / DISCARDED
    restored = False
    record = work / EXCHANGING
    if os.path.lexists(record):  # S2x: were OUT and work/NAME swapped?
        new = _recorded(record)
        if new is not None and file_identity(target) == new:  # yes: work/NAME is the previous output
            if os.path.lexists(item):
                if not_own_output(item) is None:
                    os.rename(item, discarded)
                    _step("discarding")
                elif rename_exchange(item, target):  # not ours (it came while the run wrote): swapped back
                    restored = True  # and the new output, now work/NAME, is removed below
                else:
                    raise OutputError(f"{target}: its previous content, swapped out by an interrupted run, is "
                                      f"kept at {item}; move it yourself")
        elif new is not None and os.path.lexists(item) and file_identity(item) != new:
            raise OutputError(f"{target}: changed while a run swapped it with {item}; both are kept, move one of "
                              "them yourself")
        os.unlink(record)  # otherwise work/NAME is the new output that never reached OUT: removed below
    if os.path.lexists(aside):
        if os.path.lexists(item) and not _landed(item, target, work):  # S2: the new output never reached OUT
            try:
                if _same(aside, target):  # put back by os.link, killed before the unlink
                    os.unlink(aside)
                else:
                    rename_noreplace(aside, target)
            except OSError as e:
                if e.errno not in _EXISTS:
                    raise
                raise OutputError(f"{target}: its previous content is kept at {aside} (moved aside by a run "
                                  f"interrupted before its new output was in place) and {target} exists again; "
                                  "move one of them yourself") from None
            restored = True
        else:  # S3: the new output is at OUT, and `replaced` was found ours before it went there
            reason = not_own_output(aside)
            if reason:
                raise OutputError(f"{target}: {aside} {reason}; kept, remove it yourself")
            os.rename(aside, discarded)
            _step("discarding")
    if os.path.lexists(discarded):
        _remove(discarded)
    if os.path.lexists(item):  # never at OUT: a partial or unlanded new output, or a second link to OUT's
        _remove(item)
    _step("removed")
    return restored


def _landed(item: Path, target: Path, work: Path) -> bool:
    """Whether the new output (work/NAME when committing began) is at the target: swapped there (S2x: the
    target is the recorded identity), renamed there, or linked there and not yet unlinked from the work
    folder (the no-renameat2 path for files)."""
    new = _recorded(work / EXCHANGING)
    if new is not None:
        return file_identity(target) == new
    return not os.path.lexists(item) or _same(item, target)


def _recorded(record: Path) -> tuple[int, int] | None:
    """The identity written to work/exchanging; None if there is none or it was cut short (no swap yet)."""
    try:
        with open(record, "rb", opener=_nofollow) as f:
            fields = f.read(64).split()
    except OSError:
        return None
    if len(fields) != 3 or fields[2] != b"end" or not all(x.isdigit() for x in fields[:2]):
        return None
    return int(fields[0]), int(fields[1])


def _nofollow(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_NOFOLLOW)


def _same(a: Path, b: Path) -> bool:
    ident = file_identity(a)
    return ident is not None and ident == file_identity(b)


def _release(work: Path, target: Path, lock_fd: int) -> bool:
    """Settle the work folder and remove it (still holding the lock, so no other run takes it meanwhile);
    whether the previous output was put back. If the previous output can be neither put back nor discarded,
    the folder stays, with an OutputError."""
    try:
        restored = _settle(work, target)
        try:
            os.unlink(work / LOCK)
            _step("unlocked")
            os.rmdir(work)
        except OSError:
            pass  # another run took the folder over after the unlink: it is its own now
    finally:
        os.close(lock_fd)
    return restored


def _rmdir_quietly(p: Path) -> None:
    try:
        os.rmdir(p)
    except OSError:
        pass


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        try:
            p.unlink()
        except FileNotFoundError:
            pass


# ---- after: the rename --------------------------------------------------------------------------
def _land(item: Path, target: Path) -> bool:
    """Rename the new output onto the target unless something is there: whether it landed."""
    try:
        rename_noreplace(item, target)
    except OSError as e:
        if e.errno not in _EXISTS:
            raise
        return False
    _step("landed")
    return True


def _commit(item: Path, target: Path, work: Path, replace: bool) -> None:
    if not os.path.lexists(item):
        raise OutputError(f"{target}: nothing was written")
    _step("ready")
    if _land(item, target):
        return
    if not replace:
        raise OutputError(f"{target}: appeared while this run was writing it; left untouched, and this run's "
                          "output was discarded (pass --force to replace an output of bam-surgery)")
    if _swap(item, target, work):
        return
    aside = work / REPLACED
    os.rename(target, aside)  # now only this run sees it: what is checked is what would be deleted
    _step("aside")
    reason = not_own_output(aside)
    if reason is None:
        _step("checked")
        if _land(item, target):
            return
        reason = "was created again while this run replaced it"
    try:
        rename_noreplace(aside, target)  # put it back, untouched
    except OSError:
        raise OutputError(f"{target}: could not be put back after it changed while this run wrote; it is "
                          f"kept at {aside}") from None
    raise OutputError(f"{target}: changed while this run was writing it and {reason}; left untouched, and this "
                      "run's output was discarded")


def _swap(item: Path, target: Path, work: Path) -> bool:
    """S2x: swap the new output with the target in one renameat2(RENAME_EXCHANGE), then check what came out
    (swapped back, and an OutputError, unless it is this tool's own output; the clean-up discards it).
    False, with nothing changed, where the exchange is not available (the two-step fallback runs then)."""
    if _RENAMEAT2 is None:
        return False
    if not_own_output(target):  # a user's, come while this run wrote: the two-step path says so, swapping nothing
        return False
    record = work / EXCHANGING
    new = file_identity(item)
    with open(record, "x", encoding="ascii") as f:
        f.write(f"{new[0]} {new[1]} end\n")
    _step("recorded")
    try:
        swapped = rename_exchange(item, target)
    except FileNotFoundError:  # the target went away since it was found: land on the free name instead
        os.unlink(record)
        if _land(item, target):
            return True
        raise OutputError(f"{target}: changed while this run was writing it; left untouched, and this run's "
                          "output was discarded") from None
    if not swapped:
        os.unlink(record)
        return False
    _step("exchanged")
    reason = not_own_output(item)  # the previous output, now where only this run sees it
    if reason is None:
        return True
    try:
        rename_exchange(item, target)  # swap back: the previous content at OUT again, untouched
    except OSError:
        raise OutputError(f"{target}: could not be swapped back after it changed while this run wrote; its "
                          f"previous content is kept at {item}") from None
    os.unlink(record)
    raise OutputError(f"{target}: changed while this run was writing it and {reason}; left untouched, and this "
                      "run's output was discarded")


_WRITE_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG, errno.EACCES, errno.EPERM, errno.EIO,
                 errno.ENOTDIR, errno.ENAMETOOLONG}


def _as_output_error(e: OSError, target: Path, work: Path) -> OSError:
    """An OSError while writing the output (no space, read-only file system, quota) as a one-line
    OutputWriteError naming the target; errors about other paths (inputs), and errors without an
    errno (raised by code, not by the system), are left as they are."""
    if isinstance(e, OutputWriteError) and e.errno is not None and str(e).startswith(f"{work}/"):
        pass  # a nested write (a canonical folder written into this one's work folder): named after the target
    elif isinstance(e, OutputError) or e.errno not in _WRITE_ERRORS:
        return e
    if e.filename is not None and not str(e.filename).startswith(str(work)):
        return e
    reason = e.strerror or os.strerror(e.errno)
    return OutputWriteError(f"{target}: could not be written ({reason}); nothing was left there", e.errno)


_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _renameat2():
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_RENAMEAT2 = _renameat2()


def rename_exchange(a: Path, b: Path) -> bool:
    """Swap a and b (both must exist) in one renameat2(RENAME_EXCHANGE); False, with nothing changed, where
    the system or the file system lacks it (the caller falls back to two renames)."""
    if _RENAMEAT2 is None:
        return False
    if _RENAMEAT2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def rename_noreplace(src: Path, dst: Path) -> None:
    """Rename src to dst, failing with an OSError (EEXIST, ENOTEMPTY, ...) if dst exists."""
    if _RENAMEAT2 is not None:
        if _RENAMEAT2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
            return
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):  # EINVAL: the file system lacks the flag
            raise OSError(err, os.strerror(err), str(src), None, str(dst))
    if os.path.lexists(dst):
        raise OSError(errno.EEXIST, os.strerror(errno.EEXIST), str(src), None, str(dst))
    if src.is_dir() and not src.is_symlink():
        os.rename(src, dst)  # POSIX refuses a file or a non-empty folder at dst
        return
    os.link(src, dst, follow_symlinks=False)  # EEXIST if dst appeared since the check above
    _step("linked")
    os.unlink(src)
