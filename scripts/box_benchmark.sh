# scripts/benchmark.py and scripts/profile_unet.py on the GPU box (H100/H200). The benchmark runs detached,
# so a run longer than one device call (torch.compile takes minutes per contender) goes on between calls.
# From the repository root, with .whl carried (and for the TensorRT contenders the ../shared/trt86 carry parts
# on the box, see README "Plugins in engines"; no timing cache: TensorRT 8.6.0 refuses caches with Myelin entries):
#   bash scripts/box_benchmark.sh start CONTENDERS [benchmark.py flags]   # plugin library, then the benchmark
#   bash scripts/box_benchmark.sh wait                                    # up to ~9.5 min, then its progress
#   bash scripts/box_benchmark.sh collect                                 # results, defaults table, log -> $OUT
#   bash scripts/box_benchmark.sh profile [profile_unet.py flags]         # one UNet profile (foreground) -> $OUT
# Results accumulate in output/benchmark-results (ignored, so kept while the box stays up): each start
# merges its rows with the earlier ones', and PSNR compares with the diffusers-eager image saved earlier.
export TRT86_SHA=1b00064f7adedb09
if ! source scripts/box_trt86_env.sh 2>/dev/null; then
  echo "box_benchmark: TensorRT 8.6 is not set up here; the TensorRT contenders will be skipped"
  [ -d /tmp/site ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
fi
RESULTS=output/benchmark-results LOG=/tmp/benchmark.log TRT_INCLUDE=${TRT_INCLUDE:-/opt/k/misc/src/include}
build() {  # the plugin library for this GPU (and the TensorRT plugin library where TensorRT's headers are)
  [ -f build/libsdplugins.so ] && return 0
  local include=(); [ -d "$TRT_INCLUDE" ] && include=(-DTENSORRT_INCLUDE_DIR="$TRT_INCLUDE")
  cmake -S . -B build -DCMAKE_CUDA_ARCHITECTURES=90 "${include[@]}" >/tmp/cmake.log 2>&1 \
    && cmake --build build -j 16 >>/tmp/cmake.log 2>&1 || { tail -20 /tmp/cmake.log; return 1; }
}
case "$1" in
start)
  build || exit 1
  contenders=$2; shift 2
  setsid nohup python3 scripts/benchmark.py --model sd1.5-arch --contenders "$contenders" --results-dir $RESULTS \
    --defaults-table $RESULTS/torch_defaults.json --disable-tactic-sources CUDNN "$@" >>$LOG 2>&1 </dev/null &
  sleep 5; tail -5 $LOG ;;
wait)
  for _ in $(seq 1 114); do pgrep -f "scripts/benchmar[k].py" >/dev/null || break; sleep 5; done
  grep -h "^\[benchmark\]\|^\[build\]\|^\[plugins\]" $LOG | tail -30
  if pgrep -f "scripts/benchmar[k].py" >/dev/null; then echo "box_benchmark: still running"; else echo "box_benchmark: done"; fi ;;
collect)
  mkdir -p "$OUT/results" && cp $RESULTS/* "$OUT/results/" 2>/dev/null; cp $LOG "$OUT/" 2>/dev/null
  tar -czf "$OUT/images.tgz" output/benchmark 2>/dev/null; tail -40 $LOG ;;
profile)
  build || exit 1
  shift; python3 scripts/profile_unet.py --model sd1.5-arch --results-dir "$OUT" "$@" ;;
*)
  echo "usage: bash scripts/box_benchmark.sh start CONTENDERS [flags] | wait | collect | profile [flags]"; exit 2 ;;
esac
