"""The staged artifact cache (checkpoint -> ONNX -> optimized ONNX -> engine).

An artifact is a main file plus optional side files (ONNX external data), and a manifest
`<file>.json` that records the key of what made it and the size and SHA-256 of every file. The
artifact is reused only when the key matches and every file has its recorded size (and, where the
caller asks, its recorded hash); otherwise it is rebuilt.
Builds happen in a staging directory under a lock, files are moved into place, and the manifest is
written last, so a crash leaves a stale artifact, never a mismatched one.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from core.atomic import atomic_write_bytes, file_lock


def manifest_path(artifact: Path) -> Path:
    return artifact.with_name(artifact.name + ".json")


def read_manifest(artifact: Path) -> dict | None:
    try:
        return json.loads(manifest_path(artifact).read_text())
    except (OSError, ValueError):
        return None


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def content_hash(artifact: Path) -> str:
    """One hash over all files of a built artifact, from its manifest."""
    files = read_manifest(artifact)["files"]
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()[:16]


def artifact_bytes(artifact: Path) -> int:
    """Total size of a built artifact's files (main file and side files), from its manifest."""
    return sum(f["size"] for f in read_manifest(artifact)["files"].values())


def staleness(artifact: Path, key: dict, verify_content: bool = False) -> str | None:
    """Why `artifact` cannot be reused for `key`, or None when it can."""
    manifest = read_manifest(artifact)
    if manifest is None:
        return "not built yet"
    if manifest.get("key") != key:
        changed = sorted(k for k in set(key) | set(manifest.get("key", {})) if key.get(k) != manifest["key"].get(k))
        return f"stale ({', '.join(changed)} changed)"
    for name, recorded in manifest.get("files", {}).items():
        file = artifact.with_name(name)
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != recorded["size"]:
            return f"{name} is truncated or corrupt ({file.stat().st_size} bytes, expected {recorded['size']})"
        if verify_content and file_sha256(file) != recorded["sha256"]:
            return f"{name} is corrupt (content hash differs)"
    return None


def cached_build(
    artifact: Path,
    key: dict,
    build: Callable[[Path], None],
    force: bool = False,
    log: Callable[[str], None] = print,
    verify_content: bool = False,
) -> Path:
    """Return `artifact`, building it with `build(staging_path)` unless a fresh copy exists.

    `build` writes the main file at `staging_path` and may write side files beside it; all files it
    leaves in that directory become part of the artifact.
    """
    with file_lock(artifact.with_name(artifact.name + ".lock")):
        reason = "forced rebuild" if force else staleness(artifact, key, verify_content)
        if reason is None:
            log(f"[cache] {artifact.name}: up to date")
            return artifact
        log(f"[cache] {artifact.name}: building ({reason})")
        manifest_path(artifact).unlink(missing_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{artifact.name}.build-", dir=artifact.parent))
        try:
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
    return artifact
