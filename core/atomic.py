"""Atomic file output and file locks: nothing half-written is ever visible under a final name, and what a
killed writer left behind is removed by the next writer of the same name."""

from __future__ import annotations

import contextlib
import fcntl
import glob
import os
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Callable, Iterator


def _staging_prefix(final: Path) -> str:
    """Staging paths carry their writer's host and pid. No lock guards them (any process may write `final`),
    so this is how the next writer tells a dead writer's leftovers from a live writer's staging: a reused pid
    only keeps a leftover longer, never removes a live one, and other hosts' staging is never touched."""
    return f".{final.name}.tmp-{socket.gethostname()}-{os.getpid()}-"


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_dead_staging(final: Path) -> None:
    """Remove staging files and folders of `final` left by writers on this host that no longer run."""
    prefix = f".{final.name}.tmp-"
    host = socket.gethostname()
    for path in final.parent.glob(glob.escape(prefix) + "*"):
        owner_host, _, pid = path.name[len(prefix):].rpartition("-")[0].rpartition("-")  # <host>-<pid>-<random>
        if owner_host == host and pid.isdigit() and not _running(int(pid)):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _temporary_file(final: Path) -> tuple[int, Path]:
    """mkstemp beside `final`, with the permissions a plain open() would give (mkstemp uses 0600)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_dead_staging(final)
    fd, tmp = tempfile.mkstemp(prefix=_staging_prefix(final), dir=final.parent)
    os.fchmod(fd, 0o666 & ~_umask())
    return fd, Path(tmp)


@contextlib.contextmanager
def atomic_file(final: Path) -> Iterator[Path]:
    """Yield a temporary path beside `final`; on success it is renamed over `final`."""
    fd, tmp_path = _temporary_file(final)
    os.close(fd)
    try:
        yield tmp_path
        os.replace(tmp_path, final)
    finally:
        tmp_path.unlink(missing_ok=True)


def atomic_write_bytes(final: Path, data: bytes) -> None:
    with atomic_file(final) as tmp:
        tmp.write_bytes(data)


def write_new_file(final: Path, data: bytes) -> bool:
    """Write `data` to `final` only if no file of that name exists; never overwrites.

    Returns False if `final` already existed. Linking a complete temporary file makes
    "create if absent" atomic.
    """
    fd, tmp = _temporary_file(final)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        try:
            os.link(tmp, final)
        except FileExistsError:
            return False
        return True
    finally:
        os.unlink(tmp)


@contextlib.contextmanager
def atomic_directory(final: Path) -> Iterator[Path]:
    """Yield an empty staging directory beside `final`; on success it becomes `final`."""
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_dead_staging(final)
    staging = Path(tempfile.mkdtemp(prefix=_staging_prefix(final), dir=final.parent))
    try:
        yield staging
        if final.exists():  # another process finished first; keep theirs
            return
        os.replace(staging, final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


_held_locks: set[Path] = set()


@contextlib.contextmanager
def file_lock(path: Path, on_wait: Callable[[], None] | None = None) -> Iterator[bool]:
    """Hold an exclusive advisory lock on `path` (created if needed) for the block's duration.

    Yields True where this call took the lock, False where this process already held it: flock belongs to
    an open file, so locking a second open file of a lock we hold would wait for ourselves forever, and a
    caller holding a lock may call code that takes it again (locks are taken from one thread only).
    `on_wait` runs before waiting for another process that holds it.
    """
    key = path.resolve()
    if key in _held_locks:
        yield False
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait is not None:
                on_wait()
            fcntl.flock(handle, fcntl.LOCK_EX)
        _held_locks.add(key)
        try:
            yield True
        finally:
            _held_locks.discard(key)
            fcntl.flock(handle, fcntl.LOCK_UN)
