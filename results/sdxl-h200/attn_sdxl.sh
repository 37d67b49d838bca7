#!/bin/bash
# Our attention kernels (wgmma/TMA and mma paths) at SDXL's shapes, with the rest of the kernel tests.
mkdir -p /tmp/k
python3 -m pytest --version > /tmp/k/pip.log 2>&1 || python3 -m pip install -q --no-deps --no-index --find-links .whl pytest pluggy iniconfig >> /tmp/k/pip.log 2>&1
cmake -S . -B build -DCMAKE_CUDA_ARCHITECTURES=90 > /tmp/k/cmake.log 2>&1 && cmake --build build -j 16 >> /tmp/k/cmake.log 2>&1
echo "cmake exit $?" >> /tmp/k/cmake.log
python3 -m pytest -q -p no:cacheprovider tests/test_plugins_gpu.py -rs > /tmp/k/pytest.log 2>&1
echo "exit $?" >> /tmp/k/pytest.log
