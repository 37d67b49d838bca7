# The plugin ablation's lease on the GPU box, from a snapshot of the repository (so edits made here while
# it runs do not reach its build processes). Run from the repository root after the ../shared/trt86 carry
# parts are on the box (see README "Plugins in engines"), with .carry/snap (git archive HEAD), .whl and
# .carry/timing carried:
#   bash scripts/box_ablation.sh start CONFIGS BUDGET_S   # builds the plugin library, starts the ablation detached
#   bash scripts/box_ablation.sh wait                     # blocks up to ~9.5 min while it runs; prints progress
#   bash scripts/box_ablation.sh collect                  # results, logs and the merged timing cache into $OUT
export TRT86_SHA=1b00064f7adedb09
source scripts/box_trt86_env.sh || exit 1
ROOT=$PWD SNAP=/tmp/snap WORK=/tmp/ablation
case "$1" in
start)
  rm -rf $SNAP && cp -r .carry/snap $SNAP && cd $SNAP || exit 1
  cmake -S . -B build -DCMAKE_CUDA_ARCHITECTURES=90 -DTENSORRT_INCLUDE_DIR=/opt/k/misc/src/include >/dev/null \
    && cmake --build build -j 16 >/dev/null || exit 1
  cp $ROOT/.carry/timing/unet.cache $WORK.cache
  python3 -c "import sys; from pathlib import Path; from demo.engine import merge_timing_caches as m; \
print('refused:', m('tensorrt', Path('$WORK.cache'), [Path(sys.argv[1])]))" $ROOT/.carry/timing/clipvae.cache
  setsid nohup python3 scripts/ablation.py --model sd1.5-arch --disable-tactic-sources CUDNN --timing-cache $WORK.cache \
    --work-dir $WORK --results-dir $SNAP/results --parallel-builds 6 --configs "$2" --build-budget-s "$3" \
    >$WORK.log 2>&1 </dev/null &
  sleep 2; cat $WORK.log ;;
wait)
  for _ in $(seq 1 110); do pgrep -f "scripts/ablatio[n].py" >/dev/null || break; sleep 5; done
  grep -h "engine built\|\[ablation\]" $WORK.log $WORK/*/build.log | tail -40; nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv ;;
collect)
  cd $SNAP && mkdir -p $OUT/results && cp results/ablation-* results/plugins_auto.json $OUT/results/ 2>/dev/null
  cp $WORK.cache $OUT/timing.cache; tar -czf $OUT/logs.tgz $WORK.log $WORK/*/build.log $WORK/rows.json $WORK/*/image.png 2>/dev/null
  tail -30 $WORK.log ;;
esac
