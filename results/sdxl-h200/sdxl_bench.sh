#!/bin/bash
# SDXL torch-backend benchmark on the box: detached; logs in /tmp/sdxl/
mkdir -p /tmp/sdxl
python3 -m pip install -q --no-deps --no-index --find-links .whl diffusers importlib_metadata zipp onnx-graphsurgeon polygraphy filelock > /tmp/sdxl/pip.log 2>&1
python3 -c "import diffusers, onnx_graphsurgeon, polygraphy; print(\"imports ok\")" >> /tmp/sdxl/pip.log 2>&1
export DEMO_DIFFUSION_CACHE=/tmp/ddcache
nvidia-smi > /tmp/sdxl/nvidia-smi.txt
python3 scripts/benchmark.py --model sdxl-arch --height 1024 --width 1024 --denoising-steps 30 --scheduler Euler \
  --seed 0 --guidance-scale 5.0 --contenders diffusers-eager,diffusers-compile,ours-no-plugins,ours-defaults \
  --runs 3 --warmup-runs 1 --results-dir /tmp/sdxl/results --work-dir /tmp/sdxl/images > /tmp/sdxl/bench.log 2>&1
echo "exit $?" >> /tmp/sdxl/bench.log
