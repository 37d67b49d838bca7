#!/usr/bin/env bash
# On a GPU machine with TensorRT's Python package: build the kernels and libsdplugins_trt.so against TensorRT's
# headers, then run every plugin inside a one-node engine (tests/test_trt_plugins_gpu.py) and the Seq2Spatial kernel
# tests of both residual layouts.
#
# Usage: bash scripts/trt_plugin_check.sh [DIR] [OUT_DIR]
#   DIR (or $TENSORRT_INCLUDE_DIR): the folder holding NvInfer.h, of the TensorRT version `import tensorrt` loads.
#   OUT_DIR: logs (default: gpu-out in the repository root). Environment: PYTEST_ARGS (more pytest arguments).
set -uo pipefail
headers=${1:-${TENSORRT_INCLUDE_DIR:-}}
[ -f "$headers/NvInfer.h" ] || { echo "usage: $0 DIR [OUT_DIR] (or TENSORRT_INCLUDE_DIR=DIR), DIR holding NvInfer.h; got '$headers'"; exit 2; }
headers=$(cd "$headers" && pwd)
root=$(cd "$(dirname "$0")/.." && pwd)
out=$(d=${2:-$root/gpu-out} && mkdir -p "$d" && cd "$d" && pwd) || exit 2
cd "$root"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv | tee "$out/gpu.txt"
python3 -c "import tensorrt as trt; print('tensorrt', trt.__version__)" 2>&1 | tee -a "$out/gpu.txt"
cmake -S . -B build -DTENSORRT_INCLUDE_DIR="$headers" > "$out/cmake.log" 2>&1 &&
  cmake --build build -j "$(nproc)" >> "$out/cmake.log" 2>&1 || { tail -30 "$out/cmake.log"; exit 1; }
grep sdplugins_trt "$out/cmake.log"
python3 -m pytest -q -p no:cacheprovider tests/test_trt_plugins_gpu.py tests/test_plugins_gpu.py::test_seq2spatial \
  tests/test_plugins_gpu.py::test_seq2spatial_op_with_sequence_residual ${PYTEST_ARGS:-} 2>&1 | tee "$out/pytest.log" | tail -30
