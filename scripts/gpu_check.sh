#!/usr/bin/env bash
# On a GPU machine: build the plugin library (all five architectures), run the kernel GPU tests (memcheck
# included), then the plugin benchmark.
#
# Usage: bash scripts/gpu_check.sh [OUT_DIR]   logs and JSON into OUT_DIR (default: gpu-out in the repository root)
# Environment: PYTEST_ARGS (more pytest arguments), SKIP_BENCH=1 (the tests alone), BENCH_ARGS (for bench_plugins.py).
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=$(d=${1:-$root/gpu-out} && mkdir -p "$d" && cd "$d" && pwd) || exit 2
cd "$root"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.txt"
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release > "$out/cmake.log" 2>&1 &&
  cmake --build build -j "$(nproc)" >> "$out/cmake.log" 2>&1 || { tail -30 "$out/cmake.log"; exit 1; }
cuobjdump --list-elf build/libsdplugins.so | grep -o 'sm_[0-9]*' | sort | uniq -c | tee "$out/archs.txt"
python3 -m pytest -q -p no:cacheprovider tests/test_plugins_gpu.py ${PYTEST_ARGS:-} 2>&1 | tee "$out/pytest.log" | tail -25
[ "${SKIP_BENCH:-0}" = 1 ] || python3 scripts/bench_plugins.py --json "$out/bench_plugins.json" ${BENCH_ARGS:-} 2>&1 | tee "$out/bench.log"
