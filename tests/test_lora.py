"""LoRA (issue 19, parts 3 and 5): every key format fused into the torch backend's UNet and text encoders gives the
weights and the image diffusers' load_lora_weights + fuse_lora(lora_scale=SCALE) gives (tiny, tiny-xl; LoRA files
of random non-zero weights written here), set_loras switches without drift, and bad files are one line (exit 2)."""

import json

import numpy as np
import pytest
import safetensors.torch
import torch

from core.errors import UsageError
from demo.backends.registry import REFERENCE
from demo.backends.torch.settings import TorchSettings
from demo.cli.to_spec import parse_lora_spec
from demo.pipelines import StageTimer, Text2ImagePipeline, make_pipeline, to_uint8
from demo.request import TEXT_TO_IMAGE, Request
from models import STAGE_MODELS
from models.families import SDXL
from models.lora import lora_deltas, lora_targets, model_targets, read_lora
from models.source import resolve_model
from tests.parity import CPU, diffusers_images, torch_stages

RANK, SCALE = 4, 0.7
SD_UNET = [  # attention projections, a feed-forward, 1x1 and 3x3 convolutions, a time projection
    "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q",
    "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_out.0",
    "down_blocks.1.attentions.1.transformer_blocks.0.attn2.to_k",
    "up_blocks.0.attentions.2.transformer_blocks.0.attn2.to_v",
    "mid_block.attentions.0.transformer_blocks.0.ff.net.0.proj",
    "down_blocks.1.attentions.0.proj_in",
    "down_blocks.0.resnets.0.conv1",
    "up_blocks.1.resnets.2.conv_shortcut",
    "down_blocks.1.resnets.0.time_emb_proj",
]
XL_UNET = {  # besides, what kohya's SDXL LoRAs name as Stability's code does (sgm): samplers, embeddings, the middle
    "down_blocks.1.attentions.1.transformer_blocks.1.attn1.to_q": "input_blocks.5.1.transformer_blocks.1.attn1.to_q",
    "down_blocks.1.attentions.0.proj_in": "input_blocks.4.1.proj_in",
    "mid_block.attentions.0.transformer_blocks.0.attn2.to_out.0": "middle_block.1.transformer_blocks.0.attn2.to_out.0",
    "up_blocks.0.attentions.2.transformer_blocks.0.ff.net.2": "output_blocks.2.1.transformer_blocks.0.ff.net.2",
    "down_blocks.0.downsamplers.0.conv": "input_blocks.3.0.op",
    "up_blocks.0.upsamplers.0.conv": "output_blocks.2.2.conv",
    "up_blocks.0.resnets.1.conv_shortcut": "output_blocks.1.0.skip_connection",
    "mid_block.resnets.1.conv2": "middle_block.2.out_layers.3",
    "down_blocks.1.resnets.1.time_emb_proj": "input_blocks.5.0.emb_layers.1",
    "time_embedding.linear_1": "time_embed.0",
    "add_embedding.linear_2": "label_emb.0.2",
}
TEXT = ["encoder.layers.0.self_attn.q_proj", "encoder.layers.0.self_attn.k_proj", "encoder.layers.0.self_attn.v_proj",
        "encoder.layers.0.self_attn.out_proj", "encoder.layers.1.mlp.fc1", "encoder.layers.2.mlp.fc2"]
ALPHAS = {"unet": 2.0, "text_encoder": 6.0, "text_encoder_2": 3.0}  # one a component: diffusers misreads more
PROCESSOR = {"unet": {"to_q": "to_q", "to_k": "to_k", "to_v": "to_v", "to_out.0": "to_out"},
             "text": {"q_proj": "to_q", "k_proj": "to_k", "v_proj": "to_v", "out_proj": "to_out"}}


class Model:
    """A built-in model, its own torch stages (their weights are changed here) and pipeline on the CPU."""

    def __init__(self, name: str, scheduler: str):
        self.source = resolve_model(name)
        self.stages = torch_stages(self.source)
        self.pipeline = make_pipeline(self.source, self.stages, scheduler, CPU, torch.float32)
        self.scheduler = scheduler
        self.modules = {s.model.component: s.model.component_module(s.module) for s in self.stages.values()
                        if s.model.name != "vae"}
        self.targets = {component: lora_targets(module) for component, module in self.modules.items()}
        self.base = self.weights()
        self.request = Request("a photo of an astronaut riding a horse", None, height=32, width=32,
                               denoising_steps=3, guidance_scale=6.0, seed=0)
        self.base_image = self.image()

    def weights(self) -> dict[str, torch.Tensor]:
        return {f"{c}.{k}": v.clone() for c, module in self.modules.items() for k, v in module.state_dict().items()}

    def image(self) -> np.ndarray:
        return to_uint8(self.pipeline(self.request, StageTimer(CPU)))

    def text_path(self, component: str, name: str) -> str:
        return next(path for path in self.targets[component] if path.removeprefix("text_model.") == name)


@pytest.fixture(scope="module")
def sd():
    model = Model("tiny", "DDIM")
    yield model
    model.pipeline.set_loras([])


@pytest.fixture(scope="module")
def xl():
    model = Model("tiny-xl", "Euler")
    yield model
    model.pipeline.set_loras([])


def random_pair(shape, generator) -> tuple[torch.Tensor, torch.Tensor]:
    out, inputs, *kernel = shape
    down = torch.randn(RANK, inputs, *kernel, generator=generator) * 0.2
    up = torch.randn(out, RANK, *[1] * len(kernel), generator=generator) * 0.2
    return down, up


def layer_keys(form: str, component: str, path: str, xl: bool, index: int) -> tuple[str, str, str]:
    """The down, up and alpha keys of a module in a key format."""
    if form == "kohya":
        prefix = {"unet": "lora_unet_", "text_encoder": "lora_te1_" if xl else "lora_te_",
                  "text_encoder_2": "lora_te2_"}[component]
        name = "text_model." + path.removeprefix("text_model.") if component != "unet" else path
        name = prefix + (XL_UNET[path] if xl and component == "unet" else name).replace(".", "_")
        return f"{name}.lora_down.weight", f"{name}.lora_up.weight", f"{name}.alpha"
    if form == "old":
        attention, _, projection = path.rpartition(".")
        if component == "unet" and path.rsplit(".", 2)[-2] == "to_out":
            attention, projection = path.removesuffix(".to_out.0"), "to_out.0"
        processors = PROCESSOR["unet" if component == "unet" else "text"]
        if projection in processors:
            stem = f"{component}.{attention}{'.processor' if component == 'unet' else ''}.{processors[projection]}_lora"
        elif component == "unet":
            stem = f"{component}.{path}.lora"
        else:
            stem = f"{component}.{path}.lora_linear_layer"
        return f"{stem}.down.weight", f"{stem}.up.weight", f"{component}.{path}.alpha"
    # diffusers / PEFT; a text encoder's modules with and without text_model., in turn (diffusers 0.42 takes
    # text_encoder_2's only with it)
    if component != "unet" and (index % 2 or component == "text_encoder_2"):
        path = "text_model." + path.removeprefix("text_model.")
    elif component != "unet":
        path = path.removeprefix("text_model.")
    return f"{component}.{path}.lora_A.weight", f"{component}.{path}.lora_B.weight", f"{component}.{path}.alpha"


def write_lora(path, model: Model, form: str, seed: int, alphas: bool = False, metadata: dict | None = None,
               components=None):
    """A LoRA file of `form` for the model's modules above, random weights from `seed`; alpha keys where asked."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for component in components or model.modules:
        xl = model.source.family is SDXL
        names = (XL_UNET if xl else SD_UNET) if component == "unet" else TEXT
        for index, name in enumerate(names):
            module = name if component == "unet" else model.text_path(component, name)
            down_key, up_key, alpha_key = layer_keys(form, component, module, xl, index)
            tensors[down_key], tensors[up_key] = random_pair(model.targets[component][module], generator)
            if alphas:
                tensors[alpha_key] = torch.tensor(ALPHAS[component])
    safetensors.torch.save_file(tensors, str(path), metadata)
    return path


def reference(model: Model, fuse):
    """diffusers' pipeline for the model with `fuse(pipeline)` done: the LoRA fused into its modules."""
    import diffusers

    family = model.source.family
    pipe = getattr(diffusers, family.diffusers_pipeline(TEXT_TO_IMAGE)).from_pretrained(model.source.path,
                                                                                        **family.diffusers_options)
    fuse(pipe)
    return pipe


def assert_weights_match(model: Model, ref, exact: bool = True):
    """Every Linear and Conv2d weight of the UNet and text encoders: ours as diffusers' fused ones."""
    for component, module in model.modules.items():
        theirs = getattr(ref, component)
        for path in model.targets[component]:
            other = theirs.get_submodule(path)
            expected = getattr(other, "base_layer", other).weight
            actual = module.get_submodule(path).weight
            if exact:
                assert torch.equal(actual, expected), f"{component}.{path}"
            else:
                torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6, msg=f"{component}.{path}")


def assert_image_matches(model: Model, ref):
    ours = model.image()
    components = {c: getattr(ref, c) for c in model.modules}
    theirs = diffusers_images(model.source, model.scheduler, model.request, **components)
    assert np.abs(ours.astype(int) - theirs.astype(int)).max() <= 2
    assert np.abs(ours.astype(int) - model.base_image.astype(int)).mean() > 2  # the LoRA is not ignored
    return ours


def load_and_fuse(path, scale=SCALE):
    def fuse(pipe):
        pipe.load_lora_weights(str(path))
        pipe.fuse_lora(lora_scale=scale)
    return fuse


@pytest.mark.parametrize("form", ["peft", "old", "kohya"])
def test_sd_formats_give_diffusers_weights_and_image(sd, form, tmp_path):
    """kohya with an alpha per module (alpha / rank scales, 0.5 and 1.5 here); a text encoder's modules with and
    without text_model. (PEFT)."""
    lora = write_lora(tmp_path / "lora.safetensors", sd, form, seed=1, alphas=form == "kohya")
    sd.pipeline.set_loras([(lora, SCALE)])
    ref = reference(sd, load_and_fuse(lora))
    assert_weights_match(sd, ref)
    assert_image_matches(sd, ref)


@pytest.mark.parametrize("form", ["peft", "kohya"])
def test_sdxl_formats_give_diffusers_weights_and_image(xl, form, tmp_path):
    """Both text encoders (kohya's lora_te1_ and lora_te2_), kohya's sgm names for the UNet."""
    lora = write_lora(tmp_path / "lora.safetensors", xl, form, seed=2, alphas=form == "kohya")
    xl.pipeline.set_loras([(str(lora), SCALE)])
    ref = reference(xl, load_and_fuse(lora))
    assert_weights_match(xl, ref)
    assert_image_matches(xl, ref)


def test_older_diffusers_alphas_scale_as_diffusers_network_alphas(sd, tmp_path):
    """`<module>.alpha` beside lora.down/lora.up: what diffusers does with network alphas (its own loader refuses
    such a file, so they go in as load_lora_into_unet's and load_lora_into_text_encoder's network_alphas)."""
    lora = write_lora(tmp_path / "lora.safetensors", sd, "old", seed=3, alphas=True)
    sd.pipeline.set_loras([(lora, SCALE)])
    tensors = safetensors.torch.load_file(str(lora))
    alphas = {key: value.item() for key, value in tensors.items() if key.endswith(".alpha")}
    weights = {key: value for key, value in tensors.items() if key not in alphas}

    def fuse(pipe):
        pipe.load_lora_into_unet(weights, network_alphas=alphas, unet=pipe.unet)
        pipe.load_lora_into_text_encoder(weights, network_alphas=alphas, text_encoder=pipe.text_encoder)
        pipe.fuse_lora(lora_scale=SCALE)

    assert_weights_match(sd, reference(sd, fuse))


def test_peft_adapter_config_in_the_metadata_scales_as_peft(sd, tmp_path):
    """diffusers' lora_adapter_metadata: lora_alpha, an alpha_pattern, rsLoRA (alpha / sqrt(rank))."""
    config = {"unet.r": RANK, "unet.lora_alpha": 8, "unet.alpha_pattern": {"attn1.to_q": 2},
              "unet.target_modules": SD_UNET, "text_encoder.r": RANK, "text_encoder.lora_alpha": 3,
              "text_encoder.use_rslora": True, "text_encoder.target_modules": ["q_proj", "k_proj", "v_proj",
                                                                                "out_proj", "fc1", "fc2"]}
    lora = write_lora(tmp_path / "lora.safetensors", sd, "peft", seed=4,
                      metadata={"format": "pt", "lora_adapter_metadata": json.dumps(config)})
    sd.pipeline.set_loras([(lora, SCALE)])
    assert_weights_match(sd, reference(sd, load_and_fuse(lora)))


def test_switching_never_drifts_and_two_loras_add_up(sd, tmp_path):
    first = write_lora(tmp_path / "a.safetensors", sd, "peft", seed=5)
    second = write_lora(tmp_path / "b.safetensors", sd, "kohya", seed=6, alphas=True)
    sd.pipeline.set_loras([(first, 1.0)])
    one = sd.weights()
    sd.pipeline.set_loras([(second, 0.5)])
    sd.pipeline.set_loras([(first, 1.0)])
    assert all(torch.equal(one[key], value) for key, value in sd.weights().items())  # A, B, A: A's weights again
    sd.pipeline.set_loras([])
    assert all(torch.equal(sd.base[key], value) for key, value in sd.weights().items())  # the base, bit for bit
    assert np.array_equal(sd.image(), sd.base_image)

    sd.pipeline.set_loras([(first, 1.0), (second, -0.5)])

    def fuse(pipe):
        pipe.load_lora_weights(str(first), adapter_name="first")
        pipe.load_lora_weights(str(second), adapter_name="second")
        pipe.set_adapters(["first", "second"], adapter_weights=[1.0, -0.5])
        pipe.fuse_lora()

    ref = reference(sd, fuse)
    assert_weights_match(sd, ref, exact=False)  # diffusers adds the deltas one by one, we add them up first
    assert_image_matches(sd, ref)
    sd.pipeline.set_loras([])


def test_text_encoder_keys_with_and_without_text_model_are_the_same(xl, tmp_path):
    """text_encoder_2 (transformers keeps text_model. there) too, whose keys without it diffusers 0.42 cannot take."""
    assert model_targets(xl.source) == xl.targets
    generator = torch.Generator().manual_seed(7)
    pairs = {name: random_pair(xl.targets["text_encoder_2"][xl.text_path("text_encoder_2", name)], generator)
             for name in TEXT}
    deltas = []
    for prefix in ("text_encoder_2.text_model.", "text_encoder_2."):
        tensors = {}
        for name, (down, up) in pairs.items():
            tensors[f"{prefix}{name}.lora_A.weight"], tensors[f"{prefix}{name}.lora_B.weight"] = down, up
        safetensors.torch.save_file(tensors, str(tmp_path / "lora.safetensors"))
        deltas.append({name: delta for _, name, delta in lora_deltas([(read_lora(tmp_path / "lora.safetensors"),
                                                                       1.0)], xl.targets)})
    assert deltas[0].keys() == deltas[1].keys() == {f"text_model.{name}.weight" for name in TEXT}
    assert all(torch.equal(deltas[0][name], deltas[1][name]) for name in deltas[0])


def test_each_kohya_module_takes_its_own_alpha(sd, tmp_path):
    """alpha / rank per module, as kohya and A1111 apply it (diffusers 0.42 gives an attention projection the
    file's most common alpha instead)."""
    path = SD_UNET[0]
    down, up = random_pair(sd.targets["unet"][path], torch.Generator().manual_seed(8))
    name = "lora_unet_" + path.replace(".", "_")
    other = "lora_unet_" + SD_UNET[1].replace(".", "_")
    other_down, other_up = random_pair(sd.targets["unet"][SD_UNET[1]], torch.Generator().manual_seed(9))
    safetensors.torch.save_file({f"{name}.lora_down.weight": down, f"{name}.lora_up.weight": up,
                                 f"{name}.alpha": torch.tensor(3.0), f"{other}.lora_down.weight": other_down,
                                 f"{other}.lora_up.weight": other_up, f"{other}.alpha": torch.tensor(1.0)},
                                str(tmp_path / "k.safetensors"))
    deltas = {name: delta for _, name, delta in lora_deltas([(read_lora(tmp_path / "k.safetensors"), 0.5)],
                                                            sd.targets)}
    torch.testing.assert_close(deltas[f"{path}.weight"], up @ down * (3.0 / RANK * 0.5))
    torch.testing.assert_close(deltas[f"{SD_UNET[1]}.weight"], other_up @ other_down * (1.0 / RANK * 0.5))


def test_the_deltas_are_keyed_by_module_path_and_pure(sd, tmp_path):
    """What engine refit will take: float32 deltas by component and weight name, the model untouched."""
    lora = read_lora(write_lora(tmp_path / "lora.safetensors", sd, "kohya", seed=10, alphas=True))
    before = sd.weights()
    assert model_targets(sd.source) == sd.targets  # from the configs alone, as the loaded modules have them
    deltas = {(component, name): delta for component, name, delta in lora_deltas([(lora, 1.0), (lora, 1.0)],
                                                                                 sd.targets)}
    assert set(deltas) == {("unet", f"{p}.weight") for p in SD_UNET} | {("text_encoder", f"{p}.weight") for p in TEXT}
    assert all(d.dtype == torch.float32 and d.shape == sd.targets[c][n.removesuffix(".weight")]
               for (c, n), d in deltas.items())
    single = dict(((c, n), d) for c, n, d in lora_deltas([(lora, 2.0)], sd.targets))
    assert all(torch.allclose(deltas[key], single[key], rtol=1e-6, atol=1e-7) for key in deltas)
    assert all(torch.equal(before[key], value) for key, value in sd.weights().items())


def test_fusing_reaches_compiled_code_and_our_packed_attention(sd, tmp_path):
    """Weights change in place: a torch.compile'd module (aot_eager here) sees them, and fMHA's packed QKV copy is
    made again."""
    from tests.plugin_references import cpu_kernels

    lora = write_lora(tmp_path / "lora.safetensors", sd, "peft", seed=11, components=["unet"])
    unet = STAGE_MODELS["unet"](sd.source)
    stages = REFERENCE.create_stages([unet], lambda _: TorchSettings(plugins=("fMHA",)), CPU, torch.float32,
                                     lambda _: None, lambda _: None)
    stages["unet"]._forward = torch.compile(stages["unet"].module, backend="aot_eager", dynamic=False)
    inputs = unet.sample_inputs(2, 32, 32, generator=torch.Generator().manual_seed(0))
    pipeline = Text2ImagePipeline(sd.source, stages, "DDIM", CPU, torch.float32)
    with cpu_kernels():
        before = stages["unet"](inputs)["latent"]
        pipeline.set_loras([(lora, SCALE)])
        fused = stages["unet"](inputs)["latent"]
    sd.pipeline.set_loras([(lora, SCALE)])
    expected = sd.stages["unet"](inputs)["latent"]
    sd.pipeline.set_loras([])
    assert not torch.allclose(before, fused)
    torch.testing.assert_close(fused, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("text, expected", [("a.safetensors", ("a.safetensors", 1.0)), ("a.safetensors:0.5",
                         ("a.safetensors", 0.5)), ("C:/x:y.safetensors:-1", ("C:/x:y.safetensors", -1.0)),
                         ("dir:v2.safetensors", ("dir:v2.safetensors", 1.0))])
def test_lora_spec(text, expected):
    assert parse_lora_spec(text) == expected


def test_lora_spec_prefers_a_path_that_exists_and_names_a_bad_scale(tmp_path):
    """The whole text where that file exists (a name ending in ':2'); else a scale that is no number after a file
    that exists is what is wrong, not the file."""
    (tmp_path / "v:2").write_bytes(b"")
    (tmp_path / "a.safetensors").write_bytes(b"")
    assert parse_lora_spec(f"{tmp_path}/v:2") == (f"{tmp_path}/v:2", 1.0)
    assert parse_lora_spec(f"{tmp_path}/v:2:0.5") == (f"{tmp_path}/v:2", 0.5)
    with pytest.raises(UsageError) as error:
        parse_lora_spec(f"{tmp_path}/a.safetensors:abc")
    assert str(error.value) == f"loras {tmp_path}/a.safetensors:abc: the scale after the last ':' must be a number, " \
                               "got 'abc'"
    assert parse_lora_spec(f"{tmp_path}/b.safetensors:abc") == (f"{tmp_path}/b.safetensors:abc", 1.0)  # no such file


def test_a_folder_is_read_as_diffusers_reads_it(sd, tmp_path):
    """A folder holding pytorch_lora_weights.safetensors (what save_lora_weights writes), as load_lora_weights(folder)
    takes it; what the pipeline reports is the file read."""
    from diffusers.loaders import lora_base

    from models import lora as ours

    folder = tmp_path / "style"
    folder.mkdir()
    lora = write_lora(folder / lora_base.LORA_WEIGHT_NAME_SAFE, sd, "peft", seed=17)
    sd.pipeline.set_loras([(folder, SCALE)])
    ref = reference(sd, load_and_fuse(folder))
    assert_weights_match(sd, ref)
    assert_image_matches(sd, ref)
    sd.pipeline.set_loras([])
    assert read_lora(folder).path == str(lora)
    assert (ours.LORA_WEIGHT_NAME_SAFE, ours.LORA_WEIGHT_NAME) == (lora_base.LORA_WEIGHT_NAME_SAFE,
                                                                   lora_base.LORA_WEIGHT_NAME)


def test_a_unet_lora_without_prefix_is_the_unets_as_diffusers_takes_it(sd, tmp_path):
    """What diffusers' unet.save_lora_adapter writes: keys without "unet.", and the LoraConfig in the metadata without
    it too (lora_alpha and an alpha_pattern here); diffusers' unet.load_lora_adapter(prefix=None) reads it so (its
    pipeline's load_lora_weights skips such keys, with a warning)."""
    import diffusers
    from peft import LoraConfig

    unet = diffusers.UNet2DConditionModel.from_pretrained(sd.source.path, subfolder="unet")
    torch.manual_seed(18)
    unet.add_adapter(LoraConfig(r=RANK, lora_alpha=8, alpha_pattern={"attn1.to_q": 2}, target_modules=SD_UNET,
                                init_lora_weights=False))
    unet.save_lora_adapter(str(tmp_path / "adapter"))
    keys = safetensors.torch.load_file(str(tmp_path / "adapter" / "pytorch_lora_weights.safetensors")).keys()
    assert keys and not any(key.startswith("unet.") for key in keys)
    sd.pipeline.set_loras([(tmp_path / "adapter", SCALE)])

    def fuse(pipe):
        pipe.unet.load_lora_adapter(str(tmp_path / "adapter"), prefix=None, use_safetensors=True)
        pipe.fuse_lora(components=["unet"], lora_scale=SCALE)

    ref = reference(sd, fuse)
    assert_weights_match(sd, ref)
    assert_image_matches(sd, ref)
    sd.pipeline.set_loras([])


def test_the_same_file_five_times_adds_up_as_five_fused_adapters(sd, tmp_path):
    """Valid, as diffusers takes it under five adapter names: the deltas add up (five times at 0.2: once at 1.0)."""
    lora = write_lora(tmp_path / "lora.safetensors", sd, "kohya", seed=19, alphas=True)
    sd.pipeline.set_loras([(lora, 1.0)])
    once = sd.weights()
    sd.pipeline.set_loras([(lora, 0.2)] * 5)
    assert all(torch.allclose(once[key], value, rtol=1e-5, atol=1e-6) for key, value in sd.weights().items())

    def fuse(pipe):
        for index in range(5):
            pipe.load_lora_weights(str(lora), adapter_name=f"copy{index}")
        pipe.set_adapters([f"copy{index}" for index in range(5)], adapter_weights=[0.2] * 5)
        pipe.fuse_lora()

    assert_weights_match(sd, reference(sd, fuse), exact=False)
    sd.pipeline.set_loras([])


@pytest.mark.parametrize("form", ["peft", "kohya"])
def test_a_lora_of_the_other_architecture_is_refused_before_the_model_loads(sd, xl, form, tmp_path, capsys,
                                                                            no_loading):
    """An SDXL LoRA on an SD 1.x model (its text_encoder_2 said first), an SD 1.x LoRA on an SDXL model."""
    from demo.cli.generate import main

    for model, other, message in [(xl, "tiny", "changes text_encoder_2, which a LoRA does not change in this model "
                                               "(its LoRAs change text_encoder, unet: a LoRA for another model?)"),
                                  (sd, "tiny-xl", "(a LoRA for another model?)")]:
        lora = write_lora(tmp_path / f"{model.source.name}.safetensors", model, form, seed=20, alphas=True)
        assert main(["a castle", "--model", other, "--lora", str(lora), "--output-dir", str(tmp_path / "out")]) == 2
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert line.startswith(f"demo-diffusion: error: LoRA {lora}: ") and line.endswith(message), line
        assert not (tmp_path / "out").exists()


def bad_files(tmp_path):
    """name -> (file, what the one line says)"""
    module = SD_UNET[0]

    def save(name, tensors, metadata=None):
        safetensors.torch.save_file(tensors, str(tmp_path / name), metadata)
        return tmp_path / name

    def with_config(name, config):
        return save(name, {f"unet.{module}.lora_A.weight": torch.ones(4, 64),
                           f"unet.{module}.lora_B.weight": torch.ones(64, 4)},
                    {"lora_adapter_metadata": json.dumps(config)})

    (tmp_path / "text.safetensors").write_text("not a safetensors file")
    (tmp_path / "folder.safetensors").mkdir()
    (tmp_path / "empty.safetensors").write_bytes(b"")
    whole = with_config("whole.safetensors", {}).read_bytes()
    (tmp_path / "truncated.safetensors").write_bytes(whole[:-100])
    (tmp_path / "pickled").mkdir()
    (tmp_path / "pickled" / "pytorch_lora_weights.bin").write_bytes(b"")
    conv = "lora_unet_down_blocks_0_resnets_0_conv1"
    return {
        "missing": (tmp_path / "missing.safetensors", "no such file"),
        "empty": (tmp_path / "empty.safetensors", "is empty (0 bytes)"),
        "truncated": (tmp_path / "truncated.safetensors",
                      f"is truncated: {len(whole) - 100} bytes, where its header describes {len(whole)}"),
        "not safetensors": (tmp_path / "text.safetensors", "is not a safetensors file"),
        "a folder": (tmp_path / "folder.safetensors", "is a folder without pytorch_lora_weights.safetensors"),
        "a folder of a pickle": (tmp_path / "pickled", "holds pytorch_lora_weights.bin, a pickle, not "
                                                       "pytorch_lora_weights.safetensors"),
        "no LoRA": (save("model.safetensors", {"conv_in.weight": torch.ones(2, 2)}),
                    "holds keys of no LoRA format known here, such as 'conv_in.weight' (1 in all; known: "
                    "diffusers/PEFT unet./transformer./text_encoder.<module>.lora_A/lora_B"),
        "LoCon mid": (save("locon.safetensors", {f"{conv}.lora_down.weight": torch.ones(4, 32, 3, 3),
                                                 f"{conv}.lora_up.weight": torch.ones(32, 4, 1, 1),
                                                 f"{conv}.lora_mid.weight": torch.ones(4, 4, 3, 3)}), "lora_mid"),
        "half a pair": (save("half.safetensors", {"unet.mid_block.attentions.0.proj_in.lora_A.weight":
                                                  torch.ones(4, 16)}), "has no up weight"),
        "ranks that differ": (save("pair.safetensors", {f"unet.{module}.lora_A.weight": torch.ones(4, 64),
                                                        f"unet.{module}.lora_B.weight": torch.ones(64, 5)}),
                              "down [4, 64] and up [64, 5] are no low-rank pair"),
        "rank 0": (save("rank0.safetensors", {f"{conv}.lora_down.weight": torch.ones(0, 32, 3, 3),
                                              f"{conv}.lora_up.weight": torch.ones(32, 0, 1, 1),
                                              f"{conv}.alpha": torch.tensor(4.0)}),
                   "down [0, 32, 3, 3] and up [32, 0, 1, 1] have rank 0"),
        "lora_alpha a string": (with_config("abc.safetensors", {"unet.lora_alpha": "abc"}),
                                'lora_adapter_metadata unet.lora_alpha must be a finite number, got "abc"'),
        "lora_alpha null": (with_config("null.safetensors", {"unet.lora_alpha": None}),
                            "lora_adapter_metadata unet.lora_alpha must be a finite number, got null"),
        "alpha_pattern no regex": (with_config("paren.safetensors", {"unet.alpha_pattern": {"(": 2}}),
                                   "lora_adapter_metadata unet.alpha_pattern '(' is not a regular expression"),
        "alpha_pattern a list": (with_config("list.safetensors", {"unet.alpha_pattern": ["attn1.to_q"]}),
                                 "lora_adapter_metadata unet.alpha_pattern must be an object of module pattern -> "
                                 "alpha, got [\"attn1.to_q\"]"),
        "an alpha_pattern alpha a string": (with_config("value.safetensors", {"unet.alpha_pattern": {"to_q": "2"}}),
                                            "lora_adapter_metadata unet.alpha_pattern 'to_q' must give a finite "
                                            'number, got "2"'),
        "use_rslora a string": (with_config("rslora.safetensors", {"unet.use_rslora": "false"}),
                                'lora_adapter_metadata unet.use_rslora must be true or false, got "false"'),
        "a prefix missing beside others": (save("mixed.safetensors", {
            f"unet.{module}.lora_A.weight": torch.ones(4, 64), f"unet.{module}.lora_B.weight": torch.ones(64, 4),
            f"{SD_UNET[1]}.lora_A.weight": torch.ones(4, 64), f"{SD_UNET[1]}.lora_B.weight": torch.ones(64, 4)}),
            f"key '{SD_UNET[1]}.lora_A.weight' has no component prefix (unet., transformer., text_encoder., "
            "text_encoder_2.) "
            "while other keys have one"),
        "a text encoder without its prefix": (save("te.safetensors", {
            f"text_model.{TEXT[0]}.lora_A.weight": torch.ones(4, 32),
            f"text_model.{TEXT[0]}.lora_B.weight": torch.ones(32, 4)}),
            f"unet has no Linear or Conv2d module 'text_model.{TEXT[0]}' (its keys have no component prefix, so they "
            "are the UNet's: a text encoder's need text_encoder. or text_encoder_2.)"),
        "another model": (save("other.safetensors", {"unet.down_blocks.0.resnets.0.conv1.lora_A.weight":
                                                     torch.ones(4, 16, 3, 3),
                                                     "unet.down_blocks.0.resnets.0.conv1.lora_B.weight":
                                                     torch.ones(32, 4, 1, 1)}),
                          "has a [32, 32, 3, 3] weight; the LoRA's down [4, 16, 3, 3] and up [32, 4, 1, 1] do not fit"),
        "another model's component": (save("xl.safetensors", {
            "text_encoder_2.text_model.encoder.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(4, 32),
            "text_encoder_2.text_model.encoder.layers.0.self_attn.q_proj.lora_B.weight": torch.ones(32, 4)}),
            "changes text_encoder_2, which a LoRA does not change in this model"),
        "unknown module": (save("unknown.safetensors", {"unet.no_such.module.lora_A.weight": torch.ones(4, 16),
                                                        "unet.no_such.module.lora_B.weight": torch.ones(16, 4)}),
                           "unet has no Linear or Conv2d module 'no_such.module'"),
    }


def test_bad_files_are_one_usage_error_and_change_nothing(sd, tmp_path):
    good = write_lora(tmp_path / "good.safetensors", sd, "peft", seed=13)
    sd.pipeline.set_loras([(good, 1.0)])
    fused = sd.weights()
    for name, (path, message) in bad_files(tmp_path).items():
        with pytest.raises(UsageError) as error:
            sd.pipeline.set_loras([(path, 1.0)])
        assert message in str(error.value) and "\n" not in str(error.value), name
    assert all(torch.equal(fused[key], value) for key, value in sd.weights().items())
    with pytest.raises(UsageError, match="finite"):
        sd.pipeline.set_loras([(good, float("nan"))])
    sd.pipeline.set_loras([])


def test_demo_takes_repeated_lora_flags(sd, tmp_path):
    from demo.cli.generate import main

    first = write_lora(tmp_path / "a.safetensors", sd, "peft", seed=14)
    second = write_lora(tmp_path / "b.safetensors", sd, "kohya", seed=15, alphas=True)
    out = tmp_path / "out"
    common = ["a castle", "--model", "tiny", "--height", "32", "--width", "32", "--denoising-steps", "2",
              "--seed", "1", "--num-warmup-runs", "0", "--output-dir", str(out)]
    assert main(common) == 0
    assert main([*common, "--lora", str(first), "--lora", f"{second}:0.5"]) == 0
    report = json.loads((out / "tiny-seed1-run2.json").read_text())
    assert report["loras"] == [{"path": str(first), "scale": 1.0}, {"path": str(second), "scale": 0.5}]
    assert (out / "tiny-seed1-0.png").read_bytes() != (out / "tiny-seed1-run2-0.png").read_bytes()


@pytest.mark.parametrize("case", ["not safetensors", "no LoRA", "LoCon mid", "another model",
                                  "another model's component", "missing", "empty", "truncated", "a folder",
                                  "a folder of a pickle", "ranks that differ", "rank 0", "lora_alpha a string",
                                  "lora_alpha null", "alpha_pattern no regex", "alpha_pattern a list",
                                  "a prefix missing beside others", "a text encoder without its prefix"])
def test_demo_refuses_bad_lora_files_in_one_line_before_the_model_loads(case, tmp_path, capsys, no_loading):
    from demo.cli.generate import main

    path, message = bad_files(tmp_path)[case]
    assert main(["a castle", "--model", "tiny", "--lora", str(path), "--output-dir", str(tmp_path / "out")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith(f"demo-diffusion: error: LoRA {path}: ") and message in lines[-1]
    assert not (tmp_path / "out").exists()


def test_sd_serve_refuses_a_rank_0_lora_in_one_line(tmp_path, capsys):
    from demo.cli.serve import main
    from tests.test_serve import free_ports

    path, message = bad_files(tmp_path)["rank 0"]
    http, grpc, metrics = free_ports(3)
    assert main(["--model", "tiny", "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port",
                 str(metrics), "--lora", str(path)]) == 2
    err = capsys.readouterr().err.split("...\n")[-1]  # after the built-in model's generation, on a cold cache
    assert err == f"sd-serve: error: LoRA {path}: unet module down_blocks_0_resnets_0_conv1: {message} (a LoRA's " \
                  "rank is at least 1)\n"


def test_demo_says_the_scale_is_wrong_not_the_file(tmp_path, capsys, no_loading):
    from demo.cli.generate import main

    lora = tmp_path / "a.safetensors"
    lora.write_bytes(b"")
    assert main(["a castle", "--lora", f"{lora}:abc", "--output-dir", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"demo-diffusion: error: --lora {lora}:abc: the scale after the last ':' must be a number, got 'abc'")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("spec, message", [("{good}:nan", "the scale must be a finite number"),
                                           ("{good}", "LoRA on TensorRT engines needs engines built "
                                                      "refittable: add --build-enable-refit")])
def test_demo_lora_usage_errors_come_before_any_model_loads(sd, tmp_path, capsys, monkeypatch, no_loading, spec,
                                                            message):
    from demo.backends.registry import REGISTRY
    from demo.cli.generate import main

    good = write_lora(tmp_path / "good.safetensors", sd, "peft", seed=16)
    if "refit" in message:
        monkeypatch.setattr("demo.runtime.loader.select_backend", lambda *_, **__: (REGISTRY["tensorrt"], "a test"))
    assert main(["a castle", "--lora", spec.format(good=good), "--output-dir", str(tmp_path / "out")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("demo-diffusion: error: ") and message in lines[-1]


def test_the_lora_flag_repeats_and_round_trips():
    from demo.cli.flags import LoraFlags, parse_flags, to_argv
    from demo.cli.generate import build_parser

    flags = parse_flags(build_parser(), ["a castle", "--lora", "a.safetensors", "--lora", "b.safetensors:0.5"])
    assert flags[LoraFlags].lora == ("a.safetensors", "b.safetensors:0.5")
    assert to_argv(flags[LoraFlags]) == ["--lora", "a.safetensors", "--lora", "b.safetensors:0.5"]
    assert parse_flags(build_parser(), ["a castle"])[LoraFlags].lora is None
