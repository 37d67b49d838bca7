"""The plugin contract: the one place that names our plugins, the ops they are called by and what
their kernels take. It imports nothing heavy (no torch, no onnx), so any layer may read it.

Nine plugin keys, in canonical order (PLUGIN_KEYS): the six of Stable Diffusion's UNets and VAEs
(UNET_KEYS), then the three of the SD3/Flux transformers (TRANSFORMER_KEYS). Each is named in up to
two conventions (CONVENTIONS): ours (OURS, the kernels in plugins/src, reached as TensorRT plugins in
libsdplugins_trt.so and as PyTorch ops in libsdplugins.so), which has every key, and TensorRT's bundled
Stable Diffusion plugins (TENSORRT, libnvinfer_plugin 8.5/8.6), which has the six UNet keys only
(`Convention.has(key)`). The ONNX plugin passes emit, per key, a node of the convention's op type in its
domain, with the attributes `plugin_version` and `plugin_namespace` plus the key's fields; TensorRT's
ONNX parser maps the op type to the creator of that name, version and namespace.

| key          | ours: op, creator | its fields                | torch op       | TensorRT's op  | its fields      |
| ------------ | ----------------- | ------------------------- | -------------- | -------------- | --------------- |
| fMHA         | SDPfMHA           | scale                     | fmha           | fMHA_V2        |                 |
| fMHCA        | SDPfMHCA          | scale                     | fmhca          | fMHCA          |                 |
| GroupNorm    | SDPGroupNorm      | num_groups, epsilon, silu | group_norm     | GroupNorm      | epsilon, bSwish |
| LayerNorm    | SDPLayerNorm      | epsilon                   | layer_norm     | LayerNorm      | epsilon, axis   |
| SplitGeLU    | SDPSplitGeLU      |                           | split_gelu     | SplitGeLU      |                 |
| Seq2Spatial  | SDPSeq2Spatial    | residual_layout           | seq2spatial    | SeqLen2Spatial |                 |
| RMSNorm      | SDPRMSNorm        | epsilon                   | rms_norm       | (none)         |                 |
| AdaLayerNorm | SDPAdaLayerNorm   | epsilon                   | ada_layer_norm | (none)         |                 |
| GeLU         | SDPGeLU           |                           | gelu_tanh      | (none)         |                 |

| convention | ONNX domain    | plugin_version | plugin_namespace |
| ---------- | -------------- | -------------- | ---------------- |
| sdplugins  | sdplugins      | 1              | sdplugins        |
| tensorrt   | nvinfer_plugin | 1              | (empty)          |

PyTorch ops live in the namespace TORCH_OP_NAMESPACE (torch.ops.sdplugins.<torch op>). Limits: our
attention kernels take head sizes that are multiples of HEAD_SIZE_MULTIPLE up to MAX_HEAD_SIZE;
TensorRT's take what the TENSORRT_* constants say. Memory layouts (GroupNorm's layout, Seq2Spatial's
residual_layout) are LAYOUT_NCHW / LAYOUT_NHWC, the C ABI's SDP_LAYOUT_*.

The transformer keys: RMSNorm, x [..., D] * rsqrt(mean(x^2) + epsilon) * weight [D] (the Q/K norms);
AdaLayerNorm, LayerNorm(x [B, S, C], no affine) * (1 + scale [B, C]) + shift [B, C] (the modulation of
AdaLN blocks; its inputs x, scale, shift); GeLU, gelu_tanh(x [..., N] + bias [N]) (the feed-forward's
activation; its TensorRT plugin takes x and bias, a bias of zeros where the graph adds none).

The C++ side (plugins/trt, plugins/include) spells the same names itself; tests/test_contract.py reads
its source and checks it against this module.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

ATTENTION_KEYS = ("fMHA", "fMHCA")  # self- and cross-attention: one pair in the ablation and the benchmark
UNET_KEYS = (*ATTENTION_KEYS, "GroupNorm", "LayerNorm", "SplitGeLU", "Seq2Spatial")
TRANSFORMER_KEYS = ("RMSNorm", "AdaLayerNorm", "GeLU")
PLUGIN_KEYS = (*UNET_KEYS, *TRANSFORMER_KEYS)

_SDPLUGINS = "sdplugins"  # our convention, ONNX domain, plugin namespace, torch op namespace and library
OURS, TENSORRT = _SDPLUGINS, "tensorrt"
CONVENTIONS = (OURS, TENSORRT)


@dataclass(frozen=True)
class Convention:
    """Whose plugin nodes the passes emit: per plugin key the ONNX op type (which is also the TensorRT
    creator's name) and its fields (the node attributes besides plugin_version and plugin_namespace);
    the nodes' ONNX domain; the plugin_version and plugin_namespace the creators are registered under.
    A convention may lack a key (TensorRT's has no transformer plugins): `has(key)` says."""

    name: str
    ops: Mapping[str, str]
    fields: Mapping[str, tuple[str, ...]]
    domain: str
    version: str
    namespace: str

    def has(self, key: str) -> bool:
        return key in self.ops

    def op(self, key: str) -> str:
        """The op type of `key`; ValueError where this convention has no plugin for it."""
        if key not in self.ops:
            raise ValueError(f"the {self.name} plugin convention has no plugin for {key}")
        return self.ops[key]

    @property
    def keys(self) -> tuple[str, ...]:
        """The plugin keys this convention has, in PLUGIN_KEYS order."""
        return tuple(key for key in PLUGIN_KEYS if key in self.ops)

    @property
    def creator_names(self) -> tuple[str, ...]:
        """The creators' names, in PLUGIN_KEYS order."""
        return tuple(self.ops[key] for key in self.keys)


CONTRACT: Mapping[str, Convention] = MappingProxyType({
    OURS: Convention(
        name=OURS,
        ops=MappingProxyType({"fMHA": "SDPfMHA", "fMHCA": "SDPfMHCA", "GroupNorm": "SDPGroupNorm",
                              "LayerNorm": "SDPLayerNorm", "SplitGeLU": "SDPSplitGeLU",
                              "Seq2Spatial": "SDPSeq2Spatial", "RMSNorm": "SDPRMSNorm",
                              "AdaLayerNorm": "SDPAdaLayerNorm", "GeLU": "SDPGeLU"}),
        fields=MappingProxyType({"fMHA": ("scale",), "fMHCA": ("scale",),
                                 "GroupNorm": ("num_groups", "epsilon", "silu"), "LayerNorm": ("epsilon",),
                                 "SplitGeLU": (), "Seq2Spatial": ("residual_layout",), "RMSNorm": ("epsilon",),
                                 "AdaLayerNorm": ("epsilon",), "GeLU": ()}),
        domain=_SDPLUGINS, version="1", namespace=_SDPLUGINS),
    # TensorRT's bundled plugins are registered in the default namespace; its parser ignores the domain,
    # which only keeps ONNX tools from taking the nodes for standard ops. It has no transformer plugins.
    TENSORRT: Convention(
        name=TENSORRT,
        ops=MappingProxyType({"fMHA": "fMHA_V2", "fMHCA": "fMHCA", "GroupNorm": "GroupNorm",
                              "LayerNorm": "LayerNorm", "SplitGeLU": "SplitGeLU", "Seq2Spatial": "SeqLen2Spatial"}),
        fields=MappingProxyType({"fMHA": (), "fMHCA": (), "GroupNorm": ("epsilon", "bSwish"),
                                 "LayerNorm": ("epsilon", "axis"), "SplitGeLU": (), "Seq2Spatial": ()}),
        domain="nvinfer_plugin", version="1", namespace=""),
})


def convention(name: str) -> Convention:
    """The Convention called `name` (one of CONVENTIONS); ValueError for another."""
    if name not in CONTRACT:
        raise ValueError(f"unknown plugin convention {name!r}; one of {', '.join(CONVENTIONS)}")
    return CONTRACT[name]


# Ours, by name: the ONNX domain of our nodes, our creators' version, namespace and names.
PLUGIN_DOMAIN = CONTRACT[OURS].domain
PLUGIN_VERSION = CONTRACT[OURS].version
PLUGIN_NAMESPACE = CONTRACT[OURS].namespace
PLUGIN_NAMES = CONTRACT[OURS].creator_names
TENSORRT_DOMAIN = CONTRACT[TENSORRT].domain
TENSORRT_NAMESPACE = CONTRACT[TENSORRT].namespace
# The op type of a plugin node in either convention -> its plugin key (engines keep the node names,
# '<tensor>/<op type>', so their plugin layers can be counted back).
PLUGIN_OP_KEYS: Mapping[str, str] = MappingProxyType(
    {op: key for c in CONTRACT.values() for key, op in c.ops.items()})

# PyTorch custom ops (plugins/torch_ops.py): torch.ops.<TORCH_OP_NAMESPACE>.<TORCH_OPS[key]>.
TORCH_OP_NAMESPACE = _SDPLUGINS
TORCH_OPS: Mapping[str, str] = MappingProxyType({
    "fMHA": "fmha", "fMHCA": "fmhca", "GroupNorm": "group_norm", "LayerNorm": "layer_norm",
    "SplitGeLU": "split_gelu", "Seq2Spatial": "seq2spatial", "RMSNorm": "rms_norm", "AdaLayerNorm": "ada_layer_norm",
    "GeLU": "gelu_tanh"})

# The libraries (CMake targets, files in build/, and the environment variables that point elsewhere).
LIBRARY_NAME, TRT_LIBRARY_NAME = _SDPLUGINS, f"{_SDPLUGINS}_trt"
LIBRARY_FILE, TRT_LIBRARY_FILE = f"lib{LIBRARY_NAME}.so", f"lib{TRT_LIBRARY_NAME}.so"
LIBRARY_ENV, TRT_LIBRARY_ENV = "SDPLUGINS_LIBRARY", "SDPLUGINS_TRT_LIBRARY"
# Which attention kernels the library runs (auto, mma or wgmma), read by plugins/src/attention.cu at every call.
ATTENTION_PATH_ENV = "SDPLUGINS_ATTENTION"

# ---- what the kernels take ---------------------------------------------------------------------------

# Our attention kernels (fMHA, fMHCA): head sizes that are multiples of HEAD_SIZE_MULTIPLE up to MAX_HEAD_SIZE.
MAX_HEAD_SIZE, HEAD_SIZE_MULTIPLE = 256, 8
# Memory layouts: GroupNorm's input, Seq2Spatial's residual_layout (the C ABI's SDP_LAYOUT_NCHW/NHWC).
LAYOUT_NCHW, LAYOUT_NHWC = 0, 1
# What TensorRT 8.5/8.6's kernels take (plugin/*Plugin in NVIDIA/TensorRT 8.5.3): fMHA_V2's head sizes,
# fMHCA's longest key sequence, SplitGeLU's half widths, GroupNorm's fixed group count and its channel
# tiles (channels per block by channel count, TENSORRT_GROUP_NORM_DEFAULT_TILE otherwise). Their attention
# scale is 1/sqrt(D); their GroupNorm runs fp16 only.
TENSORRT_FMHA_HEAD_SIZES = (16, 32, 40, 64, 80, 128, 160, 256)
TENSORRT_FMHCA_MAX_KEYS = 128
TENSORRT_SPLIT_GELU_WIDTHS = (1280, 2560, 5120)
TENSORRT_GROUP_NORM_GROUPS = 32
TENSORRT_GROUP_NORM_TILES: Mapping[int, int] = MappingProxyType({960: 480, 1920: 480, 512: 256, 256: 256, 128: 128})
TENSORRT_GROUP_NORM_DEFAULT_TILE = 320
