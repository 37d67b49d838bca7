"""The backends that run a pipeline's stages, as objects with their capabilities (base.Backend), in a registry
(registry.py: the choice of one for a spec); each backend a package of its own (torch/, tensorrt/) whose options
module is light to import. Nothing outside this package tests a backend's name or a stage's type: it asks the
backend, or the stage."""

from demo.backends.tensorrt.flavour import FLAVOURS

AUTO = "auto"  # a backend, a plugin set or a compile mode left to what runs best here
TORCH = "torch"  # the torch backend's name
REFERENCE_BACKEND = TORCH  # the backend every other is compared with (compare-backends, INT8 calibration)
INT8_UNET = "INT8 UNet"  # the option a backend lists when its UNet is quantized: reports name the run by it
BACKENDS = (AUTO, TORCH, *FLAVOURS)  # what a spec's backend may be (registry.REGISTRY: an object each)
