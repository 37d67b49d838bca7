#!/usr/bin/env bash
# One device call: build the plugin library (all five architectures), run the GPU tests (memcheck
# included), then the plugin benchmark. Logs and JSON go to $OUT (or ./gpu-out).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.txt"
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release > "$out/cmake.log" 2>&1 &&
  cmake --build build -j 16 >> "$out/cmake.log" 2>&1 || { tail -30 "$out/cmake.log"; exit 1; }
cuobjdump --list-elf build/libsdplugins.so | grep -o 'sm_[0-9]*' | sort | uniq -c | tee "$out/archs.txt"
python3 -m pytest -q -p no:cacheprovider tests/test_plugins_gpu.py ${PYTEST_ARGS:-} 2>&1 | tee "$out/pytest.log" | tail -25
[ "${SKIP_BENCH:-0}" = 1 ] || python3 scripts/bench_plugins.py --json "$out/bench_plugins.json" ${BENCH_ARGS:-} 2>&1 | tee "$out/bench.log"
