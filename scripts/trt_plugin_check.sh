#!/usr/bin/env bash
# One device call on a GPU machine with TensorRT's Python package: build the kernels and libsdplugins_trt.so
# against TensorRT's headers, then run every plugin inside a one-node engine (tests/test_trt_plugins_gpu.py)
# and the Seq2Spatial kernel tests of both residual layouts. Logs go to $OUT (or ./gpu-out).
#
# Usage: bash scripts/trt_plugin_check.sh [DIR]   DIR (or $TENSORRT_INCLUDE_DIR): the one with NvInfer.h.
# On the H100/H200 box with the TensorRT 8.6 kit set up (../shared/trt86/README.md): DIR is
# /opt/k/misc/src/include (the kit's 8.6 headers), and /opt/trt86/env.sh is sourced here.
set -uo pipefail
cd "$(dirname "$0")/.."
headers=${1:-${TENSORRT_INCLUDE_DIR:-}}
[ -f "$headers/NvInfer.h" ] || { echo "usage: $0 DIR (or TENSORRT_INCLUDE_DIR=DIR), DIR holding NvInfer.h; got '$headers'"; exit 2; }
[ -f /opt/trt86/env.sh ] && source /opt/trt86/env.sh
out=${OUT:-gpu-out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv | tee "$out/gpu.txt"
python3 -c "import tensorrt as trt; print('tensorrt', trt.__version__)" 2>&1 | tee -a "$out/gpu.txt"
cmake -S . -B build -DTENSORRT_INCLUDE_DIR="$headers" > "$out/cmake.log" 2>&1 &&
  cmake --build build -j "$(nproc)" >> "$out/cmake.log" 2>&1 || { tail -30 "$out/cmake.log"; exit 1; }
grep sdplugins_trt "$out/cmake.log"
python3 -m pytest -q -p no:cacheprovider tests/test_trt_plugins_gpu.py tests/test_plugins_gpu.py::test_seq2spatial \
  tests/test_plugins_gpu.py::test_seq2spatial_op_with_sequence_residual ${PYTEST_ARGS:-} 2>&1 | tee "$out/pytest.log" | tail -30
