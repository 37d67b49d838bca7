#!/bin/bash
# SDXL on TensorRT 8.6, one H200 lease (issue 22), from the repository root once ../shared/trt86's 15 carry parts
# are on the box (docs/gpu-box.md), with .whl carried:
#   TRT86_SHA=<sha make_parts.sh printed> LEVEL=1 bash results/sdxl-h200/sdxl_trt.sh start   # detached
#   bash results/sdxl-h200/sdxl_trt.sh poll                                                # ~9 min; copies to $OUT
# start: TensorRT 8.6 and the wheels, the plugin library (sm_90), sdxl-arch generated once, then the engines of
# `--plugins auto` and of all plugins built side by side (build-engines, the folders the benchmark's
# tensorrt-auto and tensorrt-plugins contenders look in), their ONNX deleted once built (the disk holds 64 GiB),
# then one benchmark run: diffusers eager, both engine sets, our torch backend with all kernels.
L=/tmp/sdxl LEVEL=${LEVEL:-1}
SHAPE=(--model sdxl-arch --height 1024 --width 1024) REQUEST=(--seed 0 --scheduler Euler --guidance-scale 5.0)
ENGINES=(--optimization-level "$LEVEL" --disable-tactic-sources CUDNN)
step() { echo "[sdxl] $(date +%T) $*" >>$L/steps.log; }
case "$1" in
start)
  rm -rf $L && mkdir -p $L
  setsid nohup bash "$0" work </dev/null >>$L/steps.log 2>&1 &
  sleep 2; cat $L/steps.log ;;
work)
  step "setup"
  source scripts/box_trt86_env.sh >$L/setup.log 2>&1 || { step "setup failed"; exit 1; }
  export DEMO_DIFFUSION_CACHE=/tmp/ddcache
  nvidia-smi >$L/nvidia-smi.txt 2>&1
  (cmake -S . -B build -DCMAKE_CUDA_ARCHITECTURES=90 -DTENSORRT_INCLUDE_DIR=/opt/k/misc/src/include \
    && cmake --build build -j 8) >$L/cmake.log 2>&1 &
  step "generating sdxl-arch"
  python3 -c "from models.source import resolve_model; resolve_model('sdxl-arch')" >$L/generate.log 2>&1 \
    || { step "generation failed"; exit 1; }
  wait || { step "plugin library failed"; exit 1; }
  auto=$(python3 -c "from bench.runner import plugin_dir_suffix; from models.plugin_set import parse_plugin_set
print(plugin_dir_suffix(parse_plugin_set('auto')))")
  for set in "auto:$auto" "all:-plugins"; do
    name=${set%%:*} suffix=${set#*:}
    step "building engines: --plugins $name (level $LEVEL) in engine$suffix"
    (python3 scripts/build_engines.py "${SHAPE[@]}" --backend tensorrt --build-static-batch "${ENGINES[@]}" \
      --plugins $name --onnx-dir onnx$suffix --engine-dir engine$suffix --report $L/build-$name.json \
      && rm -rf onnx$suffix; echo "exit $?") >$L/build-$name.log 2>&1 &
  done
  wait
  step "builds done: $(grep -h '^exit' $L/build-*.log | tr '\n' ' ')"
  step "benchmark"
  python3 scripts/benchmark.py "${SHAPE[@]}" "${REQUEST[@]}" --denoising-steps 30 "${ENGINES[@]}" \
    --contenders diffusers-eager,tensorrt-plugins,tensorrt-auto,ours --runs 3 --warmup-runs 1 \
    --results-dir $L/results --work-dir $L/images >$L/bench.log 2>&1
  step "benchmark exit $?"
  python3 - >$L/psnr.txt 2>&1 <<'EOF'
# The issue's check: each engine image against our torch backend's (the benchmark compares with eager's).
from pathlib import Path
import numpy as np
from PIL import Image
from demo.pipeline import image_psnr
found = {p.stem: np.asarray(Image.open(p)) for p in Path("/tmp/sdxl/images").rglob("*.png")}
for label in ("tensorrt-plugins", "tensorrt-auto"):
    if label in found and "ours" in found:
        a, b = found[label].astype(int), found["ours"].astype(int)
        print(f"{label} vs ours: PSNR {image_psnr(found[label], found['ours']):.2f} dB, max diff {abs(a - b).max()}")
EOF
  step "finished" ;;
poll)
  for _ in $(seq 1 100); do grep -q "finished\|failed" $L/steps.log && break; sleep 5; done
  cat $L/steps.log; tail -n 4 $L/build-*.log $L/bench.log 2>/dev/null | cut -c1-300
  grep -h "\[sd-benchmark\]" $L/bench.log 2>/dev/null | tail -n 12; cat $L/psnr.txt 2>/dev/null
  df -h / /tmp | tail -n 2; free -g | head -2
  nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader
  mkdir -p "$OUT" && cp -r $L/*.log $L/*.json $L/*.txt $L/results "$OUT/" 2>/dev/null
  mkdir -p "$OUT/images" && find $L/images -name '*.png' -exec cp {} "$OUT/images/" \; 2>/dev/null ;;
*)
  echo "usage: bash results/sdxl-h200/sdxl_trt.sh start | poll"; exit 2 ;;
esac
