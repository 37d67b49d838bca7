#!/bin/bash
# Issue 21's figures in one lease of two GPUs (H200 x2 asked; the GPU is in every file): sd-serve with the torch
# backend at its defaults (BACKEND=torch), or with TensorRT 8.6 engines (BACKEND=tensorrt, builder level LEVEL,
# default 3), sd1.5-arch, 512x512, 30 steps. Ran with each on two H100s, 2026-11-26.
# Here, first: bash results/serve-gpus/make_wheels.sh.
# For engines, the carry calls of ../shared/trt86 first (docs/gpu-box.md), TRT86_SHA set on the start call.
# Then three device calls back to back:
#   carry [.carry/serve-a]                  mkdir -p /opt/w && cp .carry/serve-a/*.whl /opt/w/
#   carry [.carry/serve-c]                  cp .carry/serve-c/*.whl /opt/w/
#   carry [.carry/serve-b, .whl]            cp .carry/serve-b/*.whl /opt/w/ && BACKEND=torch bash results/serve-gpus/lease.sh start
# and polls (`bash results/serve-gpus/lease.sh poll`, up to ~8 min each; files into $OUT).
# With engines, one set is built first (tuned for batch 1, taking up to 4: the CLI's, and every server's at its default
# --opt-batch-size; the VAE encoder too, for img2img), the UNet on GPU_A beside the other stages on GPU_B: the servers
# and the CLI then only load them (17 minutes on two H100s at level 3; with PHASES=pair the lease of 2026-11-26 23:46
# took 24.5 after its 19 carry calls, 27 in all). Until 2026-11-26 each server had engines tuned for its
# --max-batch-size, two sets built side by side (20 minutes on two H100s at level 3; the lease of 2026-11-26 20:15 took
# 28 after the carry calls).
# First the CLI alone on GPU_A (demo-diffusion with the load tests' request: the latency's yardstick). Phase 2: one
# server on both GPUs, --max-batch-size 4: concurrency 1 (p50 against the CLI; over HTTP, then gRPC), 16 (against one
# GPU's 16), then MANY requests. Phase 1, side by side: on GPU_A a server with --max-batch-size 4 (concurrency 1, 8 and
# 16), on GPU_B one with --max-batch-size 1 (concurrency 8: what batching gains). Each server is stopped with SIGTERM
# and its drain time kept. summarize.py writes summary.md and summary.json. PHASES=2: phase 2 only; PHASES=pair: phase
# 2, then the batch-4 server on GPU_A alone at concurrency 1 and 16 (the two-GPU ratio without the batch-1 server). With
# the torch backend on two H100s (2026-11-26), PHASES=pair took 15 minutes (its one-GPU server first then), the default
# 14.
# ONE_GPU=1 (one GPU, GPU_A): a server at batch 4 (concurrency 1 and 8, then MANY requests), one at batch 1
# (concurrency 1 and 8), then the CLI, one after another; BATCHES="1" runs the batch-1 server only: on one H100 at
# level 3 (2026-11-26) the engines took 20 minutes, the whole lease about 26 after its 19 carry calls. The CLI runs
# CLI_RUNS times (3), its median pipeline time the yardstick: one run's varies (torch on H100s: 222-247 ms in one day).
# A dry run on a CPU machine, tiny and every server on the CPU:
#   MODEL=tiny SIZE=64 STEPS=2 GPU_A= GPU_B= BOTH= REQUESTS=8 MANY=20 bash results/serve-gpus/lease.sh work
L=${L:-/tmp/s21} MODEL=${MODEL:-sd1.5-arch} SIZE=${SIZE:-512} STEPS=${STEPS:-30} BACKEND=${BACKEND:-torch} LEVEL=${LEVEL:-3}
GPU_A=${GPU_A-0} GPU_B=${GPU_B-1} BOTH=${BOTH-0,1} REQUESTS=${REQUESTS:-64} MANY=${MANY:-500} BATCHES=${BATCHES:-4 1}
step() { echo "[s21] $(date +%T) $*" | tee -a $L/steps.log; }
source scripts/box_lease_lib.sh
gpus() { [ -n "$1" ] && echo "--gpus $1"; }
ready() { python3 -c "import sys, urllib.request as u; u.urlopen(sys.argv[1], timeout=2)" \
  "http://127.0.0.1:$1/v2/health/ready" 2>/dev/null; }
engines() {  # the engine flags of the servers and the CLI (none for the torch backend)
  [ "$BACKEND" = torch ] || echo "--onnx-dir onnx-serve --engine-dir engine-serve --optimization-level $LEVEL
    --disable-tactic-sources CUDNN"
}
serve() {  # NAME GPUS MAX_BATCH PORT: an sd-serve in the background, its pid in $L/NAME.pid, ready or failed
  python3 scripts/serve.py --model "$MODEL" --backend "$BACKEND" --height "$SIZE" --width "$SIZE" $(gpus "$2") \
    --max-batch-size "$3" $(engines) --http-port "$4" --grpc-port $(($4 + 1)) --metrics-port $(($4 + 2)) \
    >$L/serve-$1.log 2>&1 &
  echo $! >$L/$1.pid
  for _ in $(seq 1 1200); do
    ready "$4" && { step "$1 ready"; return 0; }
    kill -0 "$(cat $L/$1.pid)" 2>/dev/null || { step "$1 exited before ready: $(tail -1 $L/serve-$1.log)"; return 1; }
    sleep 1
  done
  step "$1 not ready in 20 minutes"; return 1
}
stop() {  # NAME: SIGTERM, then how long it took to drain and exit
  local pid start; pid=$(cat $L/$1.pid); start=$EPOCHREALTIME
  kill -TERM "$pid"; while kill -0 "$pid" 2>/dev/null; do sleep 0.2; done
  step "$1 stopped in $(awk "BEGIN { printf \"%.1f\", $EPOCHREALTIME - $start }") s"
}
load() {  # NAME PORT CONCURRENCY REQUESTS [FLAGS]: one load test, its JSON and chart into $L/results
  python3 scripts/loadtest.py --url "127.0.0.1:$2" --concurrency "$3" --requests "$4" --denoising-steps "$STEPS" \
    --results-dir $L/results --name "$1" "${@:5}" >$L/load-$1.log 2>&1
  step "load $1: $(grep -h 'answered in' $L/load-$1.log)"
}
case "$1" in
start)
  lease_start $L results/serve-gpus/lease.sh || exit 1
  sleep 2; cat $L/steps.log 2>/dev/null ;;
work)
  mkdir -p $L/results
  if [ -d /opt/w ]; then  # on the box: the carried wheels into its interpreter itself, numpy 1.26 replacing numpy 2:
    # Triton's Python-backend stub ignores PYTHONPATH (its models could not import zmq from there, 2026-11-26)
    wheels=(/opt/w/*.whl)  # .whl's too, less those serve-b carries as well (pip refuses one wheel given twice)
    for wheel in .whl/*.whl; do [ -e "/opt/w/${wheel##*/}" ] || wheels+=("$wheel"); done
    python3 -m pip install -q --no-index --no-deps --no-compile "${wheels[@]}" \
      >$L/setup.log 2>&1 || { step "setup failed: $(tail -1 $L/setup.log)"; exit 1; }
    export DEMO_DIFFUSION_CACHE=/tmp/ddcache
  fi
  export PYTHONUNBUFFERED=1
  python3 -c "import numpy, torch, pytriton, tritonclient.http; from diffusers import UNet2DConditionModel
print('numpy', numpy.__version__)" \
    >$L/imports.log 2>&1 || { step "imports failed: $(tail -1 $L/imports.log)"; exit 1; }
  step "setup: $(tail -1 $L/imports.log); generating $MODEL"
  if [ "$BACKEND" = torch ]; then
    python3 -c "from models.source import resolve_model; resolve_model('$MODEL')" >$L/generate.log 2>&1 \
      || { step "generation failed"; exit 1; }
  else
    trt86_setup $L "$MODEL" || exit 1
  fi
  build() {  # STAGES GPU: those stages' engines (sd-serve's defaults: tuned for batch 1, taking up to 4)
    (CUDA_VISIBLE_DEVICES=$2 python3 scripts/build_engines.py --model "$MODEL" --backend "$BACKEND" --height "$SIZE" \
      --width "$SIZE" --batch-size 1 --max-batch-size 4 $(engines) --stages "$1" --report "$L/build-${1//,/-}.json"
      echo "exit $?") >"$L/build-${1//,/-}.log" 2>&1
  }
  if [ "$BACKEND" != torch ]; then
    if [ "${ONE_GPU:-0}" = 1 ]; then
      step "building engines at level $LEVEL on GPU '$GPU_A'"
      build clip,unet,vae,vae_encoder "$GPU_A"
    else
      step "building engines at level $LEVEL: the UNet on GPU '$GPU_A', the other stages on GPU '$GPU_B'"
      build unet "$GPU_A" & build clip,vae,vae_encoder "$GPU_B" & wait
    fi
    step "engines: $(grep -H '^exit' $L/build-*.log | sed 's|.*/build-||' | tr '\n' ' ')"
  fi
  cli() {  # GPU: demo-diffusion with the load tests' request CLI_RUNS times, the median pipeline time the yardstick
    for run in $(seq 1 "${CLI_RUNS:-3}"); do
      CUDA_VISIBLE_DEVICES=$1 python3 -m demo.demo_diffusion "a photo of an astronaut riding a horse on mars" \
        --model "$MODEL" --backend "$BACKEND" --height "$SIZE" --width "$SIZE" --denoising-steps "$STEPS" --seed 0 \
        $(engines) --num-warmup-runs 3 --output-dir $L/cli/run$run >$L/cli-$run.log 2>&1
      step "CLI run $run: $(grep -h Pipeline $L/cli-$run.log)"
    done
  }
  if [ "${ONE_GPU:-0}" = 1 ]; then  # one GPU, one server at a time; no two-GPU figures
    step "one GPU ('$GPU_A'): servers at batch $BATCHES, one after another, then the CLI"
    for size in $BATCHES; do
      serve one-b$size "$GPU_A" $size 8000 && { load one-b$size-c1 8000 1 20; load one-b$size-c8 8000 8 "$REQUESTS"
        [ $size = 4 ] && load one-b4-many 8000 16 "$MANY"; stop one-b$size; }
    done
    cli "$GPU_A"
  else
    if [ "$BACKEND" = torch ]; then  # the torch backend's CUDA graphs on the second GPU, before its servers use them
      python3 -m pytest -q -p no:cacheprovider tests/test_torch_accel_gpu.py -k second_gpu >$L/test-second-gpu.log 2>&1
      step "two-GPU capture test: $(tail -1 $L/test-second-gpu.log | sed s/failed/FAILED/)"  # poll stops at 'failed'
    fi
    cli "$GPU_A"  # alone: the p50's yardstick
    step "phase 2: batch 4 on GPUs '$BOTH'"  # first: on two H100s (2026-11-26), torch.compile's caches from a one-GPU
    # server did not serve the other GPU (5.6 minutes to start after one, 84 s after both)
    serve two-b4 "$BOTH" 4 8200 && { load two-b4-c1 8200 1 20; load two-b4-c1-grpc 8201 1 20 --protocol grpc
      load two-b4-c16 8200 16 $((REQUESTS * 2))
      load two-b4-many 8200 16 "$MANY"; stop two-b4; }
    case "${PHASES:-2 1}" in
      2) ;;
      pair) serve one-b4 "$GPU_A" 4 8000 && { load one-b4-c1 8000 1 20; load one-b4-c16 8000 16 $((REQUESTS * 2))
        stop one-b4; } ;;
      *)
        step "phase 1: batch 4 on GPU '$GPU_A', batch 1 on GPU '$GPU_B'"
        ( serve one-b4 "$GPU_A" 4 8000 && { load one-b4-c1 8000 1 20; load one-b4-c8 8000 8 "$REQUESTS"
          load one-b4-c16 8000 16 $((REQUESTS * 2)); stop one-b4; } ) &
        ( serve one-b1 "$GPU_B" 1 8100 && load one-b1-c8 8100 8 "$REQUESTS"; stop one-b1 ) &
        wait ;;
    esac
  fi
  python3 results/serve-gpus/summarize.py $L >$L/summary.log 2>&1; step "summary: $(tail -1 $L/summary.log)"
  step "finished" ;;
poll)
  keep() {  # $L into $OUT; each minute too, so that a call cut short (the session's device time spent) brings it back
    mkdir -p "$OUT" && cp $L/results/summary.* "$OUT/" 2>/dev/null
    tar -czf "$OUT/partial.tgz" --exclude=repo -C "$(dirname $L)" "$(basename $L)"
    mv "$OUT/partial.tgz" "$OUT/$(basename $L).tgz"
  }
  for i in $(seq 1 90); do
    grep -q "finished\|failed" $L/steps.log 2>/dev/null && break; [ $((i % 12)) = 0 ] && keep; sleep 5
  done
  cat $L/steps.log; cat $L/results/summary.md 2>/dev/null; keep ;;
*)
  echo "usage: bash results/serve-gpus/lease.sh start | poll | work"; exit 2 ;;
esac
