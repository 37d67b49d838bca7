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

from core.errors import RunFailure, UsageError
from core.interrupts import held

# Called as hook(path, point) at known points of the writes here and of the artifact cache (core.artifacts); nothing
# here installs one: the fault tests do (tests/paused.py), to stop a real process there and signal or kill it, or
# race another against it, without sleeping. Here: "linked", each time write_new_set has linked a file of its set.
checkpoint_hooks: list[Callable[[Path, str], None]] = []


def checkpoint(path: Path, point: str) -> None:
    for hook in checkpoint_hooks:
        hook(path, point)


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


def discard_directory(directory: Path) -> None:
    """Remove a folder so that no half-removed copy is ever seen under its name: it is renamed to a staging name
    first (which remove_dead_staging clears if this process dies while deleting it)."""
    doomed = Path(tempfile.mkdtemp(prefix=_staging_prefix(directory), dir=directory.parent))
    os.replace(directory, doomed / directory.name)
    shutil.rmtree(doomed, ignore_errors=True)


def writable_reason(directory: Path) -> str | None:
    """Why files cannot be made in `directory` (created on demand), or None; creates nothing."""
    existing = directory
    while not (existing.exists() or existing.is_symlink()) and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"'{existing}' is not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"'{existing}' is not writable"
    return None


def check_writable_directory(what: str, directory: Path) -> None:
    """A directory a run will write into: a one-line UsageError now, not a traceback after the work."""
    reason = writable_reason(directory)
    if reason:
        raise UsageError(f"{what} '{directory}' cannot be written: {reason}")


def check_writable_file(what: str, file: Path) -> None:
    """A file a run reads if present and replaces atomically (so its directory must be writable too)."""
    reason = None
    if file.exists() or file.is_symlink():
        if not file.is_file():
            reason = "it is not a regular file"
        elif not os.access(file, os.R_OK):
            reason = "it is not readable"
    reason = reason or writable_reason(file.parent)
    if reason:
        raise UsageError(f"{what} '{file}' cannot be written: {reason}")


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


def save_file(what: str, final: Path, data: bytes) -> None:
    """atomic_write_bytes for a command's output (a report): where it cannot be written (a full disk), a one-line
    RunFailure, and nothing of it left."""
    try:
        atomic_write_bytes(final, data)
    except OSError as exc:
        raise RunFailure(f"{what} '{final}' cannot be written: {exc.strerror or exc}") from None


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


def write_new_set(directory: Path, files: dict[str, bytes]) -> bool:
    """Write `files` (name -> data) into `directory` all or none: each is written in a staging folder first, then
    linked under its name. Returns False, leaving nothing, where any of the names exists already; an OSError
    while writing (a full disk) leaves nothing either."""
    directory.mkdir(parents=True, exist_ok=True)
    anchor = directory / next(iter(files))
    remove_dead_staging(anchor)
    staging = Path(tempfile.mkdtemp(prefix=_staging_prefix(anchor), dir=directory))
    try:
        for name, data in files.items():
            (staging / name).write_bytes(data)
        with held():  # a signal now waits until the set is there whole, or gone again
            linked: list[Path] = []
            try:
                for name in files:
                    os.link(staging / name, directory / name)
                    linked.append(directory / name)
                    checkpoint(directory / name, "linked")
            except FileExistsError:
                return False
            finally:
                if len(linked) < len(files):
                    for path in linked:
                        path.unlink()
        return True
    finally:
        with held():
            shutil.rmtree(staging, ignore_errors=True)


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
