# Sourced by the lease scripts kept with their results (results/*/*.sh), from the repository root on the GPU box;
# each defines `step` (its progress log) first. docs/gpu-box.md says how a lease runs.

lease_start() {  # DIR SCRIPT: copy the working tree to DIR/repo and run `bash SCRIPT work` there, detached. A device
  # call replaces the box's copy of the repository, so work inside it can vanish mid-build; DIR/repo stays.
  rm -rf "$1" && mkdir -p "$1/repo"
  tar -c --exclude=./.carry --exclude='./onnx*' --exclude='./engine*' --exclude=./build --exclude=./output . \
    | tar -x -C "$1/repo" || return 1
  (cd "$1/repo" && setsid nohup bash "$2" work </dev/null >>"$1/work.log" 2>&1 &)
}

trt86_setup() {  # DIR MODEL: TensorRT 8.6 and the carried wheels (TRT86_SHA), the plugin library for sm_90, and the
  # built-in MODEL generated, side by side; logs in DIR. Exports the environment into the calling shell.
  source scripts/box_trt86_env.sh >"$1/setup.log" 2>&1 || { step "setup failed"; return 1; }
  export DEMO_DIFFUSION_CACHE=/tmp/ddcache
  nvidia-smi >"$1/nvidia-smi.txt" 2>&1
  (cmake -S . -B build -DCMAKE_CUDA_ARCHITECTURES=90 -DTENSORRT_INCLUDE_DIR=/opt/k/misc/src/include \
    && cmake --build build -j 16) >"$1/cmake.log" 2>&1 &
  local library=$!
  python3 -c "from models.source import resolve_model; resolve_model('$2')" >"$1/generate.log" 2>&1 \
    || { step "generation of $2 failed"; return 1; }
  wait $library || { step "plugin library failed"; return 1; }
}
