"""The artifact cache reuses fresh artifacts, rebuilds stale or damaged ones, and never half-writes."""

import os

import pytest

from core.artifacts import cached_build, read_manifest
from core.atomic import write_new_file


def _builder(calls, data=b"artifact-bytes", side=b"side-data"):
    def build(path):
        calls.append(path)
        path.write_bytes(data)
        path.with_name(path.name + ".data").write_bytes(side)
    return build


def test_reuse_rebuild_and_recovery(tmp_path):
    calls = []
    art = tmp_path / "unet.onnx"
    key = {"stage": "unet", "model": "abc"}
    def quiet(*_):
        pass

    cached_build(art, key, _builder(calls), log=quiet)
    assert art.read_bytes() == b"artifact-bytes" and (tmp_path / "unet.onnx.data").exists()
    assert {n: f["size"] for n, f in read_manifest(art)["files"].items()} == {"unet.onnx": 14, "unet.onnx.data": 9}
    cached_build(art, key, _builder(calls), log=quiet)
    assert len(calls) == 1  # fresh: reused

    cached_build(art, dict(key, model="changed"), _builder(calls), log=quiet)
    assert len(calls) == 2  # key changed: rebuilt

    (tmp_path / "unet.onnx.data").write_bytes(b"trunc")
    messages = []
    cached_build(art, dict(key, model="changed"), _builder(calls), log=messages.append)
    assert len(calls) == 3 and "truncated or corrupt" in messages[0]

    cached_build(art, dict(key, model="changed"), _builder(calls), force=True, log=quiet)
    assert len(calls) == 4

    # Same size, different bytes: only a content check can tell.
    art.write_bytes(b"artifact-bytez")
    cached_build(art, dict(key, model="changed"), _builder(calls), log=quiet)
    assert len(calls) == 4
    messages.clear()
    cached_build(art, dict(key, model="changed"), _builder(calls), log=messages.append, verify_content=True)
    assert len(calls) == 5 and "content hash differs" in messages[0]


def test_with_building_off_a_stale_artifact_is_an_error_and_stays_as_it_was(tmp_path):
    from core.artifacts import ArtifactError

    calls, art, quiet = [], tmp_path / "unet.engine", lambda *_: None
    cached_build(art, {"level": 3}, _builder(calls), log=quiet)
    assert cached_build(art, {"level": 3}, _builder(calls), log=quiet, build_missing=False) == art
    with pytest.raises(ArtifactError, match="stale \\(level changed\\), and building is off"):
        cached_build(art, {"level": 2}, _builder(calls), log=quiet, build_missing=False)
    with pytest.raises(ArtifactError, match="not built yet, and building is off"):
        cached_build(tmp_path / "vae.engine", {"level": 3}, _builder(calls), log=quiet, build_missing=False)
    assert len(calls) == 1 and read_manifest(art)["key"] == {"level": 3}  # still reusable where it was made for
    assert not (tmp_path / "vae.engine").exists()


def test_failed_build_leaves_nothing(tmp_path):
    art = tmp_path / "clip.onnx"

    def failing(path):
        path.write_bytes(b"half")
        raise RuntimeError("exporter crashed")

    with pytest.raises(RuntimeError):
        cached_build(art, {"k": 1}, failing, log=lambda *_: None)
    assert not art.exists() and read_manifest(art) is None
    assert [p.name for p in tmp_path.iterdir()] == ["clip.onnx.lock"]


def _current_umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_write_new_file_never_overwrites(tmp_path):
    target = tmp_path / "img.png"
    assert write_new_file(target, b"first")
    assert not write_new_file(target, b"second")
    assert target.read_bytes() == b"first"
    assert target.stat().st_mode & 0o777 == 0o666 & ~_current_umask()  # not mkstemp's 0600
    assert [p.name for p in tmp_path.iterdir()] == ["img.png"]
