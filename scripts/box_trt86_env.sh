# Source on the GPU box (H100/H200), in the repository root, once ../shared/trt86's carry parts have been
# appended to /opt/k/blob (see ../shared/trt86/README.md): unpacks TensorRT 8.6 and builds its Python
# bindings on first use, installs the wheels carried in .whl/ (diffusers, onnx-graphsurgeon, polygraphy,
# which the box lacks), and sets the environment. TRT86_SHA: the blob's expected sha prefix.
if [ ! -f /opt/trt86/env.sh ]; then
  tar -xOf /opt/k/blob misc.tar.xz | tar -xJ -C /opt/k && bash /opt/k/misc/box_setup.sh "${TRT86_SHA:-}" || return 1
fi
[ -d /tmp/site ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
  || return 1
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
source /opt/trt86/env.sh
