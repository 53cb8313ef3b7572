"""One writer per output: a lock file, flock()ed by the writing process and holding its pid.

    fd = lock_file(run / ".bam-surgery.lock", run)   # OutputError if another run holds it
    ...                                               # write the output
    unlock_file(fd, run / ".bam-surgery.lock")

The lock dies with its process (kill -9 included), so a lock file left behind is free: the next run takes
it over, no clean-up needed. A second run on the same output fails at once (never waits) in one line naming
the holder's pid. `train` holds RUN/.bam-surgery.lock for its whole run; runtime/atomic.py's work folder
holds its lock through acquire_lock / write_pid (it settles a killed run's work folder in between) for merge,
convert and export-onnx outputs: one lock for every output.
"""
from __future__ import annotations

import fcntl
import os
from pathlib import Path

from .errors import OutputError


def lock_file(path: Path, target: Path) -> int:
    """Create (or take over) the lock file `path` of output `target`, lock it and write this process's pid
    into it; returns its descriptor. Raises OutputError if a live run holds it, or it cannot be created."""
    fd = acquire_lock(path, target)
    try:
        write_pid(fd)
    except OSError as e:
        unlock_file(fd, path)
        raise OutputError(f"{target}: cannot lock {path} ({e.strerror or os.strerror(e.errno)})") from None
    return fd


def acquire_lock(path: Path, target: Path) -> int:
    """Open (creating it) and flock the lock file `path` of output `target`; returns its descriptor, the pid not
    yet written (runtime/atomic.py settles a killed run's work folder in between). OutputError if a live run
    holds it or it cannot be created."""
    for _ in range(10):  # the holder may unlink the file between our open and our flock: lock the one at path
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        except OSError as e:
            raise OutputError(f"{target}: cannot lock {path} ({e.strerror})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            pid = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise OutputError(f"{target}: another bam-surgery run (pid {pid}) is writing it right now; wait for it "
                              "to finish or write elsewhere") from None
        if _same_file(fd, path):
            return fd
        os.close(fd)
    raise OutputError(f"{target}: cannot lock {path} (other runs keep replacing it)")


def write_pid(fd: int) -> None:
    """This process's pid into a lock held by acquire_lock (what a second run's error names). OSError as is."""
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)


def unlock_file(fd: int, path: Path) -> None:
    """Remove the lock file (while still holding it, so no other run is locking it meanwhile) and release it."""
    try:
        if _same_file(fd, path):
            os.unlink(path)
    except OSError:
        pass
    finally:
        os.close(fd)


def file_identity(f: int | str | os.PathLike) -> tuple[int, int] | None:
    """(device, inode) of an open descriptor, or of a path itself (a link is not followed); None if it is gone."""
    try:
        st = os.fstat(f) if isinstance(f, int) else os.lstat(f)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def _same_file(fd: int, path: Path) -> bool:
    ident = file_identity(fd)
    return ident is not None and ident == file_identity(path)
