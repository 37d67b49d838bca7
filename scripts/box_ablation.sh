# The plugin ablation's lease on the GPU box, from a snapshot of the repository (so edits made here while
# it runs do not reach its build processes). Run from the repository root after the ../shared/trt86 carry
# parts are on the box (see README "Plugins in engines"), with .carry/snap (git archive HEAD) and .whl carried:
#   bash scripts/box_ablation.sh start CONFIGS BUDGET_S PARALLEL [GPUS]  # builds the plugin library, starts the ablation detached
#   bash scripts/box_ablation.sh wait                             # blocks up to ~9 min while it runs; prints progress
#   bash scripts/box_ablation.sh collect                          # results and logs into $OUT
export TRT86_SHA=1b00064f7adedb09
source scripts/box_trt86_env.sh || exit 1
SNAP=/tmp/snap WORK=/tmp/ablation
case "$1" in
start)
  rm -rf $SNAP && cp -r .carry/snap $SNAP && cd $SNAP || exit 1
  cmake -S . -B build -DCMAKE_CUDA_ARCHITECTURES=90 -DTENSORRT_INCLUDE_DIR=/opt/k/misc/src/include >/dev/null \
    && cmake --build build -j 16 >/dev/null || exit 1
  setsid nohup python3 scripts/ablation.py --model sd1.5-arch --disable-tactic-sources CUDNN --work-dir $WORK \
    --results-dir $SNAP/results --configs "$2" --build-budget-s "$3" --parallel-builds "$4" --build-gpus "${5:-1}" >$WORK.log 2>&1 </dev/null &
  sleep 2; cat $WORK.log ;;
wait)
  for _ in $(seq 1 105); do pgrep -f "scripts/ablatio[n].py" >/dev/null || break; sleep 5; done
  date; grep "\[ablation\]" $WORK.log | tail -30; nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv ;;
collect)
  cd $SNAP && mkdir -p $OUT/results && cp results/ablation-* results/plugins_auto.json $OUT/results/ 2>/dev/null
  tar -czf $OUT/logs.tgz $WORK.log $WORK/*/build.log $WORK/rows.json $WORK/*.png 2>/dev/null
  tail -30 $WORK.log ;;
esac
