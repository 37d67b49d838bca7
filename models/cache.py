"""Where the models this toolkit makes are kept (built-ins, converted single files, their ControlNets), and how a
model's files key the artifacts made from it. Light: no torch, no other module of the project."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def default_cache_dir() -> Path:
    return Path(os.environ.get("DEMO_DIFFUSION_CACHE", Path.home() / ".cache" / "demo_diffusion"))


def content_fingerprint(files) -> str:
    """Files ((path, the name it goes by) each) for artifact cache keys: config files hashed, weight files by name,
    size and modification time (hashing gigabytes of weights on every run would cost more than the cache saves)."""
    digest = hashlib.sha256()
    for file, rel in files:
        if file.suffix in (".json", ".txt"):
            digest.update(f"{rel}:".encode() + file.read_bytes())
        else:
            stat = file.stat()
            digest.update(f"{rel}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:16]
