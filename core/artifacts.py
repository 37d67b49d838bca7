"""The staged artifact cache (checkpoint -> ONNX -> optimized ONNX -> engine).

An artifact is a main file plus optional side files (ONNX external data), and a manifest
`<file>.json` that records the key of what made it and the size and SHA-256 of every file. The
artifact is reused only when the key matches and every file has its recorded size (and, where the
caller asks, its recorded hash); otherwise it is rebuilt. A manifest that is missing, unreadable or
not shaped like one means "not built".
Only the holder of an artifact's lock builds, replaces or verifies its files. Builds happen in a
staging directory, files are moved into place, and the manifest is written last, so a crash leaves
a stale artifact, never a mismatched one; whatever a killed build left is removed by the next holder.
"""

from __future__ import annotations

import contextlib
import contextvars
import glob
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterator

from core.atomic import atomic_write_bytes, checkpoint, file_lock, remove_dead_staging
from core.errors import RunFailure

# Besides core.atomic's checkpoints, two of every cached_build: "building" (lock held, staging folder made, nothing
# built yet) and "done" (returning, the artifact built or reused and its lock released unless the caller holds it).

NOT_BUILT, FORCED = "not built yet", "forced rebuild"  # the reasons to build that say nothing was wrong
# What the builds under way tell of an artifact that was there and is built again (cached_build's `progress`):
# one built inside another's build (an engine's ONNX) says it where that one does.
_rebuilds_said_to: contextvars.ContextVar[Callable[[str], None] | None] = contextvars.ContextVar(
    "rebuilds_said_to", default=None)


class ArtifactError(RunFailure):
    """An artifact that should be built is not (a build of it failed or was killed)."""


def manifest_path(artifact: Path) -> Path:
    return artifact.with_name(artifact.name + ".json")


def lock_path(artifact: Path) -> Path:
    return artifact.with_name(artifact.name + ".lock")


def _staging_prefix(artifact: Path) -> str:
    return f".{artifact.name}.build-"


def _is_manifest(manifest, artifact: Path) -> bool:
    if not isinstance(manifest, dict) or not isinstance(manifest.get("key"), dict):
        return False
    files = manifest.get("files")
    if not isinstance(files, dict) or artifact.name not in files:
        return False
    return all(
        isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and isinstance(entry, dict)
        and type(entry.get("size")) is int and entry["size"] >= 0 and isinstance(entry.get("sha256"), str)
        for name, entry in files.items()
    )


def read_manifest(artifact: Path) -> dict | None:
    """The artifact's manifest, or None where it is missing, unreadable or not a manifest."""
    try:
        manifest = json.loads(manifest_path(artifact).read_text())
    except (OSError, ValueError):
        return None
    return manifest if _is_manifest(manifest, artifact) else None


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


@contextlib.contextmanager
def artifact_lock(artifact: Path, log: Callable[[str], None] = print) -> Iterator[None]:
    """Hold `artifact`'s lock (re-entrant). Taking it removes what killed builds of the artifact left behind."""
    waiting = lambda: log(f"[cache] {artifact.name}: waiting for another process that holds it")  # noqa: E731
    with file_lock(lock_path(artifact), on_wait=waiting) as taken:
        if not taken:
            yield
            return
        # Staging folders of an artifact are made only by the holder of its lock, so while we hold it each one
        # is a killed build's: a live build's staging cannot be removed (it would hold the lock), and no pid
        # bookkeeping is needed. The manifest's temporary files follow core.atomic's rule (writer's pid).
        for staging in artifact.parent.glob(glob.escape(_staging_prefix(artifact)) + "*"):
            shutil.rmtree(staging, ignore_errors=True)
        remove_dead_staging(manifest_path(artifact))
        yield


def _damage(artifact: Path, files: dict, verify_content: bool) -> str | None:
    """Why the files on disk differ from the manifest's `files` (caller holds the lock), or None."""
    for name, recorded in files.items():
        file = artifact.with_name(name)
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != recorded["size"]:
            return f"{name} is truncated or corrupt ({file.stat().st_size} bytes, expected {recorded['size']})"
    if verify_content:
        for name, recorded in files.items():
            if file_sha256(artifact.with_name(name)) != recorded["sha256"]:
                return f"{name} is corrupt (content hash differs)"
    return None


def artifact_bytes(artifact: Path) -> int:
    """Total size of a built artifact's files (main file and side files), from its manifest, read under its
    lock (so never while another process rebuilds it). Raises ArtifactError where it is not built."""
    with artifact_lock(artifact):
        manifest = read_manifest(artifact)
    if manifest is None:
        raise ArtifactError(f"{artifact} is not built")
    return sum(f["size"] for f in manifest["files"].values())


def _staleness(artifact: Path, key: dict, verify_content: bool) -> str | None:
    """Why `artifact` cannot be reused for `key` (caller holds the lock), or None when it can."""
    manifest = read_manifest(artifact)
    if manifest is None:
        return NOT_BUILT
    if manifest["key"] != key:
        changed = sorted(k for k in set(key) | set(manifest["key"]) if key.get(k) != manifest["key"].get(k))
        return f"stale ({', '.join(changed)} changed)"
    return _damage(artifact, manifest["files"], verify_content)


def _build_into_place(artifact: Path, key: dict, build: Callable[[Path], None]) -> None:
    """Build in a staging folder, move the files into place, write the manifest last (caller holds the lock)."""
    manifest_path(artifact).unlink(missing_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=_staging_prefix(artifact), dir=artifact.parent))
    try:
        checkpoint(artifact, "building")
        build(staging / artifact.name)
        files = {p.name: {"size": p.stat().st_size, "sha256": file_sha256(p)} for p in staging.iterdir()}
        if artifact.name not in files:
            raise RuntimeError(f"building {artifact.name} produced no file")
        # Side files first, the main file last: a reader never sees the main file without its data.
        for name in sorted(files, key=lambda n: n == artifact.name):
            os.replace(staging / name, artifact.with_name(name))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    atomic_write_bytes(manifest_path(artifact), json.dumps({"key": key, "files": files}, indent=1).encode())


def cached_build(
    artifact: Path,
    key: dict,
    build: Callable[[Path], None],
    force: bool = False,
    log: Callable[[str], None] = print,
    verify_content: bool = False,
    build_missing: bool = True,
    progress: Callable[[str], None] | None = None,
) -> Path:
    """Return `artifact`, building it with `build(staging_path)` unless a fresh copy exists (with
    `build_missing` False, raise ArtifactError instead, leaving what is there as it is).

    `build` writes the main file at `staging_path` and may write side files beside it; all files it
    leaves in that directory become part of the artifact. With `verify_content`, a reused artifact's
    files are also checked against their SHA-256, so that nothing is built from a damaged file.
    `log` hears every decision; `progress` (else the enclosing cached_build's) also why an artifact that was there
    is built again (damaged or stale: minutes of work whose reason needs no --verbose). A disk that fills up is
    an ArtifactError, the staging gone.
    """
    progress = progress or _rebuilds_said_to.get()
    with artifact_lock(artifact, log):
        reason = FORCED if force else _staleness(artifact, key, verify_content)
        if reason is None:
            log(f"[cache] {artifact.name}: up to date")
        elif not build_missing:
            raise ArtifactError(f"{artifact}: {reason}, and building is off here")
        else:
            line = f"[cache] {artifact.name}: building ({reason})"
            log(line)
            if progress not in (None, log) and reason not in (NOT_BUILT, FORCED):
                progress(line)
            said_to = _rebuilds_said_to.set(progress)
            try:
                _build_into_place(artifact, key, build)
            except OSError as exc:  # a full disk, mostly
                where = f" ({exc.filename})" if exc.filename else ""
                raise ArtifactError(f"cannot build {artifact}: {exc.strerror or exc}{where}") from None
            finally:
                _rebuilds_said_to.reset(said_to)
    checkpoint(artifact, "done")
    return artifact
