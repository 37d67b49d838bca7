#!/bin/bash
# LoRA by engine refit in one lease (issue 19 part 4), from the repository root once ../shared/trt86's 15 carry parts
# are on the box (docs/gpu-box.md), with .whl carried:
#   TRT86_SHA=<sha make_parts.sh printed> [MODEL=sdxl-arch SIZE=1024 SCHEDULER=Euler] bash results/refit-h200/refit.sh start
#   bash results/refit-h200/refit.sh poll                                            # up to ~8 min; results into $OUT
# MODEL, SIZE, SCHEDULER and LEVEL default to sd1.5-arch, 512, DDIM and builder level 0 (what ran on 2026-11-25, when
# this script worked in the repository's copy and ran refit_engines.py under its first name, refit_sd15.py).
# `start` copies the working tree to /tmp/refit/repo and works there (scripts/box_lease_lib.sh). Then: TensorRT 8.6,
# the wheels, the plugin library (sm_90) and MODEL; the GPU refit tests of the tiny models (tests/test_lora_refit.py
# -m gpu) beside the rest; MODEL's engines with --plugins auto, built refittable (GPU 0) and plain (GPU 1 where there
# are two), each set's UNet in a build of its own beside its other stages. Once the plain set is built, on its GPU:
# refit_engines.py's plain phase (time, per-layer profile of the UNet) and the torch backend's UNet profile
# (scripts/profile_unet.py at the tuned defaults), the measured side of the engines-against-torch gap. Once the
# refittable set is built: refit_engines.py's refit phase (time, refit times, images, plain again on the same GPU),
# then TensorRT's weight names against the provenance (scripts/refit_names.py, with a dry refit) for every refittable
# stage.
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
  gpus=$(nvidia-smi -L | wc -l) plain_gpu=0
  [ "$gpus" -gt 1 ] && plain_gpu=1
  for kind in refit plain; do
    extra=(); [ $kind = refit ] && extra=(--build-enable-refit)
    gpu=0; [ $kind = plain ] && gpu=$plain_gpu
    for part in unet clip,clip2,vae; do  # clip2 and vae where the model has them
      stages=$(python3 -c "from models import text_to_image_stages; from models.source import resolve_model
print(','.join(s for s in '$part'.split(',') if s in text_to_image_stages(resolve_model('$MODEL'))))" 2>/dev/null | tail -n 1)
      (CUDA_VISIBLE_DEVICES=$gpu python3 scripts/build_engines.py "${ENGINES[@]}" "${extra[@]}" --stages "$stages" \
        --onnx-dir onnx-$kind --engine-dir engine-$kind --report $L/build-$kind-${part%%,*}.json; echo "exit $?") \
        >$L/build-$kind-${part%%,*}.log 2>&1 &
    done
  done
  built() { [ "$(grep -l '^exit' $L/build-$1-*.log 2>/dev/null | wc -l)" = 2 ]; }
  until built plain; do sleep 3; done
  step "plain builds: $(grep -H '^exit' $L/build-plain-*.log | sed 's|.*/build-||' | tr '\n' ' ')"
  (export CUDA_VISIBLE_DEVICES=$plain_gpu PYTHONPATH=$PWD:$PYTHONPATH
   python3 results/refit-h200/refit_engines.py "$MODEL" "$SIZE" "$SCHEDULER" "$LEVEL" plain $L/plain-$MODEL.json \
     >$L/plain-$MODEL.log 2>&1; echo "exit $?" >>$L/plain-$MODEL.log
   python3 scripts/profile_unet.py --model "$MODEL" --height "$SIZE" --width "$SIZE" --results-dir $L \
     >$L/profile-torch.log 2>&1; echo "exit $?" >>$L/profile-torch.log) &
  until built refit; do sleep 3; done
  step "refittable builds: $(grep -H '^exit' $L/build-refit-*.log | sed 's|.*/build-||' | tr '\n' ' ')"
  CUDA_VISIBLE_DEVICES=0 PYTHONPATH=$PWD:$PYTHONPATH python3 results/refit-h200/refit_engines.py "$MODEL" "$SIZE" \
    "$SCHEDULER" "$LEVEL" refit $L/refit-$MODEL.json >$L/refit-$MODEL.log 2>&1
  step "refit_engines exit $?"
  for stage in unet clip clip2; do  # the stages LoRAs reach, where the model has them
    [ -f engine-refit/$stage.engine ] || continue
    python3 scripts/refit_names.py engine-refit/$stage.engine onnx-refit/$stage.opt.onnx --plugin-convention sdplugins \
      --dry-refit >$L/names-$stage.txt 2>&1
    step "refit_names $stage: exit $?"
  done
  wait
  step "finished" ;;
poll)
  for _ in $(seq 1 90); do grep -q "finished\|failed" $L/steps.log && break; sleep 5; done
  cat $L/steps.log; tail -n 4 $L/gpu-tests.log $L/build-*.log $L/names-*.txt $L/*.log 2>/dev/null | cut -c1-300
  grep -v '"layer"' $L/plain-*.json $L/refit-*.json 2>/dev/null | head -n 80
  mkdir -p "$OUT" && tar -czf "$OUT/refit.tgz" --exclude=repo -C /tmp refit ;;
*)
  echo "usage: bash results/refit-h200/refit.sh start | poll"; exit 2 ;;
esac
