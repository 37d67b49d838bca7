#!/bin/bash
# Second lease: our torch backend with all our kernels on SDXL (the fp32 VAE now keeps its modules).
mkdir -p /tmp/sdxl/results && cp .whl/prev/benchmark-nvidia-h200.json /tmp/sdxl/results/
python3 -m pip install -q --no-deps --no-index --find-links .whl diffusers importlib_metadata zipp onnx-graphsurgeon polygraphy filelock > /tmp/sdxl/pip.log 2>&1
cmake -S . -B build -DCMAKE_CUDA_ARCHITECTURES=90 > /tmp/sdxl/cmake.log 2>&1 && cmake --build build -j 16 >> /tmp/sdxl/cmake.log 2>&1
echo "cmake exit $?" >> /tmp/sdxl/cmake.log
export DEMO_DIFFUSION_CACHE=/tmp/ddcache
python3 scripts/benchmark.py --model sdxl-arch --height 1024 --width 1024 --denoising-steps 30 --scheduler Euler \
  --seed 0 --guidance-scale 5.0 --contenders diffusers-eager,ours --runs 3 --warmup-runs 1 \
  --results-dir /tmp/sdxl/results --work-dir /tmp/sdxl/images > /tmp/sdxl/bench3.log 2>&1
echo "exit $?" >> /tmp/sdxl/bench3.log
