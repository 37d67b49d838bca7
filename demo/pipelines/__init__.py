"""The pipelines of each model family (models.families): each a diffusers pipeline as step methods (encode prompt,
prepare latents, denoise, decode) over stages of any backend (demo.backends.base.Stage), which every mode and family
reuses; PIPELINES says which class runs each family's modes.

- text_to_image: Text2ImagePipeline (StableDiffusionPipeline), the steps the others build on;
- sdxl: SDXLPipeline (StableDiffusionXLPipeline) and ExpertsPipeline (SDXL base, then refiner);
- sd3: SD3Pipeline (StableDiffusion3Pipeline), and FlowPipeline, the steps of every family that predicts a flow;
- flux: FluxPipeline (FluxPipeline);
- image_to_image: image-to-image and inpainting, SD 1.x/2.x, SDXL, SD3 and Flux;
- controlnet: every mode of SD 1.x/2.x and SDXL with ControlNets (diffusers' ControlNet pipelines); flow_controlnet:
  SD3's and Flux's (text-to-image; Flux's image-to-image too);
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
from demo.pipelines.flow_controlnet import (
    FluxControlNetImage2ImagePipeline,
    FluxControlNetPipeline,
    SD3ControlNetPipeline,
)
from demo.pipelines.flux import FluxPipeline
from demo.pipelines.image_to_image import (
    FluxImage2ImagePipeline,
    FluxInpaintPipeline,
    Image2ImagePipeline,
    InpaintPipeline,
    SD3Image2ImagePipeline,
    SD3InpaintPipeline,
    SDXLImage2ImagePipeline,
    SDXLInpaintPipeline,
)
from demo.pipelines.images import image_psnr, to_uint8
from demo.pipelines.sd3 import SD3Pipeline
from demo.pipelines.sdxl import ExpertsPipeline, SDXLPipeline
from demo.pipelines.text_to_image import Text2ImagePipeline
from demo.pipelines.timer import StageTimer
from demo.request import IMAGE_TO_IMAGE, INPAINTING, TEXT_TO_IMAGE
from models import is_controlnet_stage
from models.families import FLUX, SD, SD3, SDXL
from models.source import ModelSource
from models.step_cache import NO_CACHE, StepCache

# family name -> mode -> (its pipeline, the same with ControlNets)
PIPELINES = {
    SD.name: {
        TEXT_TO_IMAGE: (Text2ImagePipeline, ControlNetPipeline),
        IMAGE_TO_IMAGE: (Image2ImagePipeline, ControlNetImage2ImagePipeline),
        INPAINTING: (InpaintPipeline, ControlNetInpaintPipeline),
    },
    SDXL.name: {
        TEXT_TO_IMAGE: (SDXLPipeline, SDXLControlNetPipeline),
        IMAGE_TO_IMAGE: (SDXLImage2ImagePipeline, SDXLControlNetImage2ImagePipeline),
        INPAINTING: (SDXLInpaintPipeline, SDXLControlNetInpaintPipeline),
    },
    SD3.name: {  # None: no ControlNets in that mode (diffusers has no such pipeline), refused when planned
        TEXT_TO_IMAGE: (SD3Pipeline, SD3ControlNetPipeline),
        IMAGE_TO_IMAGE: (SD3Image2ImagePipeline, None),
        INPAINTING: (SD3InpaintPipeline, None),
    },
    FLUX.name: {
        TEXT_TO_IMAGE: (FluxPipeline, FluxControlNetPipeline),
        IMAGE_TO_IMAGE: (FluxImage2ImagePipeline, FluxControlNetImage2ImagePipeline),
        INPAINTING: (FluxInpaintPipeline, None),
    },
}

__all__ = ["PIPELINES", "Batch", "ExpertsPipeline", "FluxImage2ImagePipeline", "FluxInpaintPipeline", "FluxPipeline",
           "Image2ImagePipeline", "InpaintPipeline", "SD3Image2ImagePipeline", "SD3InpaintPipeline", "SD3Pipeline",
           "SDXLImage2ImagePipeline", "SDXLInpaintPipeline", "SDXLPipeline", "StageTimer", "Text2ImagePipeline",
           "image_psnr", "make_pipeline", "to_uint8"]


def make_pipeline(source: ModelSource, stages: dict[str, Stage], scheduler, device: torch.device,
                  dtype: torch.dtype, mode: str = TEXT_TO_IMAGE, cache: StepCache = NO_CACHE) -> Text2ImagePipeline:
    """The pipeline this model's family runs `mode` (a request's) with, over `stages` (with ControlNet stages: its
    ControlNet pipeline), with `scheduler` (a diffusers scheduler, or our name of one) and the step cache (used where
    `stages` has the shallow UNet)."""
    controlled = any(map(is_controlnet_stage, stages))
    pipeline = PIPELINES[source.family.name][mode][int(controlled)]
    return pipeline(source, stages, scheduler, device, dtype, cache)
