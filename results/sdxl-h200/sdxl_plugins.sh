#!/bin/bash
# Our kernels in the SDXL torch backend: build the plugin library for sm_90 (+ sm_90a attention), then the contenders.
cmake -S . -B build -DCMAKE_CUDA_ARCHITECTURES=90 > /tmp/sdxl/cmake.log 2>&1 && cmake --build build -j 16 >> /tmp/sdxl/cmake.log 2>&1
echo "cmake exit $?" >> /tmp/sdxl/cmake.log
export DEMO_DIFFUSION_CACHE=/tmp/ddcache
python3 -c "import plugins; print(plugins.status())" >> /tmp/sdxl/cmake.log 2>&1
python3 scripts/benchmark.py --model sdxl-arch --height 1024 --width 1024 --denoising-steps 30 --scheduler Euler \
  --seed 0 --guidance-scale 5.0 --contenders diffusers-eager,ours,ours+fMHA+fMHCA --runs 3 --warmup-runs 1 \
  --results-dir /tmp/sdxl/results --work-dir /tmp/sdxl/images > /tmp/sdxl/bench2.log 2>&1
echo "exit $?" >> /tmp/sdxl/bench2.log
