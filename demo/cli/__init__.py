"""The toolkit's commands (console scripts in pyproject.toml; thin entry points in demo/ and scripts/ run them
from a checkout): demo-diffusion (generate), build-engines, export-onnx, compare-backends."""
