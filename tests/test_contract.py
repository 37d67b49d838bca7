"""The plugin contract (plugins.contract) is the one definition every side follows: the C++ creators
(read from their source), the PyTorch ops, and the nodes the ONNX passes emit in either convention.
Also the tuned defaults shipped beside it (plugins.tuned, plugins/tuned_defaults.json)."""

import json
import re
from pathlib import Path

import numpy as np
import onnx_graphsurgeon as gs
import pytest
from onnx import TensorProto, helper, numpy_helper

import plugins
from core.errors import UsageError
from plugins import contract
from plugins.contract import (
    CONVENTIONS,
    HEAD_SIZE_MULTIPLE,
    LAYOUT_NCHW,
    LAYOUT_NHWC,
    LIBRARY_NAME,
    MAX_HEAD_SIZE,
    OURS,
    PLUGIN_KEYS,
    PLUGIN_NAMES,
    PLUGIN_NAMESPACE,
    PLUGIN_OP_KEYS,
    PLUGIN_VERSION,
    TENSORRT,
    TORCH_OP_NAMESPACE,
    TORCH_OPS,
    TRANSFORMER_KEYS,
    TRT_LIBRARY_NAME,
    UNET_KEYS,
    convention,
)
from plugins.tuned import (
    PLUGINS_AUTO,
    TORCH_DEFAULTS,
    TUNED_DEFAULTS_FILE,
    entry_key,
    find_entry,
    read_entry,
    write_entry,
)

ROOT = Path(__file__).resolve().parent.parent


# ---- the contract itself ------------------------------------------------------------------------------

def test_the_contract_covers_every_key_ours_all_and_tensorrts_the_unet_keys():
    assert UNET_KEYS == ("fMHA", "fMHCA", "GroupNorm", "LayerNorm", "SplitGeLU", "Seq2Spatial")
    assert TRANSFORMER_KEYS == ("RMSNorm", "AdaLayerNorm", "GeLU")
    assert PLUGIN_KEYS == UNET_KEYS + TRANSFORMER_KEYS
    assert CONVENTIONS == (OURS, TENSORRT) and OURS != TENSORRT
    for name, keys in ((OURS, PLUGIN_KEYS), (TENSORRT, UNET_KEYS)):
        c = convention(name)
        assert c.name == name and set(c.ops) == set(c.fields) == set(keys) and c.keys == keys
        assert len(set(c.ops.values())) == len(keys)  # one op type per key
        assert [key for key in PLUGIN_KEYS if c.has(key)] == list(keys)
    for key in TRANSFORMER_KEYS:  # TensorRT 8.6 bundles no counterpart
        with pytest.raises(ValueError, match=f"the tensorrt plugin convention has no plugin for {key}"):
            convention(TENSORRT).op(key)
    assert convention(OURS).creator_names == PLUGIN_NAMES
    assert len(convention(TENSORRT).creator_names) == len(UNET_KEYS)
    assert (convention(OURS).domain, convention(OURS).namespace, convention(OURS).version) == \
        (OURS, PLUGIN_NAMESPACE, PLUGIN_VERSION)
    assert set(TORCH_OPS) == set(PLUGIN_KEYS)
    # Every op type of either convention maps back to its key.
    assert {op: key for name in CONVENTIONS for key, op in convention(name).ops.items()} == dict(PLUGIN_OP_KEYS)
    with pytest.raises(ValueError, match="unknown plugin convention 'ours'"):
        convention("ours")


def test_the_contract_and_the_tuned_defaults_import_nothing_heavy():
    import subprocess
    import sys

    code = ("import sys, plugins, plugins.contract, plugins.tuned; "
            "print(sorted(m for m in ('torch', 'onnx', 'numpy', 'diffusers') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_sdplugins_is_spelled_only_in_the_contract():
    """In the packages this contract belongs to, the name is written once."""
    spelled = [path.relative_to(ROOT).as_posix() for package in ("plugins", "models")
               for path in sorted((ROOT / package).rglob("*.py")) if f'"{OURS}"' in path.read_text()]
    assert spelled == ["plugins/contract.py"]


# ---- the C++ side follows it ------------------------------------------------------------------------------

def _cpp_specs() -> dict[str, tuple[str, tuple[str, ...]]]:
    """struct name -> (kName, field names in kFields order), read from plugins/trt/sdplugins_trt.cpp."""
    source = (ROOT / "plugins" / "trt" / "sdplugins_trt.cpp").read_text()
    starts = list(re.finditer(r"struct (\w+)\b[^{;]*\{\s*static constexpr char kName\[\] = \"(\w+)\";", source))
    specs = {}
    for start, end in zip(starts, starts[1:] + [None]):
        body = source[start.end():end.start() if end else len(source)]
        fields = re.search(r"kFields\{(.*?)\};", body, re.S)
        assert fields, f"no kFields in {start.group(1)}"
        specs[start.group(1)] = (start.group(2), tuple(re.findall(r'(?:int|float)_field\("(\w+)"', fields.group(1))))
    return specs


def test_the_tensorrt_creators_are_the_contracts():
    source = (ROOT / "plugins" / "trt" / "sdplugins_trt.cpp").read_text()
    specs = _cpp_specs()
    creators = dict((variable, spec) for spec, variable in re.findall(r"static Creator<(\w+)> (\w+);", source))
    registered = re.search(r"creators\[\] = \{(.*?)\};", source, re.S).group(1)
    order = [creators[variable] for variable in re.findall(r"&(\w+)", registered)]
    # The library registers one creator per key, in PLUGIN_KEYS order, named and with the fields of the contract.
    ours = convention(OURS)
    assert [specs[spec][0] for spec in order] == list(PLUGIN_NAMES)
    by_name = dict(specs.values())
    assert {key: by_name[ours.op(key)] for key in PLUGIN_KEYS} == dict(ours.fields)


def test_the_adapter_version_namespace_and_the_abi_follow_the_contract():
    adapter = (ROOT / "plugins" / "trt" / "plugin_adapter.h").read_text()
    assert re.search(r'kPluginVersion\[\] = "(\w*)";', adapter).group(1) == PLUGIN_VERSION
    assert re.search(r'kPluginNamespace\[\] = "(\w*)";', adapter).group(1) == PLUGIN_NAMESPACE
    header = (ROOT / "plugins" / "include" / "sdplugins.h").read_text()
    nchw, nhwc = re.search(r"SDP_LAYOUT_NCHW = (\d+), SDP_LAYOUT_NHWC = (\d+)", header).groups()
    assert (int(nchw), int(nhwc)) == (LAYOUT_NCHW, LAYOUT_NHWC)
    attention = (ROOT / "plugins" / "src" / "attention.cu").read_text()
    multiple, smallest, largest = map(int, re.search(r"d % (\d+) == 0 && d >= (\d+) && d <= (\d+)", attention).groups())
    assert (multiple, smallest, largest) == (HEAD_SIZE_MULTIPLE, HEAD_SIZE_MULTIPLE, MAX_HEAD_SIZE)
    cmake = (ROOT / "CMakeLists.txt").read_text()
    assert set(re.findall(r"add_library\((\w+) SHARED", cmake)) == {LIBRARY_NAME, TRT_LIBRARY_NAME}


# ---- the PyTorch ops follow it ------------------------------------------------------------------------------

def test_the_torch_ops_are_the_contracts():
    import torch

    from plugins import torch_ops

    registered = {name for name in torch._C._dispatch_get_all_op_names() if name.startswith(f"{TORCH_OP_NAMESPACE}::")}
    assert registered == {f"{TORCH_OP_NAMESPACE}::{op}" for op in TORCH_OPS.values()}
    for key, op in TORCH_OPS.items():  # the op of each key is the function of that name
        assert (getattr(torch_ops, op)._namespace, getattr(torch_ops, op)._name) == (TORCH_OP_NAMESPACE, op), key
        assert hasattr(getattr(torch.ops, TORCH_OP_NAMESPACE), op)
    assert (torch_ops.LAYOUT_NCHW, torch_ops.MAX_HEAD_SIZE) == (LAYOUT_NCHW, MAX_HEAD_SIZE)


# ---- the ONNX passes emit it ----------------------------------------------------------------------------------

F16 = np.float16
OPSET = 21


def _graph(nodes, inputs: dict[str, list[int]], initializers: dict[str, np.ndarray]) -> gs.Graph:
    """A gs graph of `nodes` (output 'y'), fp16 inputs of these shapes and these constants."""
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT16, s) for n, s in inputs.items()],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, None)],
        initializer=[numpy_helper.from_array(v, n) for n, v in initializers.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    return gs.import_onnx(model)


def _attention(cross: bool) -> gs.Graph:
    """softmax(q k^T / sqrt(D)) v over 2 heads of size 64 (a size TensorRT's fMHA_V2 takes), 8 context keys."""
    rng = np.random.default_rng(0)
    channels, heads, size, seq, keys = 32, 2, 64, 16, 8
    source = "context" if cross else "x"
    nodes, consts = [], {"scale": np.array(size ** -0.5, F16)}
    for p, perm in (("q", (0, 2, 1, 3)), ("k", (0, 2, 3, 1)), ("v", (0, 2, 1, 3))):
        length = seq if p == "q" else (keys if cross else seq)
        consts[f"w{p}"] = rng.standard_normal((channels, heads * size)).astype(F16)
        consts[f"{p}_shape"] = np.array([1, length, heads, size], np.int64)
        nodes += [helper.make_node("MatMul", ["x" if p == "q" else source, f"w{p}"], [f"{p}_proj"]),
                  helper.make_node("Reshape", [f"{p}_proj", f"{p}_shape"], [f"{p}_heads"]),
                  helper.make_node("Transpose", [f"{p}_heads"], [f"{p}_t"], perm=perm)]
    nodes += [helper.make_node("MatMul", ["q_t", "k_t"], ["scores"]),
              helper.make_node("Mul", ["scores", "scale"], ["scaled"]),
              helper.make_node("Softmax", ["scaled"], ["probs"], axis=-1),
              helper.make_node("MatMul", ["probs", "v_t"], ["weighted"]),
              helper.make_node("Transpose", ["weighted"], ["y"], perm=(0, 2, 1, 3))]
    inputs = {"x": [1, seq, channels], **({"context": [1, keys, channels]} if cross else {})}
    return _graph(nodes, inputs, consts)


def _group_norm() -> gs.Graph:
    """GroupNormalization (opset 21: per-channel scale and bias) + SiLU: 32 groups over 320 channels, fp16."""
    return _graph([helper.make_node("GroupNormalization", ["x", "gamma", "beta"], ["norm"], num_groups=32),
                   helper.make_node("Sigmoid", ["norm"], ["sigmoid"]),
                   helper.make_node("Mul", ["norm", "sigmoid"], ["y"])],
                  {"x": [1, 320, 4, 4]}, {"gamma": np.ones(320, F16), "beta": np.zeros(320, F16)})


def _layer_norm() -> gs.Graph:
    return _graph([helper.make_node("LayerNormalization", ["x", "gamma", "beta"], ["y"], axis=-1)],
                  {"x": [1, 16, 40]}, {"gamma": np.ones(40, F16), "beta": np.zeros(40, F16)})


def _split_gelu() -> gs.Graph:
    """(x + bias) split in halves, value * gelu(gate), with a half width TensorRT's SplitGeLU takes."""
    width = 2 * 1280
    return _graph([helper.make_node("Add", ["x", "bias"], ["biased"]),
                   helper.make_node("Split", ["biased"], ["value", "gate"], axis=-1, num_outputs=2),
                   helper.make_node("Gelu", ["gate"], ["gelu"]),
                   helper.make_node("Mul", ["value", "gelu"], ["y"])],
                  {"x": [1, 4, width]}, {"bias": np.zeros(width, F16)})


def _seq2spatial() -> gs.Graph:
    """(x + bias + a sequence residual) to [B, C, H, W], H and W read from a feature map (SD 1.x's form)."""
    channels = 8
    return _graph([helper.make_node("Add", ["x", "bias"], ["biased"]),
                   helper.make_node("Add", ["biased", "residual"], ["summed"]),
                   helper.make_node("Shape", ["feature"], ["feature_shape"]),
                   helper.make_node("Gather", ["feature_shape", "bhw"], ["dims"], axis=0),
                   helper.make_node("Concat", ["dims", "c"], ["spatial_shape"], axis=0),
                   helper.make_node("Reshape", ["summed", "spatial_shape"], ["spatial"]),
                   helper.make_node("Transpose", ["spatial"], ["y"], perm=(0, 3, 1, 2))],
                  {"x": [1, 12, channels], "residual": [1, 12, channels], "feature": [1, channels, 3, 4]},
                  {"bias": np.zeros(channels, F16), "bhw": np.array([0, 2, 3], np.int64),
                   "c": np.array([channels], np.int64)})


GRAPHS = {"fMHA": lambda: _attention(cross=False), "fMHCA": lambda: _attention(cross=True),
          "GroupNorm": _group_norm, "LayerNorm": _layer_norm, "SplitGeLU": _split_gelu, "Seq2Spatial": _seq2spatial}


@pytest.mark.parametrize("key, name", [(key, name) for name in CONVENTIONS for key in GRAPHS
                                       if convention(name).has(key)])
def test_the_passes_emit_the_contracts_nodes(key, name):
    from models.plugin_passes import PLUGIN_PASSES

    graph = GRAPHS[key]()
    result = PLUGIN_PASSES[key].apply(graph, name)
    assert (result.replaced, result.skipped_reasons) == (1, [])
    c = convention(name)
    [node] = [n for n in graph.nodes if n.domain == c.domain]
    assert node.op == c.op(key) and PLUGIN_OP_KEYS[node.op] == key
    assert node.name.endswith(f"/{c.op(key)}")  # what engines' plugin layers are counted back by
    assert (node.attrs["plugin_version"], node.attrs["plugin_namespace"]) == (c.version, c.namespace)
    assert tuple(a for a in node.attrs if a not in ("plugin_version", "plugin_namespace")) == c.fields[key]
    if (key, name) == ("Seq2Spatial", OURS):
        assert node.attrs["residual_layout"] == LAYOUT_NHWC


def test_a_pass_refuses_an_unknown_convention():
    from models.plugin_passes import PLUGIN_PASSES

    with pytest.raises(ValueError, match="unknown plugin convention"):
        PLUGIN_PASSES["LayerNorm"].apply(_layer_norm(), "ours")


def test_the_torch_substitutes_take_the_contracts_head_sizes():
    """The module substitution and the passes refuse the same attention head sizes (the contract's limits)."""
    from plugins.diffusers_modules import _attention_problem

    class Attention:  # what _attention_problem reads before the head-size check
        def __init__(self, size):
            from diffusers.models.attention_processor import AttnProcessor2_0

            self.inner_dim, self.heads, self.processor = 2 * size, 2, AttnProcessor2_0()

    for size in (HEAD_SIZE_MULTIPLE - 1, MAX_HEAD_SIZE + HEAD_SIZE_MULTIPLE):
        assert f"is not a multiple of {HEAD_SIZE_MULTIPLE} up to {MAX_HEAD_SIZE}" in _attention_problem(
            Attention(size), cross=False)


# ---- the tuned defaults shipped beside it ----------------------------------------------------------------------

def test_the_shipped_tuned_defaults_are_read():
    assert TUNED_DEFAULTS_FILE == Path(plugins.__file__).resolve().parent / "tuned_defaults.json"
    assert set(json.loads(TUNED_DEFAULTS_FILE.read_text())) == {PLUGINS_AUTO, TORCH_DEFAULTS}
    auto = read_entry(PLUGINS_AUTO, "9.0")  # measured before the transformer plugins existed
    assert auto["plugins"] == sorted(UNET_KEYS) and auto["gpu"] == "NVIDIA H100 80GB HBM3"
    torch_defaults = read_entry(TORCH_DEFAULTS, "9.0")
    assert (torch_defaults["plugins"], torch_defaults["channels_last"], torch_defaults["cuda_graph"],
            torch_defaults["compile"]) == ([], True, True, "default")
    assert read_entry(PLUGINS_AUTO, "1.0") is None

    from models.plugin_set import PLUGINS_HELP, parse_plugin_set

    assert parse_plugin_set("auto", "9.0") == tuple(sorted(UNET_KEYS))
    assert "plugins/tuned_defaults.json" in PLUGINS_HELP


def test_write_entry_keeps_the_other_section_and_entries(tmp_path):
    path = tmp_path / "tuned.json"
    assert read_entry(PLUGINS_AUTO, "9.0", path) is None  # no file: no entry
    write_entry(PLUGINS_AUTO, "8.0", {"plugins": ["fMHA"], "gpu": "A100"}, path)
    torch_entry = {"plugins": [], "channels_last": True, "cuda_graph": False, "compile": "none"}
    write_entry(TORCH_DEFAULTS, "9.0", torch_entry, path)
    write_entry(PLUGINS_AUTO, "9.0", {"plugins": ["GroupNorm"]}, path)
    write_entry(PLUGINS_AUTO, "8.0", {"plugins": ["LayerNorm"], "gpu": "A100"}, path)  # replaced
    assert json.loads(path.read_text()) == {
        PLUGINS_AUTO: {"8.0": {"plugins": ["LayerNorm"], "gpu": "A100"}, "9.0": {"plugins": ["GroupNorm"]}},
        TORCH_DEFAULTS: {"9.0": torch_entry}}
    assert read_entry(TORCH_DEFAULTS, "9.0", path) == torch_entry
    assert [p.name for p in tmp_path.iterdir()] == ["tuned.json"]  # no staging file left behind
    with pytest.raises(ValueError, match="needs"):
        write_entry(TORCH_DEFAULTS, "9.0", {"plugins": []}, path)
    for bad_key in ("sm90", "9.0/SDXL", "9.0/", "9.0/sd xl"):  # a family key: a family's tuned_key
        with pytest.raises(ValueError, match="entry key"):
            write_entry(PLUGINS_AUTO, bad_key, {"plugins": []}, path)
    with pytest.raises(ValueError, match="unknown tuned-defaults section"):
        read_entry("plugins", "9.0", path)


def test_an_sdxl_model_takes_its_own_entry_and_else_the_compute_capabilitys(tmp_path):
    from demo.backends.torch.settings import defaults_entry
    from models.plugin_set import parse_plugin_set

    path = tmp_path / "tuned.json"
    write_entry(PLUGINS_AUTO, "9.0", {"plugins": ["GroupNorm"]}, path)
    # no own one
    assert find_entry(PLUGINS_AUTO, "9.0", family="sdxl", path=path) == ("9.0", {"plugins": ["GroupNorm"]})
    write_entry(PLUGINS_AUTO, entry_key("9.0", family="sdxl"), {"plugins": ["fMHA", "LayerNorm"]}, path)
    assert parse_plugin_set("auto", "9.0", path, family="sdxl") == ("LayerNorm", "fMHA")
    assert parse_plugin_set("auto", "9.0", path) == ("GroupNorm",)  # SD 1.x/2.x keep theirs
    assert parse_plugin_set("auto", "8.6", path, family="sdxl") == ()
    torch_entry = {"plugins": ["fMHA"], "channels_last": True, "cuda_graph": True, "compile": "default"}
    write_entry(TORCH_DEFAULTS, "9.0/sdxl", torch_entry, path)
    assert defaults_entry("9.0", path, family="sdxl") == ("9.0/sdxl", torch_entry)
    assert defaults_entry("9.0", path) is None


def test_the_shipped_sdxl_defaults_for_compute_capability_9_0():
    """Measured on an H200 (results/sdxl-h200/): all our kernels with channels-last, graphs and compile were the
    fastest torch path for sdxl-arch, and all plugins the fastest engines."""
    assert find_entry(TORCH_DEFAULTS, "9.0", family="sdxl")[0] == "9.0/sdxl"
    assert find_entry(PLUGINS_AUTO, "9.0", family="sdxl")[1]["plugins"] == sorted(UNET_KEYS)


BROKEN_FILES = [("{not json", "is not valid JSON"),
                 (json.dumps({"9.0": {"plugins": []}}), "expected a JSON object of sections"),  # the old flat table
                 (json.dumps({PLUGINS_AUTO: []}), "expected a JSON object of sections")]
BAD_ENTRIES = [(json.dumps({PLUGINS_AUTO: {"9.0": {"plugins": ["fMHA_V2"]}}}),
                "\"plugins_auto\" entry '9.0' needs \"plugins\""),
               (json.dumps({PLUGINS_AUTO: {"9.0": "GroupNorm"}}), "\"plugins_auto\" entry '9.0' needs")]


@pytest.mark.parametrize("text, message", BROKEN_FILES + BAD_ENTRIES)
def test_a_broken_tuned_defaults_file_is_a_usage_error_naming_it(tmp_path, text, message):
    path = tmp_path / "tuned.json"
    path.write_text(text)
    with pytest.raises(UsageError, match=re.escape(f"{path}") + ".*" + re.escape(message)):
        read_entry(PLUGINS_AUTO, "9.0", path)


@pytest.mark.parametrize("text, message", BROKEN_FILES)
def test_a_broken_tuned_defaults_file_is_not_overwritten(tmp_path, text, message):
    path = tmp_path / "tuned.json"
    path.write_text(text)
    with pytest.raises(UsageError, match=re.escape(message)):
        write_entry(PLUGINS_AUTO, "9.0", {"plugins": []}, path)
    assert path.read_text() == text


def test_contract_module_lists_what_it_defines():
    """The docstring table names every op of both conventions and every torch op."""
    doc = contract.__doc__
    for name in CONVENTIONS:
        assert all(op in doc for op in convention(name).ops.values())
    assert all(op in doc for op in TORCH_OPS.values())
