"""The pipeline families: one module per family, each a diffusers pipeline as step methods (encode prompt, prepare
latents, denoise, decode) over stages of any backend (demo.backends.base.Stage), which every mode and family reuses.

- text_to_image: Text2ImagePipeline (StableDiffusionPipeline), the steps the others build on;
- sdxl: SDXLPipeline (StableDiffusionXLPipeline) and ExpertsPipeline (SDXL base, then refiner);
- image_to_image: image-to-image and inpainting, SD 1.x/2.x and SDXL;
- controlnet: every mode and family with ControlNets (diffusers' ControlNet pipelines);
- lora: LoRA files applied to the stages; batch: what one call runs; images, timer: pixels, and stage times.
"""

from __future__ import annotations

import torch

from demo.backends.base import Stage
from demo.pipelines.batch import Batch
from demo.pipelines.controlnet import (
    ControlNetImage2ImagePipeline,
    ControlNetInpaintPipeline,
    ControlNetPipeline,
    SDXLControlNetImage2ImagePipeline,
    SDXLControlNetInpaintPipeline,
    SDXLControlNetPipeline,
)
from demo.pipelines.image_to_image import (
    Image2ImagePipeline,
    InpaintPipeline,
    SDXLImage2ImagePipeline,
    SDXLInpaintPipeline,
)
from demo.pipelines.images import image_psnr, to_uint8
from demo.pipelines.sdxl import ExpertsPipeline, SDXLPipeline
from demo.pipelines.text_to_image import Text2ImagePipeline
from demo.pipelines.timer import StageTimer
from demo.request import IMAGE_TO_IMAGE, INPAINTING, TEXT_TO_IMAGE
from models import is_controlnet_stage
from models.source import ModelSource

# mode -> (the SD 1.x/2.x pipeline, the SDXL one)
PIPELINES = {
    TEXT_TO_IMAGE: (Text2ImagePipeline, SDXLPipeline),
    IMAGE_TO_IMAGE: (Image2ImagePipeline, SDXLImage2ImagePipeline),
    INPAINTING: (InpaintPipeline, SDXLInpaintPipeline),
}
CONTROLNET_PIPELINES = {
    TEXT_TO_IMAGE: (ControlNetPipeline, SDXLControlNetPipeline),
    IMAGE_TO_IMAGE: (ControlNetImage2ImagePipeline, SDXLControlNetImage2ImagePipeline),
    INPAINTING: (ControlNetInpaintPipeline, SDXLControlNetInpaintPipeline),
}

__all__ = ["PIPELINES", "Batch", "ExpertsPipeline", "Image2ImagePipeline", "InpaintPipeline", "SDXLImage2ImagePipeline",
           "SDXLInpaintPipeline", "SDXLPipeline", "StageTimer", "Text2ImagePipeline", "image_psnr", "make_pipeline",
           "to_uint8"]


def make_pipeline(source: ModelSource, stages: dict[str, Stage], scheduler_name: str, device: torch.device,
                  dtype: torch.dtype, mode: str = TEXT_TO_IMAGE, cache_interval: int = 1) -> Text2ImagePipeline:
    """The pipeline this model needs for `mode` (a request's), over `stages` (with ControlNet stages: its ControlNet
    pipeline), with the step cache's interval (used where `stages` has the shallow UNet)."""
    controlled = any(map(is_controlnet_stage, stages))
    family = (CONTROLNET_PIPELINES if controlled else PIPELINES)[mode][source.is_xl]
    return family(source, stages, scheduler_name, device, dtype, cache_interval)
