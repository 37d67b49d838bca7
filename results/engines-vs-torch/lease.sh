#!/bin/bash
# Issue 20 in one lease of two Hopper GPUs (H200 x2 or H100 x2; the GPU is in every table): TensorRT 8.6 engines,
# fp16 and --int8, against the torch backend, sd1.5-arch 512x512, 50 DDIM steps, seed 0, builder level LEVEL (default
# 3, the engines' default). From the repository root once ../shared/trt86's 15 carry parts are on the box
# (docs/gpu-box.md), with .whl carried:
#   TRT86_SHA=<sha make_parts.sh printed> bash results/engines-vs-torch/lease.sh start   # detached
#   bash results/engines-vs-torch/lease.sh poll                                        # up to ~8 min; tars /tmp/e20 to $OUT
# `start` copies the working tree to /tmp/e20/repo and works there (scripts/box_lease_lib.sh; 2026-11-25, before it
# did, two level-3 UNets built in the box's copy of the repository vanished at the next device call).
# GPU 0 builds the fp16 engine sets, tensorrt-auto's (the default engine path) and tensorrt-plugins', side by side. The
# last GPU (GPU 1 of two) builds tensorrt-int8's UNet alone, the longest build, once the auto UNet's ONNX is exported
# (it calibrates on the built-in prompts first); with GPU_TESTS=1, GPU 1 also runs the GPU tests of the TensorRT
# plugins and engines (they passed on 2026-11-25). While the UNets export, tests/test_torch_accel_gpu.py runs (its
# CUDA-graph tests, the second GPU's among them). On one GPU every build runs one at a time (2026-11-26: three UNets
# side by side on one H200 took 896-1030 s each, 536 s alone). Once every build has ended, benchmark A on GPU 0: one
# sd-benchmark run of ours-defaults and each engine set that built (each TensorRT row with its UNet's per-layer
# profile; tensorrt-int8's ratios, image and UNet output against tensorrt-auto's). Measured on an H100 x2 at level 3:
# the auto UNet exports in ~100 s and builds in ~525 s alone on its GPU; the INT8 UNet in ~895 s beside another
# build. For a shorter lease: SETS=auto INT8=0 builds and benchmarks the default engine path alone. RESTORE_CHECK=1
# also runs, on GPU 0 while the UNet exports, issue 19's checks: GroupNorm's kernel tests (determinism among them),
# then results/refit-h200/restore_check.py (tiny with all plugins and with none, tiny-xl with all; level 1).
# CUBLAS_LT=1 also builds the auto set with `--enable-tactic-sources CUBLAS_LT` (into onnx-lt-* and engine-lt-*, on the
# last GPU) and runs benchmark C, tensorrt-auto on those engines, into results-lt: does TensorRT pick cuBLASLt's GEMMs,
# and do they pay? No timing cache: TensorRT 8.6.0 refused every one its UNet builds had written, carried into the
# next lease or not (docs/gpu-box.md). THEN_SERVE=1 (two GPUs; the serve wheels in /opt/w as that lease's carry calls
# put them): once the benchmarks end, results/serve-gpus/lease.sh's two-GPU server (PHASES=2) in the same hold; poll
# it with `bash results/serve-gpus/lease.sh poll`.
L=/tmp/e20 LEVEL=${LEVEL:-3} SETS=${SETS:-auto plugins} INT8=${INT8:-1} CUBLAS_LT=${CUBLAS_LT:-0}
COMMON=(--model sd1.5-arch --disable-tactic-sources CUDNN --optimization-level "$LEVEL")
REQUEST=(--seed 0 --scheduler DDIM)
step() { echo "[e20] $(date +%T) $*" >>$L/steps.log; }
source scripts/box_lease_lib.sh
build() {  # NAME GPU PLUGINS SUFFIX [more]: build-engines into the folders the benchmark's contender NAME looks in
  (CUDA_VISIBLE_DEVICES=$2 python3 scripts/build_engines.py "${COMMON[@]}" --backend tensorrt --height 512 \
    --width 512 --build-static-batch --plugins "$3" --onnx-dir onnx$4 --engine-dir engine$4 "${@:5}" \
    --report $L/build-$1.json; echo "exit $?") >$L/build-$1.log 2>&1
}
ended() { grep -q '^exit' $L/build-$1.log 2>/dev/null; }
built() { grep -q '^exit 0' $L/build-$1.log 2>/dev/null; }
benchmark() {  # NAME CONTENDERS [more]: one sd-benchmark run on GPU 0
  step "benchmark $1: $2 ${*:3}"
  (CUDA_VISIBLE_DEVICES=0 python3 scripts/benchmark.py "${COMMON[@]}" "${REQUEST[@]}" --results-dir $L/results \
     --contenders "$2" "${@:3}"; echo "exit $?") >$L/benchmark-$1.log 2>&1
  step "benchmark $1: $(tail -1 $L/benchmark-$1.log)"
}
case "$1" in
start)
  lease_start $L results/engines-vs-torch/lease.sh || exit 1
  sleep 2; cat $L/steps.log ;;
work)
  step "setup (level $LEVEL) in $PWD"
  trt86_setup $L sd1.5-arch || exit 1
  auto=$(python3 -c "from bench.runner import plugin_dir_suffix; from models.plugin_set import parse_plugin_set
print(plugin_dir_suffix(parse_plugin_set('auto')))")
  if [ "$auto" = -plugins ] && [[ " $SETS " == *" plugins "* ]]; then  # auto picks every plugin here: one set
    SETS=$(echo $SETS | tr ' ' '\n' | grep -vx plugins | tr '\n' ' ')
    step "--plugins auto is all plugins on this GPU: tensorrt-plugins would be tensorrt-auto's engines, not built twice"
  fi
  last_gpu=$(( $(nvidia-smi -L | wc -l) - 1 ))  # the INT8 and cuBLASLt builds' (GPU 0 where there is one)
  step "building $SETS on GPU 0 (auto in engine$auto, plugins in engine-plugins); on GPU $last_gpu: INT8 $INT8," \
    "cuBLASLt $CUBLAS_LT"
  fp16_set() {  # auto | plugins, on GPU 0
    if [ "$1" = auto ]; then build auto 0 auto "$auto"; else build plugins 0 all -plugins; fi
  }
  lt_set() {  # in ONNX folders of its own: the auto build holds its ONNX's lock until its engine is built
    build lt $last_gpu auto "-lt$auto" --enable-tactic-sources CUBLAS_LT
  }
  int8_unet() { build int8 $last_gpu auto "$auto" --int8 --stages unet; }
  if [ $last_gpu = 0 ]; then  # one GPU: one build at a time (2026-11-26, three UNets side by side took 896-1030 s each
    # on an H200, one alone 536 s), and the benchmarks after the last
    (for set in $SETS; do fp16_set $set; done
     [ "$CUBLAS_LT" = 1 ] && lt_set; [ "$INT8" = 1 ] && int8_unet) &
  else
    for set in $SETS; do fp16_set $set & done
    [ "$CUBLAS_LT" = 1 ] && lt_set &
    if [ "$INT8" = 1 ]; then  # its export is the auto set's (the same key): waited for
      (until [ -f "onnx$auto/unet.onnx.json" ] || ended auto; do sleep 5; done; int8_unet) &
    fi
  fi
  if [ "${RESTORE_CHECK:-0}" = 1 ]; then
    (CUDA_VISIBLE_DEVICES=0 python3 -m pytest -q -p no:cacheprovider tests/test_plugins_gpu.py -k group_norm \
       >$L/group-norm-tests.log 2>&1; echo "exit $?" >>$L/group-norm-tests.log
     for run in "tiny 32 all" "tiny 32 none" "tiny-xl 64 all"; do
       set -- $run
       CUDA_VISIBLE_DEVICES=0 PYTHONPATH=$PWD:$PYTHONPATH python3 results/refit-h200/restore_check.py $1 $2 1 $3 \
         $L/restore-$1-$3.json >$L/restore-$1-$3.log 2>&1
     done) &
  fi
  (python3 -m pytest -q -p no:cacheprovider tests/test_torch_accel_gpu.py; echo "exit $?") >$L/torch-accel-tests.log 2>&1 &
  if [ "${GPU_TESTS:-0}" = 1 ]; then
    (CUDA_VISIBLE_DEVICES=1 timeout 1200 python3 -m pytest -q -s -p no:cacheprovider tests/test_trt_plugins_gpu.py \
       tests/test_engines_gpu.py; echo "exit $?") >$L/gpu-tests.log 2>&1 &
  fi
  asked() {  # NAME: a build benchmark A waits for
    case $1 in auto|plugins) [[ " $SETS " == *" $1 "* ]] ;; int8) [ "$INT8" = 1 ] ;; esac
  }
  for name in auto plugins int8; do while asked $name && ! ended $name; do sleep 10; done; done
  step "builds: $(grep -H '^exit' $L/build-*.log | sed 's|.*/build-||' | tr '\n' ' ')"
  contenders=ours-defaults  # and the sets that built: a failed one would build inside the timed run
  built auto && contenders+=,tensorrt-auto; built plugins && contenders+=,tensorrt-plugins
  built int8 && contenders+=,tensorrt-int8
  benchmark A $contenders
  if [ "$CUBLAS_LT" = 1 ]; then
    until ended lt; do sleep 10; done
    step "cuBLASLt build: $(tail -1 $L/build-lt.log)"
    built lt && benchmark C tensorrt-auto --engine-dir engine-lt --enable-tactic-sources CUBLAS_LT \
      --results-dir $L/results-lt
  fi
  wait
  if [ "${THEN_SERVE:-0}" = 1 ]; then  # the GPUs free now: issue 21's two-GPU server in the same hold
    step "then results/serve-gpus/lease.sh work, PHASES=2, in /tmp/s21 (its own poll)"
    mkdir -p /tmp/s21 && PHASES=2 L=/tmp/s21 bash results/serve-gpus/lease.sh work >>/tmp/s21/work.log 2>&1
  fi
  step "finished" ;;
poll)
  for _ in $(seq 1 90); do grep -q "finished\|failed" $L/steps.log && break; sleep 5; done
  cat $L/steps.log; tail -n 2 $L/build-*.log $L/*tests.log $L/restore-*.log 2>/dev/null | cut -c1-300
  grep -h "^\[sd-" $L/benchmark-*.log 2>/dev/null | tail -6
  mkdir -p "$OUT" && cp $L/results/*.md "$OUT/" 2>/dev/null; tar -czf "$OUT/e20.tgz" --exclude=repo -C /tmp e20 ;;
*)
  echo "usage: bash results/engines-vs-torch/lease.sh start | poll"; exit 2 ;;
esac
