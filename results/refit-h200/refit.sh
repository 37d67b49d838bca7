#!/bin/bash
# LoRA by engine refit, one H200 lease (issue 19 part 4), from the repository root once ../shared/trt86's 15 carry
# parts are on the box (docs/gpu-box.md), with .whl carried:
#   TRT86_SHA=<sha make_parts.sh printed> bash results/refit-h200/refit.sh start   # detached
#   bash results/refit-h200/refit.sh poll                                           # ~8 min; results into $OUT
# start: TensorRT 8.6 and the wheels; the GPU refit tests of the tiny model (tests/test_lora_refit.py -m gpu) beside
# the plugin library (sm_90) and sd1.5-arch; then sd1.5-arch's engines at builder level 0 with --plugins auto, built
# refittable and plain side by side; TensorRT's weight names against the provenance (scripts/refit_names.py, with a
# dry refit); then refit_sd15.py (speed of both engine sets, refit times, images).
L=/tmp/refit
ENGINES=(--model sd1.5-arch --backend tensorrt --height 512 --width 512 --build-static-batch --optimization-level 0
         --disable-tactic-sources CUDNN --plugins auto)
step() { echo "[refit] $(date +%T) $*" >>$L/steps.log; }
case "$1" in
start)
  rm -rf $L && mkdir -p $L
  setsid nohup bash "$0" work </dev/null >>$L/steps.log 2>&1 &
  sleep 1; cat $L/steps.log ;;
work)
  step "setup"
  source scripts/box_trt86_env.sh >$L/setup.log 2>&1 || { step "setup failed"; exit 1; }
  export DEMO_DIFFUSION_CACHE=/tmp/ddcache
  (python3 -m pytest -q -m gpu -s -p no:cacheprovider tests/test_lora_refit.py; echo "exit $?") >$L/gpu-tests.log 2>&1 &
  (cmake -S . -B build -DCMAKE_CUDA_ARCHITECTURES=90 -DTENSORRT_INCLUDE_DIR=/opt/k/misc/src/include \
    && cmake --build build -j 8) >$L/cmake.log 2>&1 &
  plugin_library=$!
  python3 -c "from models.source import resolve_model; resolve_model('sd1.5-arch')" >$L/generate.log 2>&1 \
    || { step "generation failed"; exit 1; }
  wait $plugin_library || { step "plugin library failed"; exit 1; }
  step "building sd1.5-arch engines, refittable and plain"
  for kind in refit plain; do
    extra=(); [ $kind = refit ] && extra=(--build-enable-refit)
    (python3 scripts/build_engines.py "${ENGINES[@]}" "${extra[@]}" --onnx-dir onnx-$kind --engine-dir engine-$kind \
      --report $L/build-$kind.json; echo "exit $?") >$L/build-$kind.log 2>&1 &
  done
  until [ "$(grep -l '^exit' $L/build-*.log 2>/dev/null | wc -l)" = 2 ]; do sleep 3; done
  step "builds: $(grep -H '^exit' $L/build-*.log | sed 's|.*/build-||' | tr '\n' ' ')"
  for stage in unet clip; do
    python3 scripts/refit_names.py engine-refit/$stage.engine onnx-refit/$stage.opt.onnx --plugin-convention sdplugins \
      --dry-refit >$L/names-$stage.txt 2>&1
    step "refit_names $stage: exit $?"
  done
  PYTHONPATH=$PWD:$PYTHONPATH python3 results/refit-h200/refit_sd15.py $L/refit-sd15.json >$L/refit-sd15.log 2>&1
  step "refit_sd15 exit $?"
  wait
  step "finished" ;;
poll)
  for _ in $(seq 1 60); do grep -q "finished\|failed" $L/steps.log && break; sleep 5; done
  cat $L/steps.log; tail -n 4 $L/gpu-tests.log $L/build-*.log $L/names-*.txt 2>/dev/null | cut -c1-300
  cat $L/refit-sd15.json 2>/dev/null
  mkdir -p "$OUT" && tar -czf "$OUT/refit.tgz" -C /tmp refit ;;
*)
  echo "usage: bash results/refit-h200/refit.sh start | poll"; exit 2 ;;
esac
