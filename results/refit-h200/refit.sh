#!/bin/bash
# LoRA by engine refit in one lease (issue 19 part 4), from the repository root once ../shared/trt86's 15 carry parts
# are on the box (docs/gpu-box.md), with .whl carried:
#   TRT86_SHA=<sha make_parts.sh printed> [MODEL=sdxl-arch SIZE=1024 SCHEDULER=Euler] bash results/refit-h200/refit.sh start
#   bash results/refit-h200/refit.sh poll                                            # up to ~8 min; results into $OUT
# MODEL, SIZE, SCHEDULER and LEVEL default to sd1.5-arch, 512, DDIM and builder level 0 (what ran on 2026-11-25, when
# this script worked in the repository's copy and ran refit_engines.py under its first name, refit_sd15.py).
# `start` copies the working tree to /tmp/refit/repo and works there (scripts/box_lease_lib.sh). Then: TensorRT 8.6,
# the wheels, the plugin library (sm_90) and MODEL; the GPU refit tests of the tiny models (tests/test_lora_refit.py
# -m gpu) beside the rest; MODEL's engines with --plugins auto, built refittable and plain
# side by side (one per GPU where there are two); TensorRT's weight names against the provenance
# (scripts/refit_names.py, with a dry refit) for every refittable stage; then refit_engines.py (speed of both engine
# sets, refit times, images).
L=/tmp/refit MODEL=${MODEL:-sd1.5-arch} SIZE=${SIZE:-512} SCHEDULER=${SCHEDULER:-DDIM} LEVEL=${LEVEL:-0}
ENGINES=(--model "$MODEL" --backend tensorrt --height "$SIZE" --width "$SIZE" --build-static-batch
         --optimization-level "$LEVEL" --disable-tactic-sources CUDNN --plugins auto)
step() { echo "[refit] $(date +%T) $*" >>$L/steps.log; }
source scripts/box_lease_lib.sh
case "$1" in
start)
  lease_start $L results/refit-h200/refit.sh || exit 1
  sleep 1; cat $L/steps.log ;;
work)
  step "setup: $MODEL, ${SIZE}x$SIZE, $SCHEDULER, level $LEVEL"
  trt86_setup $L "$MODEL" || exit 1
  (python3 -m pytest -q -m gpu -s -p no:cacheprovider tests/test_lora_refit.py; echo "exit $?") >$L/gpu-tests.log 2>&1 &
  step "building $MODEL's engines, refittable and plain"
  gpus=$(nvidia-smi -L | wc -l)
  for kind in refit plain; do
    extra=(); [ $kind = refit ] && extra=(--build-enable-refit)
    gpu=0; [ $kind = plain ] && [ "$gpus" -gt 1 ] && gpu=1
    (CUDA_VISIBLE_DEVICES=$gpu python3 scripts/build_engines.py "${ENGINES[@]}" "${extra[@]}" --onnx-dir onnx-$kind \
      --engine-dir engine-$kind --report $L/build-$kind.json; echo "exit $?") >$L/build-$kind.log 2>&1 &
  done
  until [ "$(grep -l '^exit' $L/build-*.log 2>/dev/null | wc -l)" = 2 ]; do sleep 3; done
  step "builds: $(grep -H '^exit' $L/build-*.log | sed 's|.*/build-||' | tr '\n' ' ')"
  for stage in unet clip clip2; do  # the stages LoRAs reach, where the model has them
    [ -f engine-refit/$stage.engine ] || continue
    python3 scripts/refit_names.py engine-refit/$stage.engine onnx-refit/$stage.opt.onnx --plugin-convention sdplugins \
      --dry-refit >$L/names-$stage.txt 2>&1
    step "refit_names $stage: exit $?"
  done
  PYTHONPATH=$PWD:$PYTHONPATH python3 results/refit-h200/refit_engines.py "$MODEL" "$SIZE" "$SCHEDULER" "$LEVEL" \
    $L/refit-$MODEL.json >$L/refit-$MODEL.log 2>&1
  step "refit_engines exit $?"
  wait
  step "finished" ;;
poll)
  for _ in $(seq 1 90); do grep -q "finished\|failed" $L/steps.log && break; sleep 5; done
  cat $L/steps.log; tail -n 4 $L/gpu-tests.log $L/build-*.log $L/names-*.txt 2>/dev/null | cut -c1-300
  cat $L/refit-*.json 2>/dev/null
  mkdir -p "$OUT" && tar -czf "$OUT/refit.tgz" --exclude=repo -C /tmp refit ;;
*)
  echo "usage: bash results/refit-h200/refit.sh start | poll"; exit 2 ;;
esac
