"""Each stage model's ONNX export is valid, dynamic, and matches PyTorch; the optimizer keeps outputs."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from models import STAGE_MODELS

# A batch and image size different from the export's, so the dynamic axes are exercised.
BATCH, HEIGHT, WIDTH = 3, 48, 80


@pytest.fixture(scope="module")
def onnx_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("onnx")


def _run_onnx(path, inputs):
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {k: v.numpy() for k, v in inputs.items()})


EXPORTS = [("tiny", stage) for stage in ("clip", "unet", "vae", "vae_encoder")] + \
    [("tiny-xl", stage) for stage in ("clip", "clip2", "unet", "vae")] + \
    [("tiny-sd3", stage) for stage in ("t5", "transformer")] + [("tiny-flux", "t5"), ("tiny-flux", "flux_transformer"),
                                                             ("tiny-flux-schnell", "flux_transformer")]


@pytest.mark.parametrize("builtin, stage", EXPORTS)
def test_export_matches_torch(builtin, stage, onnx_dir):
    from models.source import resolve_model

    model = STAGE_MODELS[stage](resolve_model(builtin))
    onnx_dir = onnx_dir if builtin == "tiny" else onnx_dir / builtin  # later tests reuse tiny's exports
    optimized = model.prepare_onnx(onnx_dir, "cpu", torch.float32, log=lambda *_: None)
    exported = onnx_dir / f"{stage}.onnx"
    for path in (exported, optimized):
        onnx.checker.check_model(str(path))
        graph = onnx.load(str(path)).graph
        assert [i.name for i in graph.input] == list(model.input_names)
        assert [o.name for o in graph.output] == list(model.output_names)
    assert onnx.load(str(exported)).opset_import[0].version >= 17

    inputs = model.sample_inputs(BATCH, HEIGHT, WIDTH, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        references = model.load_module()(*(inputs[n] for n in model.input_names))
    references = references if isinstance(references, tuple) else (references,)
    expected_shapes = model.output_shapes(BATCH, HEIGHT, WIDTH)
    raw_outs, opt_outs = _run_onnx(exported, inputs), _run_onnx(optimized, inputs)
    for name, reference, raw_out, opt_out in zip(model.output_names, references, raw_outs, opt_outs, strict=True):
        reference = reference.numpy()
        assert reference.shape == raw_out.shape == expected_shapes[name]
        scale = np.abs(reference).max()
        assert np.abs(raw_out - reference).max() <= 1e-4 * scale
        # The optimizer must not change what the graph computes.
        assert np.abs(opt_out - raw_out).max() <= 1e-5 * scale


def test_optimizer_reports_and_shrinks(tiny, onnx_dir, capsys):
    from models.optimizer import GraphOptimizer

    model = STAGE_MODELS["unet"](tiny)
    model.prepare_onnx(onnx_dir, "cpu", torch.float32, log=lambda *_: None)
    optimizer = GraphOptimizer(onnx.load(str(onnx_dir / "unet.onnx")), "unet")
    optimized = optimizer.run()
    names = [name for name, _ in optimizer.history]
    assert names == ["exported", "cleanup", "fold-constants", "cleanup"]
    counts = dict(optimizer.history)
    assert counts["fold-constants"] < counts["exported"]
    assert counts["exported"] == len(onnx.load(str(onnx_dir / "unet.onnx")).graph.node)  # read independently
    assert optimizer.report().startswith("[optimize] unet: nodes exported")
    # Folding inferred every intermediate tensor's shape (what the plugin passes read).
    intermediate = {name for node in optimized.graph.node for name in node.output} - {
        output.name for output in optimized.graph.output}
    assert intermediate and intermediate <= {info.name for info in optimized.graph.value_info
                                             if info.type.tensor_type.HasField("shape")}


def test_shape_profile_follows_model_config(tiny):
    unet = STAGE_MODELS["unet"](tiny)
    profile = unet.shape_profile(batch=(2, 2, 8), height=(32, 64, 128), width=(32, 64, 96))
    factor = tiny.vae_scale_factor
    assert factor == 2  # tiny's VAE has two blocks: nothing may assume SD's 8
    assert profile["sample"] == ((2, 4, 32 // factor, 32 // factor), (2, 4, 64 // factor, 64 // factor),
                                 (8, 4, 128 // factor, 96 // factor))
    assert profile["encoder_hidden_states"][2] == (8, 77, 32)
    clip = STAGE_MODELS["clip"](tiny)
    assert clip.shape_profile((1, 2, 4), (64,) * 3, (64,) * 3) == {"input_ids": ((1, 77), (2, 77), (4, 77))}
    assert clip.sample_inputs(2, 64, 64)["input_ids"].dtype == torch.int32


def test_fp16_export_stays_fp16_and_the_optimizer_flags_fp32_islands(tiny, tmp_path):
    """CLIP traced through SDPA turns fp32 after its first layer; the export path must not, and the
    optimizer report must say so when a graph does."""
    from models.optimizer import GraphOptimizer

    clip = STAGE_MODELS["clip"](tiny)
    clip.export_onnx(tmp_path / "clip.onnx", "cpu", torch.float16)
    clean = GraphOptimizer(onnx.load(str(tmp_path / "clip.onnx")), "clip")
    clean.run()
    assert clean.precision_warning() is None

    ids = clip.sample_inputs(2, 64, 64)["input_ids"]
    sdpa_module = clip.load_module(attn_implementation="sdpa").half().eval()
    torch.onnx.export(sdpa_module, (ids,), str(tmp_path / "sdpa.onnx"), input_names=["input_ids"],
                      output_names=["text_embeddings"], opset_version=17, dynamo=False)
    mixed = GraphOptimizer(onnx.load(str(tmp_path / "sdpa.onnx")), "clip")
    mixed.run()
    assert "MatMul/Conv/Gemm nodes compute in fp32 in an fp16 model" in mixed.report()
    clip.export_onnx(tmp_path / "clip32.onnx", "cpu", torch.float32)
    fp32 = GraphOptimizer(onnx.load(str(tmp_path / "clip32.onnx")), "clip")
    fp32.run()
    assert fp32.precision_warning() is None  # plain fp32 graphs are not flagged


def _weights_and_constant(weight_values: int, constant_values: int) -> onnx.ModelProto:
    """y = x + w + c (broadcast): w an initializer, c a Constant node's tensor (not an initializer, so not in
    weight_bytes)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal(weight_values).astype(np.float32), "w")
    c = numpy_helper.from_array(rng.standard_normal((constant_values, 1)).astype(np.float32), "c_value")
    nodes = [helper.make_node("Constant", [], ["c"], value=c), helper.make_node("Add", ["x", "w"], ["xw"]),
             helper.make_node("Add", ["xw", "c"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializer=[w])
    return helper.make_model(graph, ir_version=8, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("threshold, external", [
    (10**6, False),  # everything fits
    (2000, True),  # the initializer alone is over: never serialized whole
    (4000 * 4 + 10, True),  # the initializer fits, the whole model (its Constant's tensor too) does not
])
def test_save_onnx_goes_external_by_the_whole_models_size(threshold, external, tmp_path, monkeypatch):
    from models.onnx_io import save_onnx, weight_bytes

    monkeypatch.setattr("models.onnx_io.EXTERNAL_DATA_THRESHOLD", threshold)
    model = _weights_and_constant(4000, 1000)
    assert weight_bytes(model) == 4000 * 4
    x = np.array([0.5], np.float32)
    expected = x + onnx.numpy_helper.to_array(model.graph.initializer[0]) + onnx.numpy_helper.to_array(
        model.graph.node[0].attribute[0].t)
    save_onnx(model, tmp_path / "m.onnx")
    assert (tmp_path / "m.onnx.data").exists() == external
    assert [t.name for t in onnx.load(str(tmp_path / "m.onnx")).graph.initializer] == ["w"]
    np.testing.assert_array_equal(ort.InferenceSession(str(tmp_path / "m.onnx")).run(None, {"x": x})[0], expected)


def test_large_models_keep_weights_in_one_external_file(tiny, tmp_path, monkeypatch):
    """Above the protobuf limit (lowered here) weights go to `<stage>.onnx.data`, cached with the graph."""
    from core.artifacts import read_manifest

    monkeypatch.setattr("models.onnx_io.EXTERNAL_DATA_THRESHOLD", 1024)
    model = STAGE_MODELS["vae"](tiny)
    optimized = model.prepare_onnx(tmp_path, "cpu", torch.float32, log=lambda *_: None)
    assert set(read_manifest(tmp_path / "vae.onnx")["files"]) == {"vae.onnx", "vae.onnx.data"}
    assert set(read_manifest(optimized)["files"]) == {"vae.opt.onnx", "vae.opt.onnx.data", "vae.opt.onnx.passes.json"}
    assert (tmp_path / "vae.opt.onnx.data").stat().st_size > 10 * optimized.stat().st_size
    onnx.checker.check_model(str(optimized))
    inputs = model.sample_inputs(1, 32, 40, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        reference = model.load_module()(inputs["latent"]).numpy()
    assert np.abs(_run_onnx(optimized, inputs)[0] - reference).max() <= 1e-4 * np.abs(reference).max()
