"""TensorRT for RTX engines built on the CPU: I/O, cache keys, recovery, errors, host-side runtime logic.

No engine executes here (no GPU); what needs one is said in the README.
"""

import onnx
import onnx.helper as helper
import pytest
import torch

pytest.importorskip("tensorrt_rtx", reason="tensorrt-rtx-cu13 is not installed")

from core.artifacts import read_manifest  # noqa: E402
from demo.backends import select_backend  # noqa: E402
from demo.engine import (BuildOptions, EngineBuildError, EngineIO, EngineSettings, ImageProfile,  # noqa: E402
                         build_engine_file, engine_key, io_path, prepare_engine, prepare_stage_engines)
from core.errors import UsageError  # noqa: E402
from models import STAGE_MODELS, TEXT_TO_IMAGE_STAGES  # noqa: E402

TARGETS = ((8, 0), (8, 6), (8, 9))
QUIET = lambda *_: None  # noqa: E731


@pytest.fixture(scope="module")
def built(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("engines")
    profile = ImageProfile.for_request(tiny, batch_size=2, height=64, width=48, static_batch=False, dynamic_shape=False)
    settings = EngineSettings(root / "onnx", root / "engine", profile,
                              BuildOptions("tensorrt-rtx", optimization_level=0, target_ccs=TARGETS))
    models = [STAGE_MODELS[name](tiny) for name in TEXT_TO_IMAGE_STAGES]
    engines = prepare_stage_engines(models, settings, "cpu", torch.float32, QUIET)
    return settings, models, engines


def test_three_engines_match_the_model_classes(built):
    settings, models, engines = built
    for model in models:
        engine = engines[model.name]
        assert engine.stat().st_size > 100_000
        io = EngineIO.load(io_path(engine))
        assert list(io.inputs) == list(model.input_names)
        assert list(io.outputs) == list(model.output_names)
        assert io.binding_order == [*model.input_names, *model.output_names]
        expected = settings.profile.stage_shapes(model, guided=True)
        for name, meta in io.inputs.items():
            assert tuple(tuple(s) for s in meta["profile"]) == expected[name]
        key = read_manifest(engine)["key"]
        assert key["flavour"] == "tensorrt-rtx" and key["target_cc"] == ["8.0", "8.6", "8.9"]
    unet_io = EngineIO.load(io_path(engines["unet"]))
    assert unet_io.inputs["sample"]["dtype"] == "FLOAT"  # fp32 ONNX on a CPU: a strongly typed fp32 engine
    assert unet_io.inputs["sample"]["profile"] == [[2, 4, 32, 24], [4, 4, 32, 24], [8, 4, 32, 24]]  # guided: 2x
    assert EngineIO.load(io_path(engines["clip"])).inputs["input_ids"]["dtype"] == "INT32"


def test_buffer_specs_and_profile_checks(built):
    _, models, engines = built
    unet = models[1]
    io = EngineIO.load(io_path(engines["unet"]))
    specs = io.buffer_specs(unet, batch=4, height=64, width=48)
    assert specs == [("sample", (4, 4, 32, 24), torch.float32), ("timestep", (1,), torch.float32),
                     ("encoder_hidden_states", (4, 77, 32), torch.float32), ("latent", (4, 4, 32, 24), torch.float32)]
    with pytest.raises(UsageError, match=r"'sample' shape \[16, 4, 32, 24\] is outside the engine's profile "
                                         r"\(min \[2, 4, 32, 24\], max \[8, 4, 32, 24\]\)"):
        io.buffer_specs(unet, batch=16, height=64, width=48)
    with pytest.raises(UsageError, match="outside the engine's profile"):
        io.buffer_specs(unet, batch=2, height=64, width=64)


def test_reuse_truncation_and_corruption_rebuild(built, tiny):
    settings, models, engines = built
    vae = models[2]
    shapes = settings.profile.stage_shapes(vae, guided=True)
    onnx_path = settings.onnx_dir / "vae.opt.onnx"
    log = []
    prepare_engine(vae, onnx_path, settings.engine_dir, shapes, settings.options, log=log.append)
    assert log == ["[cache] vae.engine: up to date"]
    engine = engines["vae"]
    good = engine.read_bytes()
    engine.write_bytes(good[: len(good) // 2])
    log.clear()
    prepare_engine(vae, onnx_path, settings.engine_dir, shapes, settings.options, log=log.append)
    assert "truncated or corrupt" in log[0]
    assert engine.stat().st_size == read_manifest(engine)["files"]["vae.engine"]["size"]
    flipped = bytearray(engine.read_bytes())
    flipped[len(flipped) // 2] ^= 0xFF
    engine.write_bytes(bytes(flipped))
    log.clear()
    prepare_engine(vae, onnx_path, settings.engine_dir, shapes, settings.options, log=log.append)
    assert "content hash differs" in log[0]
    assert not list(settings.engine_dir.glob(".*build-*"))  # no staging leftovers


def test_cache_key_follows_onnx_shapes_and_flavour(built, tiny, monkeypatch):
    settings, models, _ = built
    unet = models[1]
    onnx_path = settings.onnx_dir / "unet.opt.onnx"
    shapes = settings.profile.stage_shapes(unet, guided=True)
    base = engine_key(unet, onnx_path, shapes, settings.options)
    other_shapes = ImageProfile.for_request(tiny, 2, 64, 64, False, False).stage_shapes(unet, guided=True)
    assert engine_key(unet, onnx_path, other_shapes, settings.options) != base
    assert engine_key(unet, settings.onnx_dir / "vae.opt.onnx", shapes, settings.options)["onnx"] != base["onnx"]
    assert engine_key(unet, onnx_path, shapes, BuildOptions("tensorrt-rtx", 0, target_ccs=((8, 6),))) != base
    monkeypatch.setattr("demo.engine.version", lambda name: "10.99")
    assert engine_key(unet, onnx_path, shapes, BuildOptions("tensorrt", 0, target_ccs=TARGETS))["flavour"] == "tensorrt"
    assert engine_key(unet, onnx_path, shapes, BuildOptions("tensorrt", 0, target_ccs=TARGETS)) != base


def test_onnx_parse_error_names_the_node(tmp_path, tiny):
    x = helper.make_tensor_value_info("sample", onnx.TensorProto.FLOAT, [1, 4])
    y = helper.make_tensor_value_info("latent", onnx.TensorProto.FLOAT, [1, 4])
    node = helper.make_node("NoSuchOp", ["sample"], ["latent"], name="broken_node")
    path = tmp_path / "bad.onnx"
    onnx.save(helper.make_model(helper.make_graph([node], "g", [x], [y])), str(path))
    with pytest.raises(EngineBuildError, match="node 'broken_node' \\(NoSuchOp\\)"):
        build_engine_file(tmp_path / "bad.engine", path, STAGE_MODELS["unet"](tiny), {},
                          BuildOptions("tensorrt-rtx", 0, target_ccs=TARGETS), QUIET)


def test_backend_errors_and_auto_choice():
    with pytest.raises(UsageError, match="tensorrt is not installed .*pip install tensorrt"):
        select_backend("tensorrt", cc=(8, 6))
    with pytest.raises(UsageError, match=r"tensorrt-rtx cannot run on this GPU \(compute capability 9.0\); "
                                         r"use --backend tensorrt or --backend torch"):
        select_backend("tensorrt-rtx", cc=(9, 0))
    backend, reason = select_backend("auto", cc=(9, 0))
    assert backend == "torch" and "compute capability 9.0" in reason and "pip install tensorrt" in reason
    assert select_backend("auto", cc=(8, 6))[0] == "tensorrt-rtx"
    assert select_backend("tensorrt-rtx", cc=(8, 9))[0] == "tensorrt-rtx"


def test_build_engines_script_on_a_model_directory(tiny, tmp_path, capsys):
    from scripts.build_engines import main

    args = ["--model", str(tiny.path), "--onnx-dir", str(tmp_path / "onnx"), "--engine-dir", str(tmp_path / "engine"),
            "--optimization-level", "0", "--build-static-batch",
            "--timing-cache", str(tmp_path / "timing.cache")]
    assert main(args) == 0
    out = capsys.readouterr().out
    for stage in ("clip", "unet", "vae"):
        assert (tmp_path / "engine" / f"{stage}.engine").stat().st_size > 0
        assert stage in out
    assert "engine MiB" in out and "targets 8.0,8.6,8.9" in out  # no GPU, no --target-cc: the CPU default
    assert (tmp_path / "timing.cache").is_file()


@pytest.mark.parametrize("args, message", [
    (["--backend", "tensorrt"], "tensorrt is not installed"),
    (["--target-cc", "eight"], "--target-cc takes compute capabilities"),
    (["--target-cc", "9.0"], "cannot target compute capability 9.0"),
    (["--target-cc", "8.6", "--stages", "unet,text"], "unknown stage(s) text"),
    (["--target-cc", "8.6", "--height", "60"], "multiple of 8"),
    (["--target-cc", "8.6", "--use-cuda-graph"], "--use-cuda-graph needs static shapes"),
])
def test_build_engines_usage_errors(args, message, tmp_path, capsys):
    from scripts.build_engines import main

    base = ["--onnx-dir", str(tmp_path / "onnx"), "--engine-dir", str(tmp_path / "engine")]
    if "--stages" not in args:
        base += ["--stages", "clip"]
    status = main(base + args)
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and message in err[0], err
    assert not (tmp_path / "engine").exists() or not list((tmp_path / "engine").glob("*.engine"))

