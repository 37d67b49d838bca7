#!/bin/bash
# Run here, from the repository root: downloads what sd-serve needs on the GPU box (Python 3.12, x86-64) and the box
# lacks (its package list: /work/.library/device/KINDS.md), in two carry folders under .carry/ (git-ignored), each
# under the 64 MiB a device call takes: serve-a holds PyTriton alone (55 MB, tritonserver inside), serve-b the rest,
# serve-c scipy: the box's scipy needs numpy 2 (np.long), and transformers imports it through scikit-learn.
# numpy 1.26.4 because PyTriton's outputs come back empty under numpy 2; ml-dtypes 0.5.4, the one tritonclient and
# onnx both take. Versions are those the CPU tests run with (pyproject.toml's serve extra and what pip chose here).
set -e
download() {  # FOLDER SPEC...
  mkdir -p "$1" && python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_35_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$1" "${@:2}"
}
rm -rf .carry/serve-a .carry/serve-b .carry/serve-c
download .carry/serve-a nvidia-pytriton==0.7.0
download .carry/serve-b numpy==1.26.4 ml-dtypes==0.5.4 tritonclient==2.73.0 python-rapidjson==1.25 pyzmq==27.3.0 \
  sh==2.4.0 importlib_metadata==10.2.0 gevent==26.9.0 geventhttpclient==2.6.1 brotli==1.2.1 greenlet==3.3.2 \
  zope.event==6.2 zope.interface==8.7
download .carry/serve-c scipy==1.17.1
du -sh .carry/serve-a .carry/serve-b .carry/serve-c
