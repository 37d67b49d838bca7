"""LoRA on engines by refit (issue 19, part 4), on the CPU.

(a) tiny (fp32) and tiny-xl (fp16), every plugin pass on: the refit core's values (models.refit) for the base
    optimized ONNX and two LoRA files (diffusers/PEFT and kohya, to_q/to_k/to_v/to_out, the feed-forward, convolutions,
    the text encoders' q/k/v) are the initializers of the ONNX exported from the torch modules with those LoRAs fused,
    every one of them by name, packed QKV and KV included, bit for bit; no LoRA again gives the base bytes.
(b) --plugins none: the refitted ONNX, run in ONNX Runtime, computes what the fused torch module does.
(c) the engine path through the stand-in TensorRT (tests/fake_tensorrt.py, whose Refitter takes weights by
    initializer name, asks for the biases fused with what is set, and runs the refitted ONNX): the names set, the
    missing weights supplied, the image of the refitted engines against the torch pipeline's with the LoRA fused,
    the way back to the base image, and the one-line refusal of engines built without --build-enable-refit.
"""

import json
from dataclasses import replace

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import safetensors.torch
import torch
from onnx import numpy_helper

from core.errors import UsageError
from demo.backends.tensorrt.build import built_from, built_from_path
from demo.backends.tensorrt.options import EngineOptions
from demo.pipelines import StageTimer, make_pipeline
from demo.request import Request
from demo.runtime.loader import load_pipeline
from demo.runtime.spec import PipelineSpec
from models import STAGE_MODELS, text_to_image_stages
from models.families import SDXL
from models.lora import LoraFusion, lora_deltas, model_targets, read_lora
from models.provenance import Provenance, ProvenanceError, check_provenance
from models.refit import RefitWeights, read_initializers
from models.source import resolve_model
from plugins.contract import PLUGIN_KEYS
from tests.parity import torch_stages

ALL = tuple(sorted(PLUGIN_KEYS))
QUIET = lambda *_: None  # noqa: E731
CPU = torch.device("cpu")
RANK = 4
# What the LoRA files change, by how the module's path ends (the first such module of each component): the packed
# QKV (attn1's to_q and to_v, not to_k), fMHCA's own q and packed KV (attn2), the outputs, the feed-forward, a 3x3
# and a 1x1 convolution, a Gemm; the text encoders' q, k and v and more.
UNET_MODULES = (".attn1.to_q", ".attn1.to_v", ".attn2.to_q", ".attn2.to_k", ".attn2.to_v", ".attn1.to_out.0",
                ".ff.net.0.proj", ".ff.net.2", "resnets.0.conv1", ".proj_in", "time_emb_proj")
TEXT_MODULES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj", "mlp.fc1")
KOHYA = {"unet": "lora_unet_", "text_encoder": "lora_te1_", "text_encoder_2": "lora_te2_"}


def lora_modules(targets, last_layer: bool) -> dict[str, list[str]]:
    """Component -> the module paths the LoRA files change; with `last_layer` also the last text-encoder layer's
    q_proj (which an SDXL export, taking the penultimate states, does not hold: its delta must change nothing)."""
    chosen = {}
    for component, paths in targets.items():
        endings = UNET_MODULES if component == "unet" else TEXT_MODULES
        chosen[component] = [next(path for path in paths if path.endswith(ending)) for ending in endings]
        if last_layer and component != "unet":
            chosen[component].append(sorted(p for p in paths if p.endswith("self_attn.q_proj"))[-1])
    return chosen


def write_lora(path, targets, modules, form: str, seed: int):
    """A LoRA file of random non-zero weights for `modules`: diffusers/PEFT keys, or kohya keys with alphas."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for component, paths in modules.items():
        for module in paths:
            out, inputs, *kernel = targets[component][module]
            down = torch.randn(RANK, inputs, *kernel, generator=generator) * 0.2
            up = torch.randn(out, RANK, *[1] * len(kernel), generator=generator) * 0.2
            if form == "peft":
                stem = f"{component}.{module}"
                tensors[f"{stem}.lora_A.weight"], tensors[f"{stem}.lora_B.weight"] = down, up
            else:
                stem = KOHYA[component] + module.replace(".", "_")
                tensors[f"{stem}.lora_down.weight"], tensors[f"{stem}.lora_up.weight"] = down, up
                tensors[f"{stem}.alpha"] = torch.tensor(2.0)
    safetensors.torch.save_file(tensors, str(path))
    return read_lora(path)


def loras_for(source, folder):
    targets = model_targets(source)
    modules = lora_modules(targets, last_layer=source.family is SDXL)
    first = write_lora(folder / "peft.safetensors", targets, modules, "peft", seed=1)
    half = {component: paths[::2] for component, paths in modules.items()}  # overlapping: the deltas add up
    second = write_lora(folder / "kohya.safetensors", targets, half, "kohya", seed=2)
    return [(first, 0.7), (second, -0.4)]


def optimized_onnx(model, onnx_dir, dtype, plugins, loras=()):
    """The stage's optimized ONNX, exported from its module with `loras` fused in (in `dtype`, as the engines' are)."""
    if loras:
        module = model.export_module().to(dtype=dtype).eval()
        fuse(model, module, loras)
        model.export_module = lambda: module
    return model.prepare_onnx(onnx_dir, "cpu", dtype, log=QUIET, plugins=plugins)


def fuse(model, module, loras) -> None:
    """The LoRAs' layers for the stage's component fused into `module` (what load_module or export_module gave)."""
    own = [(replace(lora, layers=tuple(layer for layer in lora.layers if layer.component == model.component)), scale)
           for lora, scale in loras]
    LoraFusion({model.component: model.component_module(module)}).set(own)


def initializers(path) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}


def stage_deltas(loras, source, component) -> dict[str, np.ndarray]:
    return {name: delta.numpy() for owner, name, delta in lora_deltas(loras, model_targets(source))
            if owner == component}


# ---- (a) the refit core against a fused export, all plugin passes on ------------------------------------------------

@pytest.fixture(scope="module", params=[("tiny", torch.float32), ("tiny-xl", torch.float16)],
                ids=["tiny-fp32", "tiny-xl-fp16"])
def exports(request, tmp_path_factory):
    """Per LoRA stage: (model, base optimized ONNX, fused optimized ONNX) with every plugin pass, and the LoRAs."""
    name, dtype = request.param
    source = resolve_model(name)
    folder = tmp_path_factory.mktemp(name)
    loras = loras_for(source, folder)
    stages = {}
    for stage in text_to_image_stages(source):
        if STAGE_MODELS[stage].takes_lora:
            base = optimized_onnx(STAGE_MODELS[stage](source), folder / "base", dtype, ALL)
            fused = optimized_onnx(STAGE_MODELS[stage](source), folder / "fused", dtype, ALL, loras)
            stages[stage] = (STAGE_MODELS[stage](source), base, fused)
    return source, loras, stages


def test_refit_values_are_the_fused_exports_initializers(exports):
    """Exact: both sides add the same float32 delta (lora_deltas) to the same float32 base (fp16 widens exactly)
    and round once to the initializer's type; packing moves values without arithmetic. So no tolerance."""
    source, loras, stages = exports
    for stage, (model, base_path, fused_path) in stages.items():
        provenance = Provenance.read(base_path)
        refit = RefitWeights(provenance, lambda names, path=base_path: read_initializers(path, names))
        deltas = stage_deltas(loras, source, model.component)
        planned = refit.plan(deltas)
        base, fused = initializers(base_path), initializers(fused_path)
        assert set(base) == set(fused), stage
        for name in base:
            expected = planned.get(name, base[name])
            assert expected.dtype == fused[name].dtype and np.array_equal(expected, fused[name]), f"{stage}: {name}"
        changed = {name for name in base if not np.array_equal(base[name], fused[name])}
        assert changed and changed <= set(planned), stage
        if stage == "unet":  # the packed projections carry the deltas of their parts: provenance is not ignored
            for packed in ("/qkv/weight", "/q/weight", "/kv/weight"):
                assert any(name.endswith(packed) for name in changed), packed
            projections = [name for name in planned if any(part.parameter.endswith(("to_q.weight", "to_k.weight",
                                                                                     "to_v.weight"))
                                                           for part in provenance.records[name])]
            assert projections and all(name.endswith(("/qkv/weight", "/q/weight", "/kv/weight"))
                                       for name in projections)  # the fused ones only: the plain ones are gone
        refit.commit(deltas)
        back = refit.plan({})  # no LoRA again: every initializer changed goes back to the base bytes
        assert set(back) == set(planned)
        assert all(back[name].tobytes() == base[name].tobytes() for name in back), stage


def test_every_weight_of_the_optimized_graph_is_recorded_and_checked(exports):
    """Every MatMul/Gemm/Conv weight has a record that holds exactly its parameters; a pass that forgets to record
    a weight it makes fails the check."""
    import onnx_graphsurgeon as gs

    _, _, stages = exports
    model, base_path, _ = stages["unet"]
    provenance = Provenance.read(base_path)
    assert provenance.component == "unet" and provenance.weights <= provenance.parameters()
    packed = [parts for name, parts in provenance.records.items() if name.endswith("/qkv/weight")]
    assert packed and [part.parameter.rsplit(".", 2)[-2] for part in packed[0]] == ["to_q", "to_k", "to_v"]
    graph = gs.import_onnx(onnx.load(str(base_path)))
    check_provenance(graph, provenance)  # as the optimizer did
    forgotten = next(name for name in provenance.records if name.endswith("/kv/weight"))
    with pytest.raises(ProvenanceError, match="no record"):
        check_provenance(graph, Provenance(provenance.component, {k: v for k, v in provenance.records.items()
                                                                  if k != forgotten},
                                           provenance.digests, provenance.weights))
    swapped = dict(provenance.records)
    qkv = next(name for name in swapped if name.endswith("/qkv/weight"))
    q, k, v = swapped[qkv]
    swapped[qkv] = (replace(q, parameter=k.parameter), replace(k, parameter=q.parameter), v)  # to_q and to_k mixed up
    with pytest.raises(ProvenanceError, match="does not hold"):
        check_provenance(graph, Provenance(provenance.component, swapped, provenance.digests, provenance.weights))


def test_an_untraceable_weight_leaves_the_onnx_usable_and_refuses_only_the_refit(exports, tmp_path):
    """A model whose provenance does not hold still optimizes (its engines build as ever); the record says why,
    and a refit refuses in one line."""
    from models.optimizer import GraphOptimizer

    _, _, stages = exports
    _, base_path, _ = stages["unet"]
    provenance = Provenance.read(base_path)
    forgotten = next(name for name in provenance.records if name.endswith("/kv/weight"))
    incomplete = Provenance(provenance.component, {k: v for k, v in provenance.records.items() if k != forgotten},
                            provenance.digests, provenance.weights)
    checked = GraphOptimizer(onnx.load(str(base_path)), "unet", incomplete).checked_provenance()
    assert "no record" in checked.problem and not checked.records
    checked.write(tmp_path / "unet.opt.onnx")
    with pytest.raises(ProvenanceError, match="^unet: its engine cannot take a LoRA by refit: .*no record"):
        Provenance.read(tmp_path / "unet.opt.onnx").check_usable("unet")
    provenance.check_usable("unet")  # the whole record is usable


# ---- (b) plugins none: the refitted ONNX computes what the fused torch module does -------------------------------

@pytest.mark.parametrize("stage", ["clip", "unet"])
def test_refitted_onnx_runs_as_the_fused_module(stage, tmp_path):
    source = resolve_model("tiny")
    loras = loras_for(source, tmp_path)
    model = STAGE_MODELS[stage](source)
    base_path = optimized_onnx(model, tmp_path / "onnx", torch.float32, ())
    planned = RefitWeights(Provenance.read(base_path), lambda names: read_initializers(base_path, names)).plan(
        stage_deltas(loras, source, model.component))
    refitted = onnx.load(str(base_path))
    for tensor in refitted.graph.initializer:
        if tensor.name in planned:
            tensor.CopyFrom(numpy_helper.from_array(planned[tensor.name], tensor.name))
    module = model.load_module().eval()
    fuse(model, module, loras)
    inputs = model.sample_inputs(3, 48, 80, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = module(*(inputs[n] for n in model.input_names))
    session = ort.InferenceSession(refitted.SerializeToString(), providers=["CPUExecutionProvider"])
    (actual, *_) = session.run(None, {name: value.numpy() for name, value in inputs.items()})
    expected = (expected[0] if isinstance(expected, tuple) else expected).numpy()
    base = ort.InferenceSession(str(base_path), providers=["CPUExecutionProvider"]).run(
        None, {name: value.numpy() for name, value in inputs.items()})[0]
    scale = np.abs(expected).max()
    assert np.abs(actual - expected).max() <= 1e-4 * scale
    assert np.abs(base - expected).max() > 1e-2 * scale  # the LoRA changes the output: the check is not empty


# ---- (c) the engine path, through the stand-in TensorRT -------------------------------------------------------------

HEIGHT = WIDTH = 32


@pytest.fixture
def trt(monkeypatch):
    from tests import fake_tensorrt

    return fake_tensorrt.install(monkeypatch, "8.6.0")


def engine_spec(folder, refit: bool, device: str = "cpu", **engine) -> PipelineSpec:
    """tiny's text-to-image on engines at the test's size, in fp32 on the CPU (the stand-in TensorRT) or fp16."""
    options = EngineOptions(onnx_dir=str(folder / "onnx"), engine_dir=str(folder / "engine"), build_static_batch=True,
                            optimization_level=0, build_enable_refit=refit, **engine)
    return PipelineSpec(model="tiny", backend="tensorrt", precision="fp32" if device == "cpu" else "fp16",
                        plugins="none", modes=("text-to-image",), height=HEIGHT, width=WIDTH, scheduler="DDIM",
                        engine=options)


def engine_pipeline(folder, refit: bool):
    return load_pipeline(engine_spec(folder, refit), CPU, progress=QUIET)


REQUEST = Request("a castle", None, height=HEIGHT, width=WIDTH, denoising_steps=3, guidance_scale=6.0, seed=0,
                  scheduler="DDIM")


def image(pipeline):
    """The request's image on a loaded pipeline (demo.runtime.loaded.Pipeline) or a family pipeline."""
    if hasattr(pipeline, "run"):
        return pipeline.run([REQUEST])
    return pipeline(REQUEST, StageTimer(CPU))


def test_refitted_engines_draw_the_fused_torch_image_and_go_back_exactly(trt, tmp_path):
    source = resolve_model("tiny")
    loras = loras_for(source, tmp_path)
    pipeline = engine_pipeline(tmp_path, refit=True)
    base_image = image(pipeline)
    refit_ms = pipeline.set_loras(loras)
    assert refit_ms is not None and refit_ms > 0

    # What each engine was given: every initializer the deltas change (by provenance: a Linear's weight is the
    # MatMul's anonymous transposed constant; the stand-in cannot load plugins, so no packed QKV here, which (a)
    # checks), then the biases TensorRT fused with them, which it asks for (the stand-in: an Add's or a Conv's).
    unet = pipeline.stages["unet"].engine.engine
    onnx_path = STAGE_MODELS["unet"](source).optimized_onnx_path(tmp_path / "onnx")
    planned = RefitWeights(Provenance.read(onnx_path), lambda names: read_initializers(onnx_path, names)).plan(
        stage_deltas(loras, source, "unet"))
    given = unet.refits[-1]
    assert given["set"][:len(planned)] == sorted(planned)
    assert any(name.startswith("onnx::MatMul_") for name in given["set"])
    assert given["missing"] and set(given["missing"]) == set(given["set"][len(planned):])
    for name, value in planned.items():
        assert np.array_equal(unet.weights[name], value), name

    reference = make_pipeline(source, torch_stages(source), "DDIM", CPU, torch.float32)
    reference.set_loras(loras)
    fused_image = image(reference)
    assert np.abs(image(pipeline) - fused_image).max() < 1e-3
    assert np.abs(fused_image - base_image).max() > 1e-2  # the LoRA shows

    assert pipeline.set_loras([]) is not None
    base = initializers(onnx_path)
    assert all(unet.weights[name].tobytes() == base[name].tobytes() for name in unet.weights)
    assert np.array_equal(image(pipeline), base_image)  # bit for bit: the engines hold the base weights again
    assert pipeline.set_loras([]) is None  # nothing to change: no refit


def test_the_shipped_outline_lora_refits_shapes_engines_and_the_picture_shows_it(trt, tmp_path):
    """A LoRA that means something, on refittable `shapes` engines (its convolutions and linear layers): the
    detector reads the base engines' square as filled and the refitted engines' as an outline, the rest unchanged;
    without the LoRA the engines draw the base image again, bit for bit."""
    from models.shapes import OUTLINE_LORA
    from models.shapes.detector import read_image
    from models.shapes.scenes import Scene

    options = EngineOptions(onnx_dir=str(tmp_path / "onnx"), engine_dir=str(tmp_path / "engine"),
                            build_static_batch=True, optimization_level=0, build_enable_refit=True)
    spec = PipelineSpec(model="shapes", backend="tensorrt", precision="fp32", plugins="none",
                        modes=("text-to-image",), scheduler="DDIM", engine=options)
    scene = Scene("square", "red", "white", "center", "large")
    with load_pipeline(spec, CPU, progress=QUIET) as pipeline:
        def draw():
            return pipeline(scene.prompt, seed=1, denoising_steps=20, guidance_scale=4.0).images[0]

        base = draw()
        assert pipeline.set_loras([(OUTLINE_LORA, 1.0)]) > 0
        outlined = draw()
        pipeline.set_loras([])
        again = draw()
    expected = scene.__dict__
    assert read_image(base).as_dict() == expected
    assert read_image(outlined).as_dict() == {**expected, "style": "outline"}
    assert np.array_equal(np.asarray(again), np.asarray(base))


def test_a_refit_refuses_an_onnx_exported_again_since_the_engine_was_built(trt, tmp_path):
    source = resolve_model("tiny")
    loras = loras_for(source, tmp_path)
    pipeline = engine_pipeline(tmp_path, refit=True)
    engine = pipeline.stages["unet"].engine.path
    recorded = built_from(engine)
    built_from_path(engine).write_text(json.dumps({name: {**entry, "sha256": "0" * 64}
                                                   for name, entry in recorded.items()}))
    with pytest.raises(UsageError, match="not the ONNX its engine was built from .* force_engine_build"):
        pipeline.set_loras(loras)
    assert not any(stage.engine.engine.refits for stage in pipeline.stages.values())  # no engine changed


def test_engines_built_without_refit_refuse_loras_in_one_line(trt, tmp_path, capsys, monkeypatch):
    from demo.cli.generate import main
    from demo.runtime.loader import PipelinePlan

    source = resolve_model("tiny")
    loras = loras_for(source, tmp_path)
    pipeline = engine_pipeline(tmp_path, refit=False)
    with pytest.raises(UsageError, match="add build_enable_refit"):  # the Python API names the spec's fields
        pipeline.set_loras(loras)

    def no_loading(*_, **__):
        raise AssertionError("a model was loaded before every argument was checked")

    monkeypatch.setattr(PipelinePlan, "load", no_loading)
    out = tmp_path / "out"
    assert main(["a castle", "--backend", "tensorrt", "--lora", str(tmp_path / "peft.safetensors"),
                 "--output-dir", str(out)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("demo-diffusion: error: ") and "--build-enable-refit" in lines[-1]
    assert not out.exists()


@pytest.mark.parametrize("config, message", [
    ({"unet.alpha_pattern": {"(": 2}}, "lora_adapter_metadata unet.alpha_pattern '(' is not a regular expression"),
    ({"unet.lora_alpha": None}, "lora_adapter_metadata unet.lora_alpha must be a finite number, got null")])
def test_refittable_engines_refuse_a_bad_adapter_config_in_one_line(trt, tmp_path, capsys, no_loading, config,
                                                                   message):
    from demo.cli.generate import main

    loras_for(resolve_model("tiny"), tmp_path)
    lora = tmp_path / "peft.safetensors"
    safetensors.torch.save_file(safetensors.torch.load_file(str(lora)), str(lora),
                                {"lora_adapter_metadata": json.dumps(config)})
    out = tmp_path / "out"
    assert main(["a castle", "--backend", "tensorrt", "--build-enable-refit", "--lora", str(lora), "--output-dir",
                 str(out), "--onnx-dir", str(tmp_path / "onnx"), "--engine-dir", str(tmp_path / "engine")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith(f"demo-diffusion: error: LoRA {lora}: {message}")
    assert not out.exists() and not (tmp_path / "engine").exists()


def test_demo_refits_engines_and_reports_the_time(trt, tmp_path, monkeypatch):
    from demo.cli.generate import main

    loras = loras_for(resolve_model("tiny"), tmp_path)
    out = tmp_path / "out"
    common = ["a castle", "--backend", "tensorrt", "--build-enable-refit", "--height", "32", "--width", "32",
              "--denoising-steps", "2", "--seed", "1", "--num-warmup-runs", "0", "--output-dir", str(out),
              "--onnx-dir", str(tmp_path / "onnx"), "--engine-dir", str(tmp_path / "engine"), "--plugins", "none"]
    assert main([*common, "--lora", f"{loras[0][0].path}:0.7"]) == 0
    report = json.loads(next(out.glob("*.json")).read_text())
    assert report["loras"] == [{"path": loras[0][0].path, "scale": 0.7}] and report["lora_refit_ms"] > 0


# ---- on a GPU with TensorRT (8.6 and later) ---------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.tensorrt
@pytest.mark.parametrize("use_cuda_graph", [False, True], ids=["stream", "cuda-graph"])
def test_real_engines_refit_to_the_lora_and_back_to_a_fresh_engines_outputs(use_cuda_graph, tmp_path):
    """Refittable tiny engines (fp16): after a LoRA the UNet computes what the fused torch UNet does (fp16
    tolerance), and after set_loras([]) exactly what a fresh, never refitted engine of the same file does."""
    from dataclasses import replace

    from demo.backends.tensorrt.flavour import why_cannot_run

    reason = why_cannot_run("tensorrt", torch.cuda.get_device_capability())
    if reason:
        pytest.skip(reason)
    cuda = torch.device("cuda")
    loras = loras_for(resolve_model("tiny"), tmp_path)
    # cuDNN 8 may be missing or a stub where TensorRT 8.6 runs: its tactics are left out.
    spec = replace(engine_spec(tmp_path, True, "cuda", disable_tactic_sources="CUDNN"), use_cuda_graph=use_cuda_graph)

    def engines():
        return load_pipeline(spec, cuda, progress=QUIET)

    pipeline = engines()
    unet = pipeline.stages["unet"]
    unet.prepare(2, HEIGHT, WIDTH)
    feed = unet.model.sample_inputs(2, HEIGHT, WIDTH, cuda, torch.float16, torch.Generator().manual_seed(3))
    base = unet(feed)["latent"].float()
    refit_ms = pipeline.set_loras(loras)
    print(f"refit of tiny's engines: {refit_ms:.1f} ms")
    refitted = unet(feed)["latent"].float()
    module = unet.model.load_module().to(cuda).eval()
    fuse(unet.model, module, loras)
    with torch.no_grad():
        expected = module(*(feed[n].float() for n in unet.model.input_names)).float()
    scale = expected.abs().max()
    assert (refitted - expected).abs().max() <= 2e-2 * scale
    assert (base - expected).abs().max() > 4 * (refitted - expected).abs().max()  # the LoRA shows beyond fp16
    pipeline.set_loras([])
    back = unet(feed)["latent"]
    fresh = engines().stages["unet"]
    fresh.prepare(2, HEIGHT, WIDTH)
    assert torch.equal(back, fresh(feed)["latent"])
