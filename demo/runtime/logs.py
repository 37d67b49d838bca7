"""Keep third-party chatter (progress bars, advisory warnings) out of the demo's output unless --verbose."""

from __future__ import annotations

import logging
import os
import warnings


def configure_library_logging(verbose: bool) -> None:
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    import diffusers
    import onnxruntime
    import torch
    import transformers
    from polygraphy.logger import G_LOGGER

    if verbose:
        return
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)  # export traces known branches
    diffusers.utils.logging.set_verbosity_error()
    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    G_LOGGER.module_severity = G_LOGGER.WARNING
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    # the optimizer's shape inference cannot decide the bounds of SD3's position-embedding crop: a warning a dimension
    logging.getLogger("onnxruntime.tools.symbolic_shape_infer").setLevel(logging.ERROR)
    onnxruntime.set_default_logger_severity(3)
