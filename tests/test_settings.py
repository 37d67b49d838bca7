"""Typed settings (demo.settings): flags declared once on frozen dataclasses, parsed by one function."""

import dataclasses

import pytest

from core.errors import UsageError
from demo.arguments import Parser
from demo.settings import (
    DEFAULT_PROMPT,
    EngineFlags,
    ModelFlags,
    RequestFlags,
    TorchFlags,
    add_flags,
    changed,
    flag,
    parse_flags,
    same_as,
    to_argv,
)


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
