# Time one UNet engine file alone (sd1.5-arch, guided batch 2, 512x512, CUDA graph) and profile it by layer kind:
# the INT8 UNet on 2026-11-25, when its fp16 peers were lost and the benchmark could not run it (results/README.md).
# On the box, from the repository root, after `source /opt/trt86/env.sh` with the repository and /tmp/site on
# PYTHONPATH: python3 unet_engine_alone.py engine-plugins-groupnorm-fmha-fmhca/unet.int8.engine OUT.json
# (its JSON then listed the 15 slowest layers overall; bench.runner.unet_profile now gives each kind's slowest).
import json, sys, torch
from pathlib import Path
from demo.trt_flavour import TensorRTAPI
from demo.engine_runtime import create_engine_stages
from bench.runner import unet_profile
from models import STAGE_MODELS
from models.source import resolve_model
path, out = Path(sys.argv[1]), sys.argv[2]
unet = STAGE_MODELS["unet"](resolve_model("sd1.5-arch"))
stage = create_engine_stages([unet], {"unet": path}, TensorRTAPI("tensorrt"), torch.float16, True, "cuda",
                             plugins=("GroupNorm",))["unet"]
stage.prepare(2, 512, 512)
feed = unet.sample_inputs(2, 512, 512, torch.device("cuda"), torch.float16, torch.Generator().manual_seed(0))
for _ in range(20): stage(feed)
torch.cuda.synchronize()
times = []
for _ in range(5):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(50): stage(feed)
    b.record(); torch.cuda.synchronize(); times.append(a.elapsed_time(b) / 50)
by_kind, slowest = unet_profile(stage.engine)
result = {"engine": str(path), "gpu": torch.cuda.get_device_name(), "unet_ms_per_call_runs": times,
          "unet_ms_per_call": sorted(times)[2], "int8_layers": stage.engine.int8_layers(),
          "engine_bytes": path.stat().st_size, "unet_ms_by_kind": by_kind, "unet_slowest_layers": slowest}
json.dump(result, open(out, "w"), indent=1)
print(json.dumps({k: v for k, v in result.items() if k != "unet_slowest_layers"}, indent=1))
