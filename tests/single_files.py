"""Single files in the original Stable Diffusion layout (LDM, as A1111 and ComfyUI read them), written from diffusers
folders: the inverse of models.single_file's conversion, for its tests. The mapping is written here from the two
layouts' module names (diffusers' converters read it the other way), so a test that converts such a file and finds
the folder's tensors again checks the converter against an independent description of the layout.

Also the tiny folders the tests write files from that the built-ins lack: an SD 2.x model (an OpenCLIP-shaped text
encoder, linear projections, v-prediction) and ControlNets with the original 8x conditioning embedding."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import diffusers
import torch
from diffusers import AutoencoderKL, ControlNetModel, UNet2DConditionModel
from safetensors.torch import load_file, save_file
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

from models.builtin import XL_PAD, bpe_tokenizer

# diffusers' resnet sub-module -> the original ResBlock's (the UNet's and the ControlNet's)
RESNET = {"norm1": "in_layers.0", "conv1": "in_layers.2", "time_emb_proj": "emb_layers.1", "norm2": "out_layers.0",
          "conv2": "out_layers.3", "conv_shortcut": "skip_connection"}
# modules the two layouts name each one way (a prefix of the diffusers name -> the original's)
UNET_FIXED = {"time_embedding.linear_1.": "time_embed.0.", "time_embedding.linear_2.": "time_embed.2.",
              "add_embedding.linear_1.": "label_emb.0.0.", "add_embedding.linear_2.": "label_emb.0.2.",
              "conv_in.": "input_blocks.0.0.", "conv_norm_out.": "out.0.", "conv_out.": "out.2.",
              "controlnet_cond_embedding.conv_in.": "input_hint_block.0.",
              "controlnet_mid_block.": "middle_block_out.0."}
VAE_ATTENTION = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}
OPEN_CLIP_LAYER = {"self_attn.out_proj": "attn.out_proj", "layer_norm1": "ln_1", "layer_norm2": "ln_2",
                   "mlp.fc1": "mlp.c_fc", "mlp.fc2": "mlp.c_proj"}

# Each variant's text encoders: (the folder's component, where its tensors go in the file, whether in OpenCLIP's
# layout) -- SD 1.x and SDXL's first encoder keep transformers' names under `transformer.`.
TEXT_ENCODERS = {
    "sd1": (("text_encoder", "cond_stage_model.transformer.", False),),
    "sd2": (("text_encoder", "cond_stage_model.model.", True),),
    "sdxl-base": (("text_encoder", "conditioner.embedders.0.transformer.", False),
                  ("text_encoder_2", "conditioner.embedders.1.model.", True)),
    "sdxl-refiner": (("text_encoder_2", "conditioner.embedders.0.model.", True),),
}


def folder_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a component's folder (its safetensors files), by name."""
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def _resnet(rest: str) -> str:
    name, _, tail = rest.partition(".")
    return f"{RESNET[name]}.{tail}"


def unet_key(key: str, config: dict) -> str:
    """A UNet2DConditionModel's (or ControlNetModel's) tensor name in the original UNetModel's (ControlNet's) layout:
    input_blocks 1.. are the down blocks' resnets (each with its attention), then their downsampler, layers_per_block
    + 1 entries a block; output_blocks the same for the up blocks, whose last layer carries the upsampler."""
    for prefix, original in UNET_FIXED.items():
        if key.startswith(prefix):
            return original + key[len(prefix):]
    per = config["layers_per_block"] + 1
    block, kind, index, rest = _split(key)
    if block.startswith("down_blocks."):
        b = int(block.split(".")[1])
        if kind == "downsamplers":
            return f"input_blocks.{1 + b * per + per - 1}.0.op.{rest.removeprefix('conv.')}"
        layer = f"input_blocks.{1 + b * per + index}"
        return f"{layer}.0.{_resnet(rest)}" if kind == "resnets" else f"{layer}.1.{rest}"
    if block == "mid_block":
        return f"middle_block.{2 * index}.{_resnet(rest)}" if kind == "resnets" else f"middle_block.1.{rest}"
    if block.startswith("up_blocks."):
        b = int(block.split(".")[1])
        if kind == "upsamplers":  # after the last resnet, and its attention where the block has one
            slot = 2 if "CrossAttn" in config["up_block_types"][b] else 1
            return f"output_blocks.{b * per + per - 1}.{slot}.{rest}"
        layer = f"output_blocks.{b * per + index}"
        return f"{layer}.0.{_resnet(rest)}" if kind == "resnets" else f"{layer}.1.{rest}"
    raise KeyError(key)


def _split(key: str) -> tuple[str, str, int, str]:
    """'down_blocks.1.resnets.0.conv1.weight' -> ('down_blocks.1', 'resnets', 0, 'conv1.weight')."""
    found = re.fullmatch(r"((?:down|up)_blocks\.\d+|mid_block)\.(resnets|attentions|downsamplers|upsamplers)\.(\d+)\."
                         r"(.+)", key)
    if not found:
        raise KeyError(key)
    return found.group(1), found.group(2), int(found.group(3)), found.group(4)


def controlnet_key(key: str, config: dict, hint_blocks: int) -> str:
    """A ControlNetModel's tensor name in the original ControlNet's: its UNet half as unet_key, the zero convolutions
    (zero_convs, middle_block_out) and the conditioning embedding (input_hint_block: a Sequential whose convolutions
    are every second entry, SiLUs between)."""
    found = re.fullmatch(r"controlnet_down_blocks\.(\d+)\.(.+)", key)
    if found:
        return f"zero_convs.{found.group(1)}.0.{found.group(2)}"
    found = re.fullmatch(r"controlnet_cond_embedding\.blocks\.(\d+)\.(.+)", key)
    if found:
        return f"input_hint_block.{2 * int(found.group(1)) + 2}.{found.group(2)}"
    if key.startswith("controlnet_cond_embedding.conv_out."):
        return f"input_hint_block.{2 * hint_blocks + 2}.{key.rsplit('.', 1)[1]}"
    return unet_key(key, config)


def vae_tensors(state: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """An AutoencoderKL's tensors in the original AutoencoderKL's layout (the decoder's up blocks counted from the
    bottom, the mid attention's projections as 1x1 convolutions)."""
    ups = len(config["up_block_types"])
    out = {}
    for key, tensor in state.items():
        name = key.replace("conv_norm_out.", "norm_out.")
        name = re.sub(r"encoder\.down_blocks\.(\d+)\.resnets\.", r"encoder.down.\1.block.", name)
        name = re.sub(r"encoder\.down_blocks\.(\d+)\.downsamplers\.0\.", r"encoder.down.\1.downsample.", name)
        name = re.sub(r"decoder\.up_blocks\.(\d+)\.(resnets|upsamplers\.0)\.",
                      lambda m: f"decoder.up.{ups - 1 - int(m.group(1))}."
                                f"{'block' if m.group(2) == 'resnets' else 'upsample'}.", name)
        name = re.sub(r"mid_block\.resnets\.(\d+)\.", lambda m: f"mid.block_{int(m.group(1)) + 1}.", name)
        name = name.replace("conv_shortcut.", "nin_shortcut.")
        attention = re.fullmatch(r"(\w+)\.mid_block\.attentions\.0\.(.+)\.(weight|bias)", key)
        if attention:
            name = f"{attention.group(1)}.mid.attn_1.{VAE_ATTENTION[attention.group(2)]}.{attention.group(3)}"
            if attention.group(2) != "group_norm" and tensor.ndim == 2:
                tensor = tensor[:, :, None, None]
        out[name] = tensor.contiguous()
    return out


def clip_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A transformers CLIP text model's tensors as the original checkpoints hold them: transformers' own names under
    `text_model.`, with the position ids buffer older transformers saved."""
    out = {key if key.startswith("text_model.") else f"text_model.{key}": tensor for key, tensor in state.items()}
    positions = out["text_model.embeddings.position_embedding.weight"].shape[0]
    out["text_model.embeddings.position_ids"] = torch.arange(positions)[None]
    return out


def open_clip_tensors(state: dict[str, torch.Tensor], extra_layer: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    """A transformers CLIP text model's tensors in OpenCLIP's layout: q, k, v fused into in_proj, the projection
    transposed (text_projection is [width, embedding]), logit_scale beside them. `extra_layer`: SD 2.x's files hold
    OpenCLIP's last layer, which diffusers' text encoder (the penultimate layer's states) leaves out; it gets random
    tensors, and a random projection (SD 2.x's text encoder has none)."""
    state = {key.removeprefix("text_model."): tensor for key, tensor in state.items()}
    out = {"token_embedding.weight": state.pop("embeddings.token_embedding.weight"),
           "positional_embedding": state.pop("embeddings.position_embedding.weight"),
           "logit_scale": torch.tensor(4.6052)}
    layers = 1 + max(int(key.split(".")[2]) for key in state if key.startswith("encoder.layers."))
    for key, tensor in list(state.items()):
        found = re.fullmatch(r"encoder\.layers\.(\d+)\.(.+)\.(weight|bias)", key)
        if key == "text_projection.weight":
            out["text_projection"] = tensor.T.contiguous()
        elif key.startswith("final_layer_norm."):
            out[key.replace("final_layer_norm.", "ln_final.")] = tensor
        elif found and found.group(2) in OPEN_CLIP_LAYER:
            out[f"transformer.resblocks.{found.group(1)}.{OPEN_CLIP_LAYER[found.group(2)]}.{found.group(3)}"] = tensor
        elif not (found and found.group(2) in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")):
            raise KeyError(key)
    for layer in range(layers):
        for kind in ("weight", "bias"):
            fused = [state[f"encoder.layers.{layer}.self_attn.{p}_proj.{kind}"] for p in "qkv"]
            out[f"transformer.resblocks.{layer}.attn.in_proj_{kind}"] = torch.cat(fused)
    if extra_layer:
        generator = torch.Generator().manual_seed(seed)
        width = out["positional_embedding"].shape[1]
        last = {key.split(".", 3)[3]: tensor for key, tensor in out.items()
                if key.startswith(f"transformer.resblocks.{layers - 1}.")}
        for rest, tensor in last.items():
            out[f"transformer.resblocks.{layers}.{rest}"] = torch.randn(tensor.shape, generator=generator).to(
                tensor.dtype)
        out["text_projection"] = torch.randn(width, width, generator=generator)
    return out


def write_model_file(folder: Path, variant: str, file: Path, dtype: torch.dtype | None = None) -> Path:
    """The diffusers model `folder` as one original-layout safetensors file (`variant`: sd1, sd2, sdxl-base,
    sdxl-refiner), its tensors cast to `dtype` where given. The file also holds what real checkpoints carry beside the
    modules (the noise schedule, an EMA counter), which a converter must leave alone."""
    unet = json.loads((folder / "unet" / "config.json").read_text())
    vae = json.loads((folder / "vae" / "config.json").read_text())
    tensors = {f"model.diffusion_model.{unet_key(k, unet)}": v for k, v in folder_tensors(folder / "unet").items()}
    tensors.update({f"first_stage_model.{k}": v for k, v in vae_tensors(folder_tensors(folder / "vae"), vae).items()})
    for component, prefix, open_clip in TEXT_ENCODERS[variant]:
        state = folder_tensors(folder / component)
        converted = open_clip_tensors(state, extra_layer=variant == "sd2") if open_clip else clip_tensors(state)
        tensors.update({prefix + key: tensor for key, tensor in converted.items()})
    tensors["alphas_cumprod"] = torch.linspace(0.999, 0.005, 1000)
    tensors["model_ema.num_updates"] = torch.tensor(1000)
    if dtype is not None:
        tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
    file.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, file)
    return file


def write_vae_file(vae_folder: Path, file: Path, prefix: str = "") -> Path:
    """An AutoencoderKL folder as a lone original-layout VAE file, its names under `prefix` (none, as the VAE files
    people share, or first_stage_model.)."""
    config = json.loads((vae_folder / "config.json").read_text())
    tensors = vae_tensors(folder_tensors(vae_folder), config)
    save_file({prefix + key: tensor for key, tensor in tensors.items()}, file)
    return file


def write_controlnet_file(controlnet_folder: Path, file: Path) -> Path:
    """A ControlNetModel folder as an original-layout ControlNet file (control_model.)."""
    config = json.loads((controlnet_folder / "config.json").read_text())
    state = folder_tensors(controlnet_folder)
    hint_blocks = len({key.split(".")[2] for key in state if key.startswith("controlnet_cond_embedding.blocks.")})
    save_file({f"control_model.{controlnet_key(k, config, hint_blocks)}": v for k, v in state.items()}, file)
    return file


def init_config(folder: Path) -> dict:
    """A diffusers component's config.json as its class's arguments."""
    return {k: v for k, v in json.loads((folder / "config.json").read_text()).items() if not k.startswith("_")}


def write_sd2_folder(tiny: Path, directory: Path) -> Path:
    """A tiny SD 2.x model from the built-in `tiny`: its VAE, an OpenCLIP-shaped text encoder (GELU, 23 layers as
    SD 2.x's, whose files hold 24), linear projections and per-block head counts in the UNet, SD 2.1's v-prediction
    DDIM scheduler; random weights, seed 0."""
    unet = init_config(tiny / "unet")
    unet.update(attention_head_dim=[2, 4], use_linear_projection=True)
    tokenizer = bpe_tokenizer(1000, 77, XL_PAD)
    text = CLIPTextConfig(hidden_size=32, intermediate_size=37, num_hidden_layers=23, num_attention_heads=4,
                          max_position_embeddings=77, vocab_size=1000, hidden_act="gelu",
                          bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                          pad_token_id=tokenizer.pad_token_id)
    state = torch.random.get_rng_state()
    torch.manual_seed(0)
    try:
        parts = dict(unet=UNet2DConditionModel(**unet), text_encoder=CLIPTextModel(text))
    finally:
        torch.random.set_rng_state(state)
    scheduler = diffusers.DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                        clip_sample=False, set_alpha_to_one=False, steps_offset=1,
                                        prediction_type="v_prediction")
    pipe = diffusers.StableDiffusionPipeline(
        **parts, vae=AutoencoderKL.from_pretrained(tiny / "vae"), tokenizer=tokenizer,
        scheduler=scheduler, safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    pipe.save_pretrained(directory)
    return directory


def write_wide_xl_folder(tiny_xl: Path, directory: Path) -> Path:
    """The built-in `tiny-xl` with a second text encoder 48 wide (its first is 32), and a UNet attending to both (80):
    diffusers' from_single_file tells SDXL's two encoders apart by their width, so it misreads tiny-xl's equal ones.
    Random weights, seed 0."""
    shutil.copytree(tiny_xl, directory, ignore=shutil.ignore_patterns("manifest.json", "unet", "text_encoder_2"))
    unet = init_config(tiny_xl / "unet")
    text = CLIPTextConfig.from_pretrained(tiny_xl / "text_encoder_2")
    text.hidden_size = 48
    state = torch.random.get_rng_state()
    torch.manual_seed(0)
    try:
        UNet2DConditionModel(**{**unet, "cross_attention_dim": 32 + 48}).save_pretrained(directory / "unet")
        CLIPTextModelWithProjection(text).save_pretrained(directory / "text_encoder_2")
    finally:
        torch.random.set_rng_state(state)
    return directory


def write_controlnet_folder(model: Path, directory: Path, seed: int = 0) -> Path:
    """A ControlNetModel for `model`'s UNet with the original ControlNet's conditioning embedding (16, 32, 96, 256:
    input_hint_block's 8 convolutions), every tensor random (seeded) so that a misplaced one shows."""
    unet = UNet2DConditionModel.from_pretrained(model / "unet")
    controlnet = ControlNetModel.from_unet(unet, conditioning_embedding_out_channels=(16, 32, 96, 256))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in controlnet.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)
    controlnet.save_pretrained(directory)
    return directory
