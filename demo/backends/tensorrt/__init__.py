"""The TensorRT backends, one per flavour (TensorRT 8.6 to 11, TensorRT for RTX: flavour.py): each stage exported to
ONNX, optimized with our plugin passes, built into an engine cached by what made it (build.py), run behind the stage
interface (runtime.py), and refitted in place for LoRA files (refit.py). Their options (options.py, light), the checked
settings those give (settings.py), an INT8 UNet's calibration (int8.py), and the backend object (backend.py)."""
