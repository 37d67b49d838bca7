#!/bin/bash
# Issue 20 in one H200 x2 lease (an H100 x2 serves too, its figures then kept apart): our kHWC8 GroupNorm and --int8
# engines on TensorRT 8.6 against the torch backend, sd1.5-arch 512x512, 50 DDIM steps, seed 0, builder level LEVEL
# (default 3, the engines' default). From the repository root once ../shared/trt86's 15 carry parts are on the box
# (docs/gpu-box.md), with .whl carried:
#   TRT86_SHA=<sha make_parts.sh printed> bash results/int8-h200/lease.sh start   # detached
#   bash results/int8-h200/lease.sh poll                                        # ~9 min; tars /tmp/e20 to $OUT
# GPU 0 builds only tensorrt-auto's engines (the default engine path), so that nothing else shares its tactic timing.
# GPU 1 builds tensorrt-plugins' engines, then tensorrt-int8's UNet once the auto UNet's ONNX is exported (the INT8
# UNet calibrates on the built-in prompts first), and runs the GPU tests of what is new (GroupNorm in kHWC8 inside an
# engine, the INT8 engine of tiny).
# Benchmark A on GPU 0 as soon as the fp16 engines are built: ours-defaults, tensorrt-auto, tensorrt-plugins (each
# TensorRT row with its UNet's per-layer profile). Benchmark B once the INT8 UNet is built: tensorrt-auto and
# tensorrt-int8 (its ratios, image and UNet output against tensorrt-auto) into the same results.
L=/tmp/e20 LEVEL=${LEVEL:-3}
COMMON=(--model sd1.5-arch --disable-tactic-sources CUDNN --optimization-level "$LEVEL")
REQUEST=(--seed 0 --scheduler DDIM)
step() { echo "[e20] $(date +%T) $*" >>$L/steps.log; }
build() {  # NAME GPU PLUGINS SUFFIX [more]: build-engines into the folders the benchmark's contender NAME looks in
  (CUDA_VISIBLE_DEVICES=$2 python3 scripts/build_engines.py "${COMMON[@]}" --backend tensorrt --height 512 \
    --width 512 --build-static-batch --plugins "$3" --onnx-dir onnx$4 --engine-dir engine$4 "${@:5}" \
    --report $L/build-$1.json; echo "exit $?") >$L/build-$1.log 2>&1
}
built() { grep -q '^exit' $L/build-$1.log 2>/dev/null; }
benchmark() {  # NAME CONTENDERS
  (CUDA_VISIBLE_DEVICES=0 python3 scripts/benchmark.py "${COMMON[@]}" "${REQUEST[@]}" --results-dir $L/results \
     --contenders "$2"; echo "exit $?") >$L/benchmark-$1.log 2>&1
  step "benchmark $1: $(tail -1 $L/benchmark-$1.log)"
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
    && cmake --build build -j 16) >$L/cmake.log 2>&1 &
  plugin_library=$!
  python3 -c "from models.source import resolve_model; resolve_model('sd1.5-arch')" >$L/generate.log 2>&1 \
    || { step "generation failed"; exit 1; }
  wait $plugin_library || { step "plugin library failed"; exit 1; }
  auto=$(python3 -c "from bench.runner import plugin_dir_suffix; from models.plugin_set import parse_plugin_set
print(plugin_dir_suffix(parse_plugin_set('auto')))")
  step "building: tensorrt-auto in engine$auto (GPU 0); tensorrt-plugins in engine-plugins, then the INT8 UNet (GPU 1)"
  build auto 0 auto "$auto" &
  (build plugins 1 all -plugins) &
  (CUDA_VISIBLE_DEVICES=1 timeout 1200 python3 -m pytest -q -s -p no:cacheprovider tests/test_trt_plugins_gpu.py \
     tests/test_engines_gpu.py; echo "exit $?") >$L/gpu-tests.log 2>&1 &
  until [ -f "onnx$auto/unet.onnx.json" ] || built auto; do sleep 5; done
  build int8 1 auto "$auto" --int8 --stages unet &  # its export is the auto set's (the same key), waited for above
  until built auto && built plugins; do sleep 10; done
  step "fp16 builds: $(grep -H '^exit' $L/build-auto.log $L/build-plugins.log | sed 's|.*/build-||' | tr '\n' ' ')"
  benchmark A ours-defaults,tensorrt-auto,tensorrt-plugins
  until built int8; do sleep 10; done
  step "INT8 build: $(tail -1 $L/build-int8.log)"
  benchmark B tensorrt-auto,tensorrt-int8
  wait
  step "finished: GPU tests $(tail -2 $L/gpu-tests.log | tr '\n' ' ')" ;;
poll)
  for _ in $(seq 1 100); do grep -q "finished\|failed" $L/steps.log && break; sleep 5; done
  cat $L/steps.log; tail -n 3 $L/build-*.log $L/gpu-tests.log 2>/dev/null | cut -c1-300
  grep -h "^\[sd-" $L/benchmark-*.log 2>/dev/null | tail -8
  mkdir -p "$OUT" && cp $L/results/*.md "$OUT/" 2>/dev/null; tar -czf "$OUT/e20.tgz" --exclude='*.engine' -C /tmp e20 ;;
*)
  echo "usage: bash results/int8-h200/lease.sh start | poll"; exit 2 ;;
esac
