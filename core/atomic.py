"""Atomic file output: nothing half-written is ever visible under a final name."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator


def _staging_name(final: Path) -> str:
    return f".{final.name}.tmp-"


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _temporary_file(final: Path) -> tuple[int, Path]:
    """mkstemp beside `final`, with the permissions a plain open() would give (mkstemp uses 0600)."""
    fd, tmp = tempfile.mkstemp(prefix=_staging_name(final), dir=final.parent)
    os.fchmod(fd, 0o666 & ~_umask())
    return fd, Path(tmp)


@contextlib.contextmanager
def atomic_file(final: Path) -> Iterator[Path]:
    """Yield a temporary path beside `final`; on success it is renamed over `final`."""
    final.parent.mkdir(parents=True, exist_ok=True)
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
    final.parent.mkdir(parents=True, exist_ok=True)
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
    staging = Path(tempfile.mkdtemp(prefix=_staging_name(final), dir=final.parent))
    try:
        yield staging
        if final.exists():  # another process finished first; keep theirs
            return
        os.replace(staging, final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive advisory lock held on `path` (created if needed) for the block's duration."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
