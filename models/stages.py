"""The stage registry: each stage's model class by its name, and which stages a model and a mode run."""

from core.errors import UsageError
from models import (
    CLIP,
    CLIP2,
    T5,
    TRANSFORMER,
    UNET,
    UNET_SHALLOW,
    VAE,
    VAE_ENCODER,
    is_control_image_stage,
    is_controlnet_stage,
    is_shallow_controlnet_stage,
)
from models.base import StageModel
from models.clip import CLIP2Model, CLIPModel
from models.controlnet import ControlNetImageModel, ControlNetStageModel, ShallowControlNetStageModel
from models.flow_controlnet import (
    CONTROLNET_STAGE_MODELS,
    check_together,
    check_transformer_controlnet,
    controlled_transformer_stages,
)
from models.t5 import T5Model
from models.transformer import FluxTransformerModel, SD3TransformerModel
from models.transformer_cache import CACHED_TRANSFORMERS, HEAD, OUT, TAIL, cached_transformer_stages, part_stage
from models.unet import UNetModel, UNetShallowModel
from models.vae import VAEDecoderModel, VAEEncoderModel

STAGE_MODELS: dict[str, type[StageModel]] = {
    cls.name: cls for cls in (CLIPModel, CLIP2Model, T5Model, UNetModel, SD3TransformerModel, FluxTransformerModel,
                              VAEDecoderModel, VAEEncoderModel)
}
# Under classifier-free guidance these run the unconditional and conditional halves in one batch (SD3's transformer
# as its adaptive step cache's parts too).
GUIDED_STAGES = (CLIP, CLIP2, T5, UNET, UNET_SHALLOW, TRANSFORMER,
                 *(part_stage(TRANSFORMER, part) for part in (HEAD, TAIL, OUT)))
# These see one image whatever the batch: the input image (and inpainting's masked one) is encoded once and its
# latents repeated, as diffusers does with one image for several prompts.
SINGLE_IMAGE_STAGES = (VAE_ENCODER,)


def stage_component(source, name: str) -> str:
    """The component stage `name` reads in this model (its family may say another than its stage model's)."""
    return source.family.stage_component(name, STAGE_MODELS[name].component)


def text_to_image_stages(source) -> tuple[str, ...]:
    """The stages text-to-image runs for this model: its family's text encoders (those it has: an SDXL refiner has no
    first one, an SD3 model may have no T5), its family's denoiser, the VAE decoder."""
    stages = (*source.family.text_stages, source.family.denoiser_stage, VAE)
    return tuple(name for name in stages if stage_component(source, name) in source.components)


def image_to_image_stages(source) -> tuple[str, ...]:
    """The stages image-to-image and inpainting run: text-to-image's and the VAE encoder (input image to latents)."""
    return (*text_to_image_stages(source), VAEEncoderModel.name)


def stage_models(source, names, cache_branch: int | None = None, controlnets=(),
                 adaptive_cache: bool = False) -> list[StageModel]:
    """The stage models of `names` for `source`; with a step-cache branch (models.unet_cache), the UNet's returns its
    deep features there and the shallow pass's stage follows it; with ControlNets ((ControlNetSource, scale) each),
    the UNet (and its shallow pass) takes their residuals and their stages follow it, each with its shallow pass
    under the cache and its conditioning image's; a transformer takes their block samples, their stages follow it,
    and the VAE encoder makes their control images' latents (added where `names` lack it). With `adaptive_cache`, a
    transformer's three parts follow it (models.transformer_cache)."""
    models = []
    transformer_controlled = controlnets and source.family.denoiser_stage in CONTROLNET_STAGE_MODELS
    if transformer_controlled and source.family.denoiser_stage in names and VAE_ENCODER not in names:
        names = (*names, VAE_ENCODER)
    for name in names:
        if name == UNET:
            controlled = bool(controlnets)
            models.append(UNetModel(source, cache_branch, controlled))
            if cache_branch is not None:
                models.append(UNetShallowModel(source, cache_branch, controlled))
            for index, (controlnet, scale) in enumerate(controlnets):
                models.append(ControlNetStageModel(source, controlnet, index, scale))
                if cache_branch is not None:
                    models.append(ShallowControlNetStageModel(source, controlnet, index, cache_branch, scale))
                models.append(ControlNetImageModel(source, controlnet, index))
        elif name == source.family.denoiser_stage and adaptive_cache and name in CACHED_TRANSFORMERS:
            models.extend(cached_transformer_stages(source))
        elif name == source.family.denoiser_stage and controlnets:
            models.extend(controlled_transformer_stages(source, controlnets))
        else:
            models.append(STAGE_MODELS[name](source))
    return models


def check_controlnets(source, controlnets) -> None:
    """A UsageError where the ControlNets ((ControlNetSource, scale) each) cannot steer the model's denoiser: each
    against the model (ControlNetSource.check_for; a transformer's further:
    models.flow_controlnet.check_transformer_controlnet), a transformer's against each other (check_together)."""
    steers_a_transformer = source.family.denoiser_stage in CONTROLNET_STAGE_MODELS
    for controlnet, _ in controlnets:
        controlnet.check_for(source)
        if steers_a_transformer:
            check_transformer_controlnet(controlnet, source)
    if controlnets and steers_a_transformer:
        check_together(controlnets)


def stage_batch(stage: str, images: int, guided: bool) -> int:
    """The batch `stage` sees for `images` images."""
    if stage in SINGLE_IMAGE_STAGES:
        return 1
    steering = is_controlnet_stage(stage) or is_shallow_controlnet_stage(stage) or is_control_image_stage(stage)
    return images * 2 if guided and (stage in GUIDED_STAGES or steering) else images


def check_model_stages(source, names) -> None:
    """A UsageError for a stage whose component the model has not."""
    for name in names:
        component = stage_component(source, name)
        if component not in source.components:
            raise UsageError(f"stage {name} needs component '{component}', which model '{source.name}' does not have")
