#!/bin/bash
# Issue 20 on one H200 x2 lease (an H100 x2 serves too, its figures then kept apart; not run yet): kHWC8 GroupNorm and --int8 engines on TensorRT 8.6 against the torch
# backend, sd1.5-arch 512x512, 50 DDIM steps, seed 0. From the repository root once ../shared/trt86's 15 carry parts
# are on the box (docs/gpu-box.md), with .whl carried:
#   TRT86_SHA=<sha make_parts.sh printed> LEVEL=3 bash results/int8-h200/lease.sh start   # detached
#   bash results/int8-h200/lease.sh poll                                                # ~9 min; tars /tmp/e20 to $OUT
# GPU 1: the GPU tests of what is new (GroupNorm in kHWC8 inside an engine, the INT8 engine of tiny), then sd-ablation
#   "none,+GroupNorm,+Seq2Spatial" (plugin-free, attention + LayerNorm + GroupNorm, all six) with per-layer profiles:
#   the reformat time per UNet call with our GroupNorm now offering kHWC8; --update-defaults rewrites plugins_auto.
# GPU 0: the engines of the benchmark's tensorrt-auto, tensorrt-int8 and tensorrt-plugins built side by side into the
#   folders it looks in (build-engines; the INT8 UNet calibrates on the built-in prompts first), then one sd-benchmark
#   run of ours-defaults, tensorrt-auto, tensorrt-plugins, tensorrt-int8 (the INT8 row also against tensorrt-auto).
# Six UNet builds at once on 32 cores: at level 3 they may not fit one 30-minute hold; LEVEL=2 is the fallback, and
# the level goes into every table.
L=/tmp/e20 LEVEL=${LEVEL:-3}
COMMON=(--model sd1.5-arch --disable-tactic-sources CUDNN --optimization-level "$LEVEL")
REQUEST=(--seed 0 --scheduler DDIM)
step() { echo "[e20] $(date +%T) $*" >>$L/steps.log; }
build() {  # NAME PLUGINS SUFFIX [--int8]: build-engines into the folders the benchmark's contender NAME looks in
  (CUDA_VISIBLE_DEVICES=0 python3 scripts/build_engines.py "${COMMON[@]}" --backend tensorrt --height 512 \
    --width 512 --build-static-batch --plugins "$2" --onnx-dir onnx$3 --engine-dir engine$3 "${@:4}" \
    --report $L/build-$1.json; echo "exit $?") >$L/build-$1.log 2>&1 &
}
case "$1" in
start)
  rm -rf $L && mkdir -p $L
  setsid nohup bash "$0" work </dev/null >>$L/steps.log 2>&1 &
  sleep 2; cat $L/steps.log ;;
work)
  step "setup (level $LEVEL)"
  source scripts/box_trt86_env.sh >$L/setup.log 2>&1 || { step "setup failed"; exit 1; }
  export DEMO_DIFFUSION_CACHE=/tmp/ddcache
  nvidia-smi >$L/nvidia-smi.txt 2>&1
  (cmake -S . -B build -DCMAKE_CUDA_ARCHITECTURES=90 -DTENSORRT_INCLUDE_DIR=/opt/k/misc/src/include \
    && cmake --build build -j 16) >$L/cmake.log 2>&1 || { step "plugin library failed"; exit 1; }
  python3 -c "from models.source import resolve_model; resolve_model('sd1.5-arch')" >$L/generate.log 2>&1 \
    || { step "generation failed"; exit 1; }
  auto=$(python3 -c "from bench.runner import plugin_dir_suffix; from models.plugin_set import parse_plugin_set
print(plugin_dir_suffix(parse_plugin_set('auto')))")
  step "GPU 0: engines of tensorrt-auto and tensorrt-int8 in engine$auto, tensorrt-plugins in engine-plugins"
  build auto auto "$auto"; build plugins all -plugins
  until [ -f "onnx$auto/unet.onnx.json" ] || grep -q '^exit' $L/build-auto.log; do sleep 5; done
  build int8 auto "$auto" --int8 --stages unet  # its export is the auto set's (the same key), waited for above
  step "GPU 1: GPU tests, then the ablation"
  (CUDA_VISIBLE_DEVICES=1 timeout 900 python3 -m pytest -q -s -p no:cacheprovider tests/test_trt_plugins_gpu.py \
     tests/test_engines_gpu.py; echo "exit $?") >$L/gpu-tests.log 2>&1
  step "GPU tests: $(tail -2 $L/gpu-tests.log | tr '\n' ' ')"
  (CUDA_VISIBLE_DEVICES=1 python3 scripts/ablation.py "${COMMON[@]}" "${REQUEST[@]}" --update-defaults \
     --work-dir /tmp/ablation --configs "none,+GroupNorm,+Seq2Spatial" --parallel-builds 3 --build-gpus 1 \
     --results-dir $L/results; echo "exit $?") >$L/ablation.log 2>&1 &
  until [ "$(grep -l '^exit' $L/build-*.log | wc -l)" = 3 ]; do sleep 10; done
  step "builds: $(grep -H '^exit' $L/build-*.log | sed 's|.*/build-||' | tr '\n' ' ')"
  (CUDA_VISIBLE_DEVICES=0 python3 scripts/benchmark.py "${COMMON[@]}" "${REQUEST[@]}" --results-dir $L/results \
     --contenders ours-defaults,tensorrt-auto,tensorrt-plugins,tensorrt-int8; echo "exit $?") >$L/benchmark.log 2>&1
  step "benchmark: $(tail -1 $L/benchmark.log)"
  wait
  step "finished: ablation $(tail -1 $L/ablation.log)" ;;
poll)
  for _ in $(seq 1 100); do grep -q "finished\|failed" $L/steps.log && break; sleep 5; done
  cat $L/steps.log; tail -n 3 $L/build-*.log $L/gpu-tests.log 2>/dev/null | cut -c1-300
  grep -h "^\[sd-" $L/benchmark.log $L/ablation.log 2>/dev/null | tail -8
  mkdir -p "$OUT" && cp $L/results/*.md "$OUT/" 2>/dev/null; tar -czf "$OUT/e20.tgz" -C /tmp e20 ;;
*)
  echo "usage: bash results/int8-h200/lease.sh start | poll"; exit 2 ;;
esac
