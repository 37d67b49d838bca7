"""TensorRT for RTX engines built on the CPU: cache keys, reuse, recovery, errors. Engines execute only on
a GPU (tests/test_engines_gpu.py); the runtime is tested on the CPU with a stand-in TensorRT in
tests/test_engine_runtime.py.
"""

import sys

import onnx
import onnx.helper as helper
import pytest
import torch

pytest.importorskip("tensorrt_rtx", reason="tensorrt-rtx-cu13 is not installed")

from core.artifacts import read_manifest  # noqa: E402
from core.errors import UsageError  # noqa: E402
from demo.backends.base import Workload  # noqa: E402
from demo.backends.registry import select_backend  # noqa: E402
from demo.backends.tensorrt.build import (  # noqa: E402
    BuildOptions,
    EngineBuildError,
    EngineSettings,
    ImageProfile,
    build_engine_file,
    engine_key,
    prepare_engine,
    prepare_stage_engines,
)
from demo.backends.tensorrt.flavour import TensorRTAPI  # noqa: E402
from demo.backends.tensorrt.options import EngineOptions  # noqa: E402
from demo.backends.tensorrt.settings import engine_settings  # noqa: E402
from models import CLIP, STAGE_MODELS, UNET, VAE  # noqa: E402

TARGETS = ((8, 0), (8, 6), (8, 9))
QUIET = lambda *_: None  # noqa: E731


@pytest.fixture(scope="module")
def built(tiny, tmp_path_factory):
    """fp16 engines for the CPU's default targets, as a GPU run would look for them."""
    root = tmp_path_factory.mktemp("engines")
    profile = ImageProfile.for_request(tiny, batch_size=2, height=64, width=48, static_batch=False, dynamic_shape=False)
    options = BuildOptions("tensorrt-rtx", optimization_level=0)
    settings = EngineSettings(root / "onnx", root / "engine", profile, options)
    models = [STAGE_MODELS[name](tiny) for name in (CLIP, UNET, VAE)]  # tiny's text-to-image stages
    engines = prepare_stage_engines(models, settings, "cpu", torch.float16, QUIET, QUIET)
    return settings, models, engines


def test_engines_are_keyed_by_what_made_them(built):
    settings, models, engines = built
    for model in models:
        key = read_manifest(engines[model.name])["key"]
        assert key["onnx"] == {k: v for k, v in model.optimized_onnx_key(torch.float16).items() if k != "torch"}
        assert key["flavour"] == "tensorrt-rtx" and key["target_cc"] == ["8.0", "8.6", "8.9"]
    unet_shapes = read_manifest(engines["unet"])["key"]["shapes"]
    assert unet_shapes["sample"] == [[2, 4, 32, 24], [4, 4, 32, 24], [8, 4, 32, 24]]  # guided: twice the images


def test_engines_built_on_a_cpu_are_reused_on_a_gpu_they_target(built, monkeypatch):
    settings, models, engines = built
    log, exported = [], []

    def export(*args, **kwargs):
        exported.append(args)
        raise LookupError("export asked for")

    monkeypatch.setattr("demo.backends.tensorrt.build.current_cc", lambda: (8, 6))  # now "on" an RTX 30 / A10
    monkeypatch.setattr("models.base.StageModel.prepare_onnx", export)
    gpu_settings = EngineSettings(settings.onnx_dir, settings.engine_dir, settings.profile,
                                  BuildOptions("tensorrt-rtx", optimization_level=0))
    prepare_stage_engines(models, gpu_settings, "cpu", torch.float16, log.append, QUIET)
    assert log == [f"[cache] {m.name}.engine: up to date" for m in models] and exported == []
    # a T4: not among the targets, so rebuilt
    monkeypatch.setattr("demo.backends.tensorrt.build.current_cc", lambda: (7, 5))
    with pytest.raises(LookupError, match="export asked for"):
        prepare_stage_engines(models[:1], gpu_settings, "cpu", torch.float16, log.append, QUIET)
    assert "stale (target_cc changed)" in log[-1] and len(exported) == 1


def test_reuse_truncation_and_corruption_rebuild(built):
    settings, models, engines = built
    vae = models[2]
    shapes = settings.profile.stage_shapes(vae, guided=True)

    def prepare(log):
        prepare_engine(vae, vae.optimized_onnx_key(torch.float16), lambda: settings.onnx_dir / "vae.opt.onnx",
                       settings.engine_dir, shapes, settings.options, log=log.append, progress=QUIET)

    log = []
    prepare(log)
    assert log == ["[cache] vae.engine: up to date"]
    engine = engines["vae"]
    good = engine.read_bytes()
    engine.write_bytes(good[: len(good) // 2])
    log.clear()
    prepare(log)
    assert "truncated or corrupt" in log[0]
    assert engine.stat().st_size == read_manifest(engine)["files"]["vae.engine"]["size"]
    flipped = bytearray(engine.read_bytes())
    flipped[len(flipped) // 2] ^= 0xFF
    engine.write_bytes(bytes(flipped))
    log.clear()
    prepare(log)
    assert "content hash differs" in log[0]
    assert not list(settings.engine_dir.glob(".*build-*"))  # no staging leftovers


def test_cache_key_follows_onnx_shapes_flavour_and_settings(built, tiny):
    settings, models, _ = built
    unet = models[1]
    api = TensorRTAPI("tensorrt-rtx")
    onnx_key = unet.optimized_onnx_key(torch.float16)
    shapes = settings.profile.stage_shapes(unet, guided=True)
    base = engine_key(unet, onnx_key, shapes, settings.options, api)
    other_shapes = ImageProfile.for_request(tiny, 2, 64, 64, False, False).stage_shapes(unet, guided=True)
    assert engine_key(unet, onnx_key, other_shapes, settings.options, api) != base
    assert engine_key(unet, unet.optimized_onnx_key(torch.float32), shapes, settings.options, api) != base
    assert engine_key(unet, dict(onnx_key, torch="0.0"), shapes, settings.options, api) == base  # exporter's torch
    for options in (BuildOptions("tensorrt-rtx", 0, target_ccs=((8, 6),)),
                    BuildOptions("tensorrt-rtx", 1),
                    BuildOptions("tensorrt-rtx", 0, disabled_tactic_sources=("CUDNN",)),
                    BuildOptions("tensorrt-rtx", 0, enabled_tactic_sources=("CUBLAS_LT",))):
        assert engine_key(unet, onnx_key, shapes, options, api) != base
    assert "enabled_tactic_sources" not in base  # keys made before the setting existed still find their engines


def test_onnx_parse_error_names_the_node(tmp_path, tiny):
    x = helper.make_tensor_value_info("sample", onnx.TensorProto.FLOAT, [1, 4])
    y = helper.make_tensor_value_info("latent", onnx.TensorProto.FLOAT, [1, 4])
    node = helper.make_node("NoSuchOp", ["sample"], ["latent"], name="broken_node")
    path = tmp_path / "bad.onnx"
    onnx.save(helper.make_model(helper.make_graph([node], "g", [x], [y])), str(path))
    with pytest.raises(EngineBuildError, match="node 'broken_node' \\(NoSuchOp\\)"):
        build_engine_file(tmp_path / "bad.engine", path, STAGE_MODELS["unet"](tiny), {},
                          BuildOptions("tensorrt-rtx", 0, target_ccs=TARGETS), QUIET)


def test_backend_errors_and_auto_choice(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # as where full TensorRT is not installed
    with pytest.raises(UsageError, match="tensorrt is not installed .*pip install tensorrt"):
        select_backend("tensorrt", cc=(8, 6))
    with pytest.raises(UsageError, match=r"tensorrt-rtx cannot run on this GPU \(compute capability 9.0\); "
                                         r"use backend tensorrt or backend torch"):
        select_backend("tensorrt-rtx", cc=(9, 0))
    backend, reason = select_backend("auto", cc=(9, 0))
    assert backend.name == "torch" and "compute capability 9.0" in reason and "pip install tensorrt" in reason
    assert select_backend("auto", cc=(8, 6))[0].name == "tensorrt-rtx"
    assert select_backend("tensorrt-rtx", cc=(8, 9))[0].name == "tensorrt-rtx"


def test_build_engines_script_on_a_model_directory(tiny, tmp_path, capsys):
    from demo.cli.build_engines import main

    args = ["--model", str(tiny.path), "--onnx-dir", str(tmp_path / "onnx"), "--engine-dir", str(tmp_path / "engine"),
            "--optimization-level", "0", "--build-static-batch",
            "--timing-cache", str(tmp_path / "timing.cache")]
    assert main(args) == 0
    captured = capsys.readouterr()
    for stage in ("clip", "unet", "vae"):
        assert (tmp_path / "engine" / f"{stage}.engine").stat().st_size > 0
        assert stage in captured.out
    assert "engine MiB" in captured.out and "targets 8.0,8.6,8.9" in captured.out  # no GPU: the CPU default
    # No GPU to time tactics on: the cache is neither read nor written, and that is said once.
    assert not (tmp_path / "timing.cache").exists()
    assert captured.err.count("--timing-cache") == 1 and "not used without a GPU" in captured.err


@pytest.mark.parametrize("args, message", [
    (["--backend", "tensorrt"], "tensorrt is not installed"),
    (["--target-cc", "eight"], "--target-cc takes compute capabilities"),
    (["--target-cc", "9.0"], "cannot target compute capability 9.0"),
    (["--target-cc", "8.6", "--stages", "unet,text"], "unknown stage(s) text"),
    (["--target-cc", "8.6", "--height", "60"], "multiple of 8"),
    (["--target-cc", "8.6", "--use-cuda-graph", "--build-dynamic-shape"], "--use-cuda-graph needs static shapes"),
    (["--target-cc", "8.6", "--batch-size", "4", "--max-batch-size", "2"],
     "--max-batch-size must be at least --batch-size (4)"),
    (["--target-cc", "8.6", "--build-static-batch", "--max-batch-size", "4"],
     "or equal to it with --build-static-batch"),
])
def test_build_engines_usage_errors(args, message, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # as where full TensorRT is not installed
    from demo.cli.build_engines import main

    base = ["--onnx-dir", str(tmp_path / "onnx"), "--engine-dir", str(tmp_path / "engine")]
    if "--stages" not in args:
        base += ["--stages", "clip"]
    status = main(base + args)
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and message in err[0], err
    assert not (tmp_path / "engine").exists() or not list((tmp_path / "engine").glob("*.engine"))



def test_cuda_graphs_get_the_static_engines_they_need(tiny, tmp_path, capsys):
    """--use-cuda-graph without --build-static-batch builds engines for exactly the request, and says so."""
    options = EngineOptions(onnx_dir=str(tmp_path / "onnx"), engine_dir=str(tmp_path / "engine"), target_cc="8.6")
    settings = engine_settings(options, tiny, "tensorrt-rtx", Workload(2, 64, 64), "none", True)
    assert settings.profile.static and settings.profile.batch == (2, 2, 2) and settings.use_cuda_graph
    assert "engines built for exactly batch 2" in capsys.readouterr().err
    plain = engine_settings(options, tiny, "tensorrt-rtx", Workload(2, 64, 64), "none", None)
    assert not plain.profile.static and not plain.use_cuda_graph and capsys.readouterr().err == ""


@pytest.mark.parametrize("static_batch, dynamic_shape, given, expected", [
    (True, False, None, True),  # engines for exactly the request: graphs by default
    (True, False, False, False),  # --no-use-cuda-graph
    (False, False, None, False),  # a batch range: no graphs
    (True, True, None, False),  # any height and width: no graphs
])
def test_cuda_graphs_are_on_by_default_where_the_engines_are_static(tiny, tmp_path, static_batch, dynamic_shape,
                                                                     given, expected):
    options = EngineOptions(onnx_dir=str(tmp_path / "onnx"), engine_dir=str(tmp_path / "engine"), target_cc="8.6",
                            build_static_batch=static_batch, build_dynamic_shape=dynamic_shape)
    settings = engine_settings(options, tiny, "tensorrt-rtx", Workload(1, 64, 64), "none", given)
    assert settings.use_cuda_graph is expected


@pytest.mark.parametrize("enable, disable, message", [
    ("CUDNN", "cudnn", "tactic source CUDNN both enabled and disabled"),
    ("CUBLAS9", None, "has no tactic source CUBLAS9"),
])
def test_tactic_source_flags_are_checked_before_any_export(tiny, tmp_path, enable, disable, message):
    options = EngineOptions(onnx_dir=str(tmp_path / "onnx"), engine_dir=str(tmp_path / "engine"), target_cc="8.6",
                            enable_tactic_sources=enable, disable_tactic_sources=disable)
    with pytest.raises(UsageError, match=message):
        engine_settings(options, tiny, "tensorrt-rtx", Workload(1, 64, 64), "none", None)
    assert not (tmp_path / "onnx").exists() or not any((tmp_path / "onnx").iterdir())


def test_sdxl_engines_build_for_every_stage(tmp_path, capsys):
    """tiny-xl: both text encoders, the UNet with its added conditions, and the VAE in fp32 (force_upcast) while
    the rest is fp16, built by TensorRT for RTX on the CPU."""
    import onnx

    from demo.cli.build_engines import main

    args = ["--model", "tiny-xl", "--target-cc", "8.6", "--optimization-level", "0", "--plugins", "none",
            "--onnx-dir", str(tmp_path / "onnx"), "--engine-dir", str(tmp_path / "engine")]
    assert main(args) == 0
    for stage in ("clip", "clip2", "unet", "vae"):
        assert (tmp_path / "engine" / f"{stage}.engine").stat().st_size > 0
    inputs = {stage: {i.name: i.type.tensor_type.elem_type for i in
                      onnx.load(str(tmp_path / "onnx" / f"{stage}.opt.onnx"), load_external_data=False).graph.input}
              for stage in ("unet", "vae")}
    assert set(inputs["unet"]) == {"sample", "timestep", "encoder_hidden_states", "text_embeds", "time_ids"}
    assert inputs["unet"]["text_embeds"] == onnx.TensorProto.FLOAT16
    assert inputs["vae"]["latent"] == onnx.TensorProto.FLOAT
    outputs = [o.name for o in onnx.load(str(tmp_path / "onnx" / "clip2.opt.onnx")).graph.output]
    assert outputs == ["text_embeddings", "text_embeds"]
