# One lease of a multi-GPU box (H200 x4, say) for the plugin ablation, alone or beside the benchmark, run
# from a snapshot of the repository (so edits made here while it runs do not reach it). From the repository
# root, after the ../shared/trt86 carry parts are on the box (README "Plugins in engines"), with .carry/snap
# (git archive HEAD) and .whl carried:
#   TRT86_SHA=<blob sha make_parts.sh printed> \
#   bash scripts/box_lease.sh start LEVEL BUDGET_S CONFIGS [CONTENDERS]  # plugin library, then the work, detached
#   bash scripts/box_lease.sh wait                                       # up to ~9.5 min; prints progress
#   bash scripts/box_lease.sh collect                                    # results and logs into $OUT
# With CONTENDERS, the ablation builds on every GPU but the last and runs on the first; the last GPU runs
# the benchmark's torch contenders, the UNet profile at the torch defaults they chose, the GPU tests and the
# attention profile (Nsight Compute), then, once the ablation's engines are built, the TensorRT contenders
# on them (--engines-from-ablation: same builder level and tactic sources), so name 'none' and '+Seq2Spatial'
# first in CONFIGS (the build order; a BUDGET_S cut then falls on the others).
# Without CONTENDERS, the ablation builds on every GPU, BUILDS_PER_GPU at a time on each (default 1: an
# engine build is mostly one CPU core compiling, its GPU idle between tactic timings), and the last GPU
# also runs the engine GPU tests first.
source scripts/box_trt86_env.sh || exit 1
SNAP=/tmp/snap WORK=/tmp/ablation LOGS=/tmp/lease
ENGINES=(--disable-tactic-sources CUDNN --optimization-level)
REQUEST=(--seed 0 --scheduler DDIM)  # one request for the ablation and both benchmark runs (images compared)
ENGINE_TESTS="tests/test_engines_gpu.py tests/test_trt_plugins_gpu.py"
running() { pgrep -f "$1" >/dev/null; }
case "$1" in
start)
  gpus=$(nvidia-smi -L | wc -l)
  [ "$gpus" -ge 2 ] || [ -z "$5" ] || { echo "box_lease: the benchmark beside the ablation needs 2 or more GPUs, found $gpus"; exit 2; }
  rm -rf $SNAP $LOGS && mkdir -p $LOGS && cp -r .carry/snap $SNAP && cd $SNAP || exit 1
  cmake -S . -B build -DCMAKE_CUDA_ARCHITECTURES=90 -DTENSORRT_INCLUDE_DIR=/opt/k/misc/src/include >$LOGS/cmake.log \
    && cmake --build build -j 32 >>$LOGS/cmake.log 2>&1 || { tail -20 $LOGS/cmake.log; exit 1; }
  if [ -n "$5" ]; then builders=$((gpus - 1)) last=last-gpu; else builders=$gpus last=gpu-tests; fi
  CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((builders - 1))) setsid nohup python3 scripts/ablation.py --model sd1.5-arch \
    "${ENGINES[@]}" "$2" "${REQUEST[@]}" --update-defaults --work-dir $WORK --configs "$4" --build-budget-s "$3" \
    --parallel-builds $((builders * ${BUILDS_PER_GPU:-1})) --build-gpus $builders >$LOGS/ablation.log 2>&1 </dev/null &
  CUDA_VISIBLE_DEVICES=$((gpus - 1)) setsid nohup bash scripts/box_lease.sh $last "$2" "$5" \
    >$LOGS/last-gpu.log 2>&1 </dev/null &
  sleep 5; cat $LOGS/ablation.log $LOGS/last-gpu.log ;;
last-gpu)  # started by `start`, in the snapshot
  step() { echo "[lease] $(date +%T) $1"; }
  step "benchmark: torch contenders"
  python3 scripts/benchmark.py --model sd1.5-arch --contenders "$3" "${ENGINES[@]}" "$2" "${REQUEST[@]}" \
    --update-defaults >$LOGS/benchmark.log 2>&1
  step "UNet profile at the torch defaults"
  python3 scripts/profile_unet.py --model sd1.5-arch --results-dir results >$LOGS/profile_unet.log 2>&1
  step "GPU tests"
  timeout 900 python3 -m pytest -q -p no:cacheprovider tests/test_torch_accel_gpu.py $ENGINE_TESTS >$LOGS/pytest.log 2>&1
  step "attention profile"
  ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  "${ncu:-ncu}" --clock-control none --kernel-name regex:"attention|sdpa|flash" --section SpeedOfLight \
    --section ComputeWorkloadAnalysis --section Occupancy --section WarpStateStats --section SchedulerStats \
    python3 scripts/profile_attention.py >$LOGS/ncu_attention.txt 2>&1
  step "waiting for the ablation's engines"
  until grep -q "configurations ready" $LOGS/ablation.log || ! running "scripts/ablatio[n].py"; do sleep 10; done
  step "benchmark: TensorRT contenders"
  python3 scripts/benchmark.py --model sd1.5-arch --contenders tensorrt,tensorrt-plugins "${ENGINES[@]}" "$2" \
    "${REQUEST[@]}" --engines-from-ablation $WORK >>$LOGS/benchmark.log 2>&1
  step "done" ;;
gpu-tests)  # started by `start` without contenders, in the snapshot
  echo "[lease] $(date +%T) GPU tests"
  timeout 900 python3 -m pytest -q -p no:cacheprovider $ENGINE_TESTS >$LOGS/pytest.log 2>&1
  echo "[lease] $(date +%T) done"; tail -3 $LOGS/pytest.log ;;
wait)
  for _ in $(seq 1 114); do running "box_lease.s[h] (last-gpu|gpu-tests)" || running "scripts/ablatio[n].py" || break; sleep 5; done
  date; grep -h "\[sd-ablation\]" $LOGS/ablation.log | tail -20; tail -3 $LOGS/ablation.log | grep -v "^\[sd-ablation\]"
  grep -h "^\[lease\]\|^\[sd-benchmark\]" $LOGS/last-gpu.log $LOGS/benchmark.log | tail -12
  tail -2 $LOGS/pytest.log 2>/dev/null
  nvidia-smi --query-gpu=index,memory.used,utilization.gpu --format=csv,noheader ;;
collect)
  mkdir -p "$OUT/results" && cp $SNAP/results/ablation-* $SNAP/results/benchmark-* $SNAP/results/profile-unet-* \
    $SNAP/plugins/tuned_defaults.json "$OUT/results/" 2>/dev/null
  tar -czf "$OUT/logs.tgz" $LOGS $WORK/*/build.log $WORK/rows.json $WORK/*.png 2>/dev/null
  tail -5 $LOGS/ablation.log; tail -5 $LOGS/pytest.log ;;
*)
  echo "usage: bash scripts/box_lease.sh start LEVEL BUDGET_S CONFIGS CONTENDERS | wait | collect"; exit 2 ;;
esac
