"""Per-stage model classes sharing one interface (see models.base.StageModel)."""

from models.base import StageModel
from models.clip import CLIPModel
from models.unet import UNetModel
from models.vae import VAEDecoderModel, VAEEncoderModel

STAGE_MODELS: dict[str, type[StageModel]] = {
    cls.name: cls for cls in (CLIPModel, UNetModel, VAEDecoderModel, VAEEncoderModel)
}
# The stages text-to-image runs, in order.
TEXT_TO_IMAGE_STAGES = ("clip", "unet", "vae")
# Under classifier-free guidance these run the unconditional and conditional halves in one batch.
GUIDED_STAGES = ("clip", "unet")


def stage_batch(stage: str, images: int, guided: bool) -> int:
    """The batch `stage` sees for `images` images."""
    return images * 2 if guided and stage in GUIDED_STAGES else images
