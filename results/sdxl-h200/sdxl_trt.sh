#!/bin/bash
# SDXL on TensorRT 8.6, one H200 lease (issue 22), from the repository root once ../shared/trt86's 15 carry parts
# are on the box (docs/gpu-box.md), with .whl carried:
#   TRT86_SHA=<sha make_parts.sh printed> LEVEL=1 bash results/sdxl-h200/sdxl_trt.sh start   # detached
#   bash results/sdxl-h200/sdxl_trt.sh poll                                                # ~9 min; copies to $OUT
# start: TensorRT 8.6 and the wheels, the plugin library (sm_90), sdxl-arch generated once, then the engines of
# all plugins and of `--plugins auto` (build-engines, into the folders the benchmark's tensorrt-plugins and
# tensorrt-auto contenders look in), four builds side by side because a 30-minute hold cannot take them one after
# another: each set's UNet alone and its text encoders and VAE together; the auto UNet starts from a copy of the all
# set's ONNX export (the same export, keyed alike; onnx refuses hard-linked external data) once that is written.
# ONNX folders go once their engines are built (the disk holds 64 GiB). SDXL's VAE runs in fp32 and gets no plugins.
# Then one benchmark run: diffusers eager, both engine sets, our torch backend with all kernels. BENCH_AFTER_S after
# start the benchmark starts without the auto set if that is still building (the hold ends 30 minutes after the
# first carry call). The box returns only a few files per call: collect with a poll that tars /tmp/sdxl into $OUT.
L=/tmp/sdxl LEVEL=${LEVEL:-1} BENCH_AFTER_S=${BENCH_AFTER_S:-1200}
SHAPE=(--model sdxl-arch --height 1024 --width 1024) REQUEST=(--seed 0 --scheduler Euler --guidance-scale 5.0)
ENGINES=(--optimization-level "$LEVEL" --disable-tactic-sources CUDNN)
step() { echo "[sdxl] $(date +%T) $*" >>$L/steps.log; }
build() {  # NAME PLUGINS SUFFIX STAGES: one build-engines run, detached into the background, logged as build-NAME
  (python3 scripts/build_engines.py "${SHAPE[@]}" --backend tensorrt --build-static-batch "${ENGINES[@]}" \
    --plugins "$2" --stages "$4" --onnx-dir onnx$3 --engine-dir engine$3 --report $L/build-$1.json
   echo "exit $?") >$L/build-$1.log 2>&1 &
}
copy_export() {  # FROM TO: the UNet's ONNX export (every file its manifest lists, and the manifest)
  mkdir -p "$2" && python3 - "$1" "$2" <<'PY'
import json, shutil, sys
src, dst = sys.argv[1:]
manifest = json.load(open(f"{src}/unet.onnx.json"))
for name in [*manifest["files"], "unet.onnx.json"]:
    shutil.copyfile(f"{src}/{name}", f"{dst}/{name}")
PY
}
case "$1" in
start)
  rm -rf $L && mkdir -p $L && date +%s >$L/started
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
  step "building (level $LEVEL): all plugins in engine-plugins, --plugins auto in engine$auto"
  build unet-all all -plugins unet; build rest-all all -plugins clip,clip2,vae
  build rest-auto auto "$auto" clip,clip2,vae
  until [ -f onnx-plugins/unet.onnx.json ] || grep -q '^exit' $L/build-unet-all.log; do sleep 5; done
  copy_export onnx-plugins onnx$auto && build unet-auto auto "$auto" unet
  step "UNet exported; the auto UNet started from it"
  deadline=$(( $(cat $L/started) + BENCH_AFTER_S )) contenders=diffusers-eager,tensorrt-plugins,tensorrt-auto,ours
  until [ "$(grep -l '^exit' $L/build-*.log | wc -l)" = 4 ]; do
    if [ "$(date +%s)" -gt $deadline ] && grep -q '^exit' $L/build-unet-all.log $L/build-rest-all.log \
        && [ "$(grep -l '^exit' $L/build-unet-all.log $L/build-rest-all.log | wc -l)" = 2 ]; then
      step "the auto set is late: stopped; the benchmark goes on without it"
      pkill -f -- "--plugins auto"; sleep 3; contenders=diffusers-eager,tensorrt-plugins,ours; break
    fi
    sleep 5
  done
  rm -rf onnx-plugins onnx$auto
  step "builds done: $(grep -H '^exit' $L/build-*.log | sed 's|.*/build-||' | tr '\n' ' ')"
  step "benchmark: $contenders"
  python3 scripts/benchmark.py "${SHAPE[@]}" "${REQUEST[@]}" --denoising-steps 30 "${ENGINES[@]}" \
    --contenders $contenders --runs 3 --warmup-runs 1 --results-dir $L/results --work-dir $L/images >$L/bench.log 2>&1
  step "benchmark exit $?"
  python3 - >$L/psnr.txt 2>&1 <<'PY'
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
PY
  step "finished" ;;
poll)
  for _ in $(seq 1 100); do grep -q "finished\|failed" $L/steps.log && break; sleep 5; done
  cat $L/steps.log; tail -n 3 $L/build-*.log $L/bench.log 2>/dev/null | cut -c1-300
  grep -h "\[sd-benchmark\]" $L/bench.log 2>/dev/null | tail -n 12; cat $L/psnr.txt 2>/dev/null
  df -h / /tmp | tail -n 2; free -g | head -2
  nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader
  mkdir -p "$OUT" && tar -czf "$OUT/sdxl.tgz" -C /tmp sdxl ;;
*)
  echo "usage: bash results/sdxl-h200/sdxl_trt.sh start | poll"; exit 2 ;;
esac
