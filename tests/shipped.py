"""Checks every trained built-in's package must pass (models/scenes, models/scenes_sd3): the files on disk are the
ones weights.sha256 records and what the package loads, within the working tree's budget, in fp16; and a changed
weight file is refused with the reason."""

import shutil

import pytest
import torch
from safetensors import safe_open

from core.errors import RunFailure
from models.shapes import shipped_files
from models.source import resolve_model

MAX_MODEL_BYTES = 16_000_000  # a trained built-in's fp16 weights (the issues' budget: 20 MB); the tree must stay small


def check_recorded_files(package) -> None:
    recorded = shipped_files(package.HASHES)
    on_disk = {p.relative_to(package.HERE).as_posix() for p in package.MODEL_DIR.rglob("*") if p.is_file()}
    assert on_disk == set(recorded) and package.damage() is None
    weights = [package.HERE / p for p in recorded if p.endswith(".safetensors")]
    assert sum(p.stat().st_size for p in weights) <= MAX_MODEL_BYTES
    for path in weights:
        with safe_open(path, "pt") as weights_file:
            assert {weights_file.get_tensor(k).dtype for k in weights_file.keys()} == {torch.float16}


def check_a_changed_weight_file_is_refused(package, name: str, weights: str, tmp_path, monkeypatch) -> None:
    """`weights` (a path under the package's model/) with one bit flipped: resolving the built-in `name` fails."""
    copy = tmp_path / package.HERE.name
    shutil.copytree(package.HERE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    changed = copy / "model" / weights
    data = bytearray(changed.read_bytes())
    data[len(data) // 2] ^= 1
    changed.write_bytes(bytes(data))
    monkeypatch.setattr(package, "HERE", copy)
    with pytest.raises(RunFailure, match=f"damaged .*{weights}.*reinstall"):
        resolve_model(name)
