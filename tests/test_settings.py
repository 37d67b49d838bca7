"""The commands' flags (demo.cli.flags): declared once on frozen dataclasses, parsed by one function, with the
library's defaults; and turned into a PipelineSpec and a Request in one place (demo.cli.to_spec)."""

import dataclasses

import pytest

from core.errors import UsageError
from demo.backends.tensorrt.options import EngineOptions
from demo.backends.torch.options import TorchOptions
from demo.cli.flags import (
    SHARED_ENGINE_FLAGS,
    DemoFlags,
    EngineFlags,
    ImageFlags,
    LoraFlags,
    ModelFlags,
    Parser,
    RefinerFlags,
    RequestFlags,
    TorchFlags,
    add_flags,
    changed,
    flag,
    parse_flags,
    same_as,
    to_argv,
)
from demo.cli.to_spec import request_from_flags, spec_from_flags
from demo.request import DEFAULT_PROMPT, Request
from demo.runtime.spec import PipelineSpec


@dataclasses.dataclass(frozen=True)
class Extra:
    files: tuple[str, ...] = flag("input files", (), positional=True)
    onnx_dir: str = same_as(EngineFlags, "onnx_dir")
    level: int = flag("a number (default: %(default)s)", 2)


def parser(*groups, **kwargs):
    p = Parser(prog="test")
    for group in groups:
        add_flags(p, group, **kwargs.get(group.__name__, {}))
    return p


def test_every_group_parses_into_its_frozen_dataclass_with_the_declared_defaults():
    flags = parse_flags(parser(ModelFlags, RequestFlags, EngineFlags, TorchFlags), [])
    assert flags[ModelFlags] == ModelFlags() and flags[RequestFlags] == RequestFlags()
    assert flags[EngineFlags] == EngineFlags() and flags[TorchFlags] == TorchFlags()
    assert flags[RequestFlags].prompt == DEFAULT_PROMPT and flags[RequestFlags].seed is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        flags[EngineFlags].onnx_dir = "elsewhere"


def test_values_round_trip_through_to_argv():
    """What a subprocess gets (to_argv) parses back into the same settings, for every kind of field."""
    values = [
        ModelFlags(model="sd1.5-arch", verbose=True),
        RequestFlags(prompt="a cat", negative_prompt="dogs", batch_size=3, height=64, width=48, denoising_steps=7,
                     guidance_scale=1.5, scheduler="DDIM", seed=0),
        EngineFlags(onnx_dir="o", engine_dir="e", force_onnx_export=True, build_static_batch=True, optimization_level=0,
                    timing_cache="t.cache", use_cuda_graph=False, plugins="fMHA,GroupNorm",
                    plugin_convention="tensorrt", disable_tactic_sources="CUDNN", target_cc="8.6"),
        TorchFlags(channels_last=True, compile="none"),
    ]
    p = parser(*(type(v) for v in values))
    argv = [arg for value in values for arg in to_argv(value)]
    parsed = parse_flags(p, argv)
    for value in values:
        assert parsed[type(value)] == value
    extra = Extra(files=("a.json", "b"), onnx_dir="x", level=5)
    assert parse_flags(parser(Extra), to_argv(extra))[Extra] == extra


def test_changed_names_the_flags_given_other_values():
    engine = EngineFlags(onnx_dir="o", use_cuda_graph=True, plugins="all")
    assert changed(engine) == ["--onnx-dir", "--use-cuda-graph", "--plugins"]
    assert changed(engine, ignore=("plugins", "use_cuda_graph")) == ["--onnx-dir"]
    assert changed(TorchFlags()) == []


def test_commands_may_override_a_default_and_require_a_field(capsys):
    p = parser(ModelFlags, RequestFlags, ModelFlags={"model": "sd1.5-arch"}, RequestFlags={"required": ("prompt",)})
    assert parse_flags(p, ["a dog"])[ModelFlags].model == "sd1.5-arch"
    with pytest.raises(UsageError, match="prompt"):
        parse_flags(p, [])
    with pytest.raises(TypeError, match="no field"):
        add_flags(Parser(prog="x"), ModelFlags, modle="typo")


def test_same_as_declares_the_same_flag_and_bad_values_are_usage_errors():
    p = parser(Extra, Extra={"required": ("files",)})
    assert parse_flags(p, ["f"])[Extra] == Extra(files=("f",))
    with pytest.raises(UsageError, match="invalid int value"):
        parse_flags(p, ["f", "--level", "two"])
    onnx = next(a for a in p._actions if a.dest == "onnx_dir")
    assert onnx.help == dataclasses.fields(EngineFlags)[0].metadata["help"]


# Fields another group sets (the request's images come from files: ImageFlags, ControlImageFlags), or no command does
# (a request's guidance kind is resolved from the model).
SET_ELSEWHERE = {EngineOptions: {"build_missing"},
                 Request: {"image", "mask", "strength", "control_images", "control_guidance_start",
                           "control_guidance_end", "guess_mode", "guidance"}}


@pytest.mark.parametrize("group, library, shared", [
    (EngineFlags, EngineOptions, SHARED_ENGINE_FLAGS), (TorchFlags, TorchOptions, ()),
    (RequestFlags, Request, ()), (ModelFlags, PipelineSpec, ()),
])
def test_flag_groups_take_the_librarys_fields_and_defaults(group, library, shared):
    """A group of flags sets its library type's fields, with the library's defaults (the prompt aside: the library
    asks for one), so that a default is defined once and no flag silently sets nothing."""
    flags = {item.name: item.default for item in dataclasses.fields(group)}
    fields = {item.name: item.default for item in dataclasses.fields(library)}
    if library is PipelineSpec:  # a spec is set by several groups; this one sets some of its fields
        fields = {name: fields[name] for name in flags}
    spec_fields = {item.name: item.default for item in dataclasses.fields(PipelineSpec)}
    assert set(flags) == set(fields) - SET_ELSEWHERE.get(library, set()) | set(shared)
    for name, default in flags.items():
        expected = spec_fields[name] if name in shared else fields[name]
        if name != "prompt":
            assert default == expected, name


def test_a_command_line_becomes_one_spec_and_one_request(tmp_path):
    from PIL import Image

    Image.new("RGBA", (48, 64)).save(tmp_path / "image.png")
    Image.new("L", (48, 64)).save(tmp_path / "mask.png")
    p = parser(ModelFlags, RequestFlags, ImageFlags, DemoFlags, LoraFlags, RefinerFlags, EngineFlags, TorchFlags)
    flags = parse_flags(p, ["a cat", "--model", "tiny-xl", "--backend", "torch", "--lora", "a.safetensors:0.5",
                            "--lora", "b.safetensors", "--refiner", "tiny-xl-refiner", "--high-noise-frac", "0.6",
                            "--optimization-level", "1", "--plugins", "none", "--no-use-cuda-graph", "--compile",
                            "none", "--seed", "3", "--input-image", str(tmp_path / "image.png"), "--mask-image",
                            str(tmp_path / "mask.png"), "--strength", "0.5"])
    spec = spec_from_flags(flags, batch_size=2)
    assert spec == PipelineSpec(model="tiny-xl", backend="torch", plugins="none", use_cuda_graph=False,
                                engine=EngineOptions(optimization_level=1), torch=TorchOptions(compile="none"),
                                loras=(("a.safetensors", 0.5), ("b.safetensors", 1.0)), refiner="tiny-xl-refiner",
                                high_noise_frac=0.6, batch_size=2)
    request = request_from_flags(flags)
    assert request.prompt == "a cat" and request.seed == 3 and request.strength == 0.5
    assert request.image.mode == "RGB" and request.mask.size == (48, 64) and request.mode == "inpainting"
    with pytest.raises(UsageError, match="no such file"):
        request_from_flags(parse_flags(p, ["a cat", "--input-image", str(tmp_path / "none.png")]))
