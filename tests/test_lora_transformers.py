"""LoRA for SD3 and Flux.1 (their transformers and CLIP text encoders, fused on the torch backend): a LoRA made with
peft on the tiny transformer and text encoders and saved with diffusers' save_lora_weights, and kohya's Flux formats,
give the weights and the image diffusers' load_lora_weights + fuse_lora gives (tiny-sd3, tiny-flux, on the CPU);
scale 0 is no LoRA, two add up, switching restores the weights bit for bit, a LoRA's recommended steps are taken; a
LoRA of another architecture, one matching nothing and one on TensorRT engines are refused in one line (exit 2)."""

import json

import numpy as np
import pytest
import safetensors.torch
import torch

from core.errors import UsageError
from demo.pipelines import StageTimer, make_pipeline, to_uint8
from demo.request import TEXT_TO_IMAGE, Request
from demo.runtime.spec import PipelineSpec
from models.families import SD3
from models.lora import lora_deltas, lora_targets, model_targets, read_lora
from models.source import resolve_model
from tests.parity import CPU, diffusers_images, torch_stages

RANK, ALPHA, SCALE = 4, 8, 0.7  # the adapter config's lora_alpha: deltas x 2


class Model:
    """A built-in model with its own torch stages and pipeline on the CPU; the modules a LoRA changes."""

    def __init__(self, name: str, scheduler: str, size: int):
        self.source = resolve_model(name)
        self.stages = torch_stages(self.source)
        self.pipeline = make_pipeline(self.source, self.stages, scheduler, CPU, torch.float32)
        self.scheduler = scheduler
        self.modules = {s.model.component: s.model.component_module(s.module) for s in self.stages.values()
                        if s.model.component in self.source.family.lora_components}
        self.targets = {component: lora_targets(module) for component, module in self.modules.items()}
        self.base = self.weights()
        self.request = Request("a photo of a cat on a table", None, height=size, width=size, denoising_steps=2,
                               guidance_scale=4.0, seed=3).resolved(self.source)
        self.base_image = self.image()

    def weights(self) -> dict[str, torch.Tensor]:
        return {f"{c}.{k}": v.clone() for c, module in self.modules.items() for k, v in module.state_dict().items()}

    def image(self) -> np.ndarray:
        return to_uint8(self.pipeline(self.request, StageTimer(CPU)))

    def reference(self, fuse):
        """diffusers' pipeline for the model with `fuse(pipeline)` done."""
        import diffusers

        family = self.source.family
        pipe = getattr(diffusers, family.diffusers_pipeline(TEXT_TO_IMAGE)).from_pretrained(self.source.path)
        fuse(pipe)
        return pipe

    def assert_matches(self, ref, changed: bool = True) -> None:
        """Every weight a LoRA may change as diffusers' fused one, and the image within 2/255."""
        for component, module in self.modules.items():
            theirs = getattr(ref, component)
            for path in self.targets[component]:
                other = theirs.get_submodule(path)
                expected = getattr(other, "base_layer", other).weight
                torch.testing.assert_close(module.get_submodule(path).weight, expected, rtol=1e-5, atol=1e-6,
                                           msg=f"{component}.{path}")
        ours = self.image()
        theirs = diffusers_images(self.source, self.scheduler, self.request,
                                  **{c: getattr(ref, c) for c in self.modules})
        assert np.abs(ours.astype(int) - theirs.astype(int)).max() <= 2
        assert (np.abs(ours.astype(int) - self.base_image.astype(int)).mean() > 1) == changed  # not ignored


@pytest.fixture(scope="module")
def sd3():
    model = Model("tiny-sd3", "FlowMatchEuler", 64)
    yield model
    model.pipeline.set_loras([])


@pytest.fixture(scope="module")
def flux():
    model = Model("tiny-flux", "FlowMatchEuler", 128)
    yield model
    model.pipeline.set_loras([])


def peft_lora(path, model: Model, seed: int, components=None):
    """A LoRA made with peft on a fresh copy of each of the model's LoRA components (every Linear and Conv2d module of
    it, random non-zero weights from `seed`), saved with the pipeline's save_lora_weights, its adapter configs in the
    metadata (lora_alpha: ALPHA)."""
    import diffusers
    from peft import LoraConfig, get_peft_model_state_dict

    generator = torch.Generator().manual_seed(seed)
    layers, metadata = {}, {}
    for component in components or model.modules:
        module = _fresh(model, component)
        config = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=list(model.targets[component]),
                            init_lora_weights=False)
        module.add_adapter(config)
        layers[component] = {key: torch.randn(value.shape, generator=generator) * 0.15
                             for key, value in get_peft_model_state_dict(module).items()}
        metadata[component] = config.to_dict()
    pipeline = getattr(diffusers, model.source.family.diffusers_pipeline(TEXT_TO_IMAGE))
    pipeline.save_lora_weights(path, weight_name="lora.safetensors",
                               **{f"{c}_lora_layers": v for c, v in layers.items()},
                               **{f"{c}_lora_adapter_metadata": v for c, v in metadata.items()})
    return path / "lora.safetensors"


def _fresh(model: Model, component: str) -> torch.nn.Module:
    stage = next(s for s in model.stages.values() if s.model.component == component)
    return stage.model.component_module(stage.model.load_module())


def load_and_fuse(path, model: Model, scale=SCALE):
    def fuse(pipe):
        pipe.load_lora_weights(str(path))
        pipe.fuse_lora(components=list(model.modules), lora_scale=scale)  # Flux's fuses its transformer alone else
    return fuse


def test_the_components_a_lora_changes_are_the_family_loaders(sd3, flux):
    """diffusers' SD3LoraLoaderMixin's and FluxLoraLoaderMixin's: the transformer and the CLIPs (not T5, which Flux
    names text_encoder_2), from the configs alone."""
    assert set(model_targets(sd3.source)) == set(sd3.modules) == {"transformer", "text_encoder", "text_encoder_2"}
    assert set(model_targets(flux.source)) == set(flux.modules) == {"transformer", "text_encoder"}
    assert model_targets(flux.source) == flux.targets


@pytest.mark.parametrize("name", ["sd3", "flux"])
def test_a_peft_lora_saved_by_diffusers_gives_its_weights_and_image(name, request, tmp_path):
    model = request.getfixturevalue(name)
    lora = peft_lora(tmp_path, model, seed=1)
    model.pipeline.set_loras([(lora, SCALE)])
    model.assert_matches(model.reference(load_and_fuse(lora, model)))


def test_scale_0_is_no_lora_and_switching_restores_the_weights(sd3, tmp_path):
    first = peft_lora(tmp_path / "a", sd3, seed=2)
    second = peft_lora(tmp_path / "b", sd3, seed=3, components=["transformer"])
    sd3.pipeline.set_loras([(first, 0.0)])
    assert all(torch.equal(sd3.base[key], value) for key, value in sd3.weights().items())
    assert np.array_equal(sd3.image(), sd3.base_image)
    sd3.pipeline.set_loras([(first, 1.0)])
    one = sd3.weights()
    sd3.pipeline.set_loras([(second, 0.5)])
    sd3.pipeline.set_loras([(first, 1.0)])
    assert all(torch.equal(one[key], value) for key, value in sd3.weights().items())  # A, B, A: A's weights again
    sd3.pipeline.set_loras([])
    assert all(torch.equal(sd3.base[key], value) for key, value in sd3.weights().items())  # the base, bit for bit
    assert np.array_equal(sd3.image(), sd3.base_image)


def test_two_loras_add_up_as_diffusers_adapters(flux, tmp_path):
    first, second = peft_lora(tmp_path / "a", flux, seed=4), peft_lora(tmp_path / "b", flux, seed=5)
    flux.pipeline.set_loras([(first, 1.0), (second, -0.5)])

    def fuse(pipe):
        pipe.load_lora_weights(str(first), adapter_name="first")
        pipe.load_lora_weights(str(second), adapter_name="second")
        pipe.set_adapters(["first", "second"], adapter_weights=[1.0, -0.5])
        pipe.fuse_lora(components=list(flux.modules))

    flux.assert_matches(flux.reference(fuse))
    flux.pipeline.set_loras([])


def pair(shape, generator, rows=None):
    out, inputs = shape
    return (torch.randn(RANK, inputs, generator=generator) * 0.15,
            torch.randn(rows or out, RANK, generator=generator) * 0.15)


def kohya_flux(path, flux: Model, names: dict[str, int], seed: int, alphas=True):
    """kohya's Flux LoRA of lora_unet_<BFL name> (name -> the modules its up's rows span, in FLUX_BFL_NAMES' order:
    their targets' rows, summed) and the CLIP's lora_te1_, alpha 2 each where `alphas`."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, (module, rows) in names.items():
        component, target = module
        down, up = pair(flux.targets[component][target], generator, rows)
        tensors.update({f"{name}.lora_down.weight": down, f"{name}.lora_up.weight": up})
        if alphas:
            tensors[f"{name}.alpha"] = torch.tensor(2.0)
    safetensors.torch.save_file(tensors, str(path))
    return path


TRANSFORMER_ROWS = {  # BFL name -> (a module it changes, the rows of its up)
    "double_blocks_0_img_attn_qkv": ("transformer_blocks.0.attn.to_q", 48),
    "double_blocks_0_img_attn_proj": ("transformer_blocks.0.attn.to_out.0", None),
    "double_blocks_0_img_mlp_0": ("transformer_blocks.0.ff.net.0.proj", None),
    "double_blocks_0_txt_attn_qkv": ("transformer_blocks.0.attn.add_q_proj", 48),
    "double_blocks_0_txt_mod_lin": ("transformer_blocks.0.norm1_context.linear", None),
    "single_blocks_0_linear2": ("single_transformer_blocks.0.proj_out", None),
    "single_blocks_0_modulation_lin": ("single_transformer_blocks.0.norm.linear", None),
    "img_in": ("x_embedder", None), "txt_in": ("context_embedder", None),
    "time_in_in_layer": ("time_text_embed.timestep_embedder.linear_1", None),
    "guidance_in_out_layer": ("time_text_embed.guidance_embedder.linear_2", None),
}


def test_kohya_flux_loras_give_diffusers_weights_and_image(flux, tmp_path):
    """BFL's names, the fused projections split, alphas; the final layer's without (diffusers leaves its alphas out),
    final_layer_adaLN_modulation_1 with its halves swapped. diffusers 0.42's load_lora_weights drops the embedders'
    and the final layer's (its converter names them without "transformer."): given back here; it fails on the CLIP's
    lora_te1_ (below: as SD's kohya files)."""
    names = {f"lora_unet_{name}": (("transformer", module), rows) for name, (module, rows) in TRANSFORMER_ROWS.items()}
    lora = kohya_flux(tmp_path / "kohya.safetensors", flux, names, seed=6)
    final = kohya_flux(tmp_path / "final.safetensors", flux,
                       {"lora_unet_final_layer_adaLN_modulation_1": (("transformer", "norm_out.linear"), None),
                        "lora_unet_final_layer_linear": (("transformer", "proj_out"), None)},
                       seed=7, alphas=False)
    flux.pipeline.set_loras([(lora, SCALE), (final, SCALE)])

    def fuse(pipe):  # diffusers' own conversion, its embedders' and final layer's keys given the prefix it leaves out
        for name, path in (("kohya", lora), ("final", final)):
            converted = pipe.lora_state_dict(str(path))
            pipe.load_lora_weights({key if key.startswith(("transformer.", "text_encoder.")) else f"transformer.{key}":
                                    value for key, value in converted.items()}, adapter_name=name)
        pipe.set_adapters(["kohya", "final"], adapter_weights=[SCALE, SCALE])
        pipe.fuse_lora(components=list(flux.modules))

    flux.assert_matches(flux.reference(fuse))
    flux.pipeline.set_loras([])


def test_a_fused_bfl_projection_is_split_over_its_modules_and_diffusers_names_read_as_peft(flux, tmp_path):
    """single_blocks' linear1 (Q, K, V and the MLP's input: diffusers' converter takes FLUX.1's sizes, not tiny's):
    the deltas of its four modules side by side are its own up @ down x alpha / rank; lora_transformer_<module> (the
    diffusers modules' names, kohya's way) and the CLIP's lora_te1_ as the same pairs in diffusers' keys."""
    modules = ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")
    rows = sum(flux.targets["transformer"][f"single_transformer_blocks.0.{m}"][0] for m in modules)
    lora = kohya_flux(tmp_path / "linear1.safetensors", flux, {"lora_unet_single_blocks_0_linear1": (
        ("transformer", "single_transformer_blocks.0.attn.to_q"), rows)}, seed=8)
    tensors = safetensors.torch.load_file(str(lora))
    deltas = {name: delta for _, name, delta in lora_deltas([(read_lora(lora), SCALE)], flux.targets)}
    fused = torch.cat([deltas[f"single_transformer_blocks.0.{m}.weight"] for m in modules])
    down, up = (tensors[f"lora_unet_single_blocks_0_linear1.lora_{p}.weight"] for p in ("down", "up"))
    torch.testing.assert_close(fused, up @ down * 2.0 / RANK * SCALE)

    generator = torch.Generator().manual_seed(9)
    clip = next(path for path in flux.targets["text_encoder"] if path.endswith("layers.0.self_attn.q_proj"))
    modules = [("transformer", path) for path in ("transformer_blocks.0.attn.to_q",
                                                  "single_transformer_blocks.0.proj_mlp", "proj_out")]
    pairs = {(c, path): pair(flux.targets[c][path], generator) for c, path in [*modules, ("text_encoder", clip)]}
    kohya_prefix = {"transformer": "lora_transformer_", "text_encoder": "lora_te1_text_model_"}
    kohya = {f"{kohya_prefix[c]}{path.replace('.', '_')}.lora_{p}.weight": tensor
             for (c, path), (down, up) in pairs.items() for p, tensor in (("down", down), ("up", up))}
    peft = {f"{c}.{path}.lora_{p}.weight": tensor
            for (c, path), (down, up) in pairs.items() for p, tensor in (("A", down), ("B", up))}
    made = []
    for name, tensors in (("kohya", kohya), ("peft", peft)):
        safetensors.torch.save_file(tensors, str(tmp_path / f"{name}.safetensors"))
        made.append({(c, n): d for c, n, d in lora_deltas([(read_lora(tmp_path / f"{name}.safetensors"), 1.0)],
                                                           flux.targets)})
    assert made[0].keys() == {(c, f"{path}.weight") for c, path in pairs}
    assert all(torch.equal(made[0][name], made[1][name]) for name in made[0])


def unet_lora(path, kohya: bool):
    tensors = {"lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight" if kohya
               else "unet.down_blocks.0.attentions.0.proj_in.lora_A.weight": torch.randn(RANK, 32),
               "lora_unet_down_blocks_0_attentions_0_proj_in.lora_up.weight" if kohya
               else "unet.down_blocks.0.attentions.0.proj_in.lora_B.weight": torch.randn(32, RANK)}
    safetensors.torch.save_file(tensors, str(path))
    return path


def refusals(tmp_path, sd3: Model, flux: Model) -> list[tuple[str, object, str]]:
    """(model, LoRA file, what its one line ends with)."""
    transformer_only = ["transformer"]
    nothing = tmp_path / "nothing.safetensors"
    safetensors.torch.save_file({"transformer.no_such.module.lora_A.weight": torch.randn(RANK, 8),
                                 "transformer.no_such.module.lora_B.weight": torch.randn(8, RANK)}, str(nothing))
    prefixless = tmp_path / "adapter.safetensors"  # what transformer.save_lora_adapter writes
    safetensors.torch.save_file({"transformer_blocks.0.attn.to_q.lora_A.weight": torch.randn(RANK, 16),
                                 "transformer_blocks.0.attn.to_q.lora_B.weight": torch.randn(16, RANK)},
                                str(prefixless))
    flux_kohya = kohya_flux(tmp_path / "bfl.safetensors", flux, {"lora_unet_double_blocks_0_img_attn_qkv": (
        ("transformer", "transformer_blocks.0.attn.to_q"), 48)}, seed=10)
    return [
        ("tiny-sd3", unet_lora(tmp_path / "unet-kohya.safetensors", True),
         "changes unet, which a LoRA does not change in this model (its LoRAs change text_encoder, text_encoder_2, "
         "transformer: a LoRA for another model?)"),
        ("tiny-flux", unet_lora(tmp_path / "unet.safetensors", False),
         "changes unet, which a LoRA does not change in this model (its LoRAs change text_encoder, transformer: a "
         "LoRA for another model?)"),
        ("tiny-flux", peft_lora(tmp_path / "sd3", sd3, seed=11, components=transformer_only), "(a LoRA for another "
                                                                                             "model?)"),
        ("tiny-sd3", peft_lora(tmp_path / "flux", flux, seed=12, components=transformer_only), "(a LoRA for another "
                                                                                              "model?)"),
        ("tiny-sd3", flux_kohya, "transformer has no Linear or Conv2d module 'double_blocks_0_img_attn_qkv' (a LoRA "
                                 "for another model?)"),
        ("tiny-flux", nothing, "transformer has no Linear or Conv2d module 'no_such.module' (a LoRA for another "
                               "model?)"),
        ("tiny-flux", prefixless, "(its LoRAs change text_encoder, transformer: its keys have no component prefix, so "
                                  "they are the UNet's: a transformer's need transformer.)"),
    ]


def test_a_lora_of_another_architecture_or_matching_nothing_is_one_line_before_the_model_loads(
        sd3, flux, tmp_path, capsys, no_loading):
    """A UNet LoRA on a transformer, an SD3 LoRA on Flux.1 and back (transformer_blocks' modules of other sizes), a
    kohya Flux LoRA on SD3, keys naming no module, a transformer's keys without their prefix (the UNet's)."""
    from demo.cli.generate import main

    for model, lora, message in refusals(tmp_path, sd3, flux):
        assert main(["a castle", "--model", model, "--backend", "torch", "--lora", str(lora),
                     "--output-dir", str(tmp_path / "out")]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert lines[-1].startswith(f"demo-diffusion: error: LoRA {lora}: ") and lines[-1].endswith(message), lines
        assert not (tmp_path / "out").exists()


def test_a_lora_on_tensorrt_engines_of_a_transformer_is_refused_naming_it():
    """Their refit is not built: refused where the backend is named, TensorRT passed over under auto (a family whose
    engines are built, as SD3's will be: its ENGINES declared here); SD's engines take LoRA."""
    from demo.backends.registry import select_backend
    from models.families import SD

    built = SD3  # its engines are built, their refit not
    with pytest.raises(UsageError) as refused:
        select_backend("tensorrt", cc=(8, 9), family=built, model="tiny-sd3", loras=True)
    assert str(refused.value) == ("backend tensorrt: loras: model 'tiny-sd3' is of the SD3 family, whose TensorRT "
                                  "engines do not take LoRA yet; use backend torch")
    backend, reason = select_backend("auto", cc=(8, 9), family=built, model="tiny-sd3", loras=True)
    assert backend.name == "torch" and "do not take LoRA yet" in reason
    assert select_backend("auto", cc=(8, 9), family=built, model="tiny-sd3")[0].name != "torch"
    assert select_backend("tensorrt-rtx", cc=(8, 9), family=SD, model="tiny", loras=True)[0].name == "tensorrt-rtx"



def test_a_flux_lora_recommends_its_steps_and_guidance_as_sd_loras_do(flux, tmp_path):
    """The step count in its name (over FLUX.1 [dev]'s 28), its metadata's guidance scale; what the request gives
    kept."""
    from demo.runtime.loader import plan_pipeline, quiet
    from models.recommended import RECOMMENDED_METADATA

    folder = tmp_path / "flux-turbo-8steps-lora"
    folder.mkdir()
    tensors = safetensors.torch.load_file(str(peft_lora(tmp_path, flux, seed=14, components=["transformer"])))
    safetensors.torch.save_file(tensors, str(folder / "pytorch_lora_weights.safetensors"),
                                {RECOMMENDED_METADATA: json.dumps({"guidance_scale": 2.5})})

    def planned(request):
        spec = PipelineSpec(model="tiny-flux", backend="torch", loras=((str(folder), 1.0),))
        return plan_pipeline(spec, "cpu", request=request, log=quiet, progress=quiet).request

    made = planned(Request("a castle", seed=0, height=128, width=128))
    assert (made.denoising_steps, made.guidance_scale) == (8, 2.5)
    made = planned(Request("a castle", seed=0, height=128, width=128, denoising_steps=5, guidance_scale=3.0))
    assert (made.denoising_steps, made.guidance_scale) == (5, 3.0)


def test_a_loaded_pipeline_takes_loras_and_refuses_them_on_engines_without_refit(sd3, tmp_path, monkeypatch):
    """The spec's LoRA fused at load (the Python API), switched off; set_loras on engines of a family without their
    refit (a TensorRT backend put in its place here) is one line and changes nothing."""
    from demo.backends.registry import REGISTRY
    from demo.runtime.loader import load_pipeline, quiet

    lora = peft_lora(tmp_path, sd3, seed=15, components=["transformer"])
    pipeline = load_pipeline(PipelineSpec(model="tiny-sd3", backend="torch", loras=((str(lora), SCALE),)), "cpu",
                             log=quiet, progress=quiet)
    transformer = pipeline.stages["transformer"].model.component_module(pipeline.stages["transformer"].module)
    fused = {key: value.clone() for key, value in transformer.state_dict().items()}
    assert [(file.path, scale) for file, scale in pipeline.loras] == [(str(lora), SCALE)]
    assert not all(torch.equal(sd3.base[f"transformer.{key}"], value) for key, value in fused.items())
    monkeypatch.setattr(pipeline, "backend", REGISTRY["tensorrt"])
    with pytest.raises(UsageError, match="^[^\n]*model 'tiny-sd3'[^\n]*$"):
        pipeline.set_loras([(lora, 1.0)])
    assert all(torch.equal(fused[key], value) for key, value in transformer.state_dict().items())
    pipeline.set_loras([])  # none: always taken
    assert all(torch.equal(sd3.base[f"transformer.{key}"], value) for key, value in transformer.state_dict().items())
    pipeline.close()
