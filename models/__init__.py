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
