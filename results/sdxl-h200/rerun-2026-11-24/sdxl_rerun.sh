#!/bin/bash
# SDXL torch-backend benchmark, repeat run on the box: detached; logs in /tmp/sdxl2/
D=/tmp/sdxl2; mkdir -p $D
python3 -m pip install -q --no-deps --no-index --find-links .whl diffusers importlib_metadata zipp onnx-graphsurgeon polygraphy filelock > $D/pip.log 2>&1
python3 -c "import diffusers, torch, matplotlib; print('imports ok: diffusers', diffusers.__version__, 'torch', torch.__version__, 'matplotlib', matplotlib.__version__)" >> $D/pip.log 2>&1
export DEMO_DIFFUSION_CACHE=/tmp/ddcache PYTHONUNBUFFERED=1
nvidia-smi > $D/nvidia-smi.txt 2>&1
date -u > $D/bench.log
python3 scripts/benchmark.py --model sdxl-arch --height 1024 --width 1024 --denoising-steps 30 --scheduler Euler \
  --seed 0 --guidance-scale 5.0 --contenders diffusers-eager,diffusers-compile,ours-no-plugins,ours-defaults \
  --runs 3 --warmup-runs 1 --results-dir $D/results --work-dir /tmp/bench-images >> $D/bench.log 2>&1
echo "exit $?" >> $D/bench.log
date -u >> $D/bench.log
