"""A frozen dataclass's fields checked against their own annotations (a PipelineSpec's, a Request's, their options').

The Python API takes keyword arguments from anyone: a value of another type is refused here, with a UsageError naming
its field, before any work, instead of failing deep inside (a "64" where a height belongs, True where a seed belongs,
2.5 steps). The annotation is the one statement of a field's type; a number is converted to the type it stands for
(a numpy integer to int, an int to float), a list to the tuple it stands for.
"""

from __future__ import annotations

import dataclasses
import numbers
import os
import types
import typing
from functools import cache

from core.errors import UsageError, field

_REFUSED = object()


@cache
def _hints(cls: type, names: tuple[tuple[str, object], ...]) -> dict:
    return typing.get_type_hints(cls, localns=dict(names))


def check_field_types(instance, names: dict[str, object] | None = None, paths: tuple[str, ...] = ()) -> None:
    """Each field of the frozen dataclass `instance` converted to its annotation's type, in place (`names`: what its
    annotations name that its module imports only for type checking; `paths`: fields of text that take a path object
    too, e.g. a pathlib.Path); a UsageError naming the first field that is not of that type: ints are whole numbers
    but not bools, floats real numbers (their range is the field's own check), tuples tuples or lists."""
    hints = _hints(type(instance), tuple(sorted((names or {}).items())))
    for item in dataclasses.fields(instance):
        value = getattr(instance, item.name)
        if item.name in paths and isinstance(value, os.PathLike):
            value = os.fspath(value)
        converted = _converted(value, hints[item.name])
        if converted is _REFUSED:
            raise UsageError(f"{field(item.name)} must be {_described(hints[item.name])}, got {_shown(value)}")
        if converted is not getattr(instance, item.name):
            object.__setattr__(instance, item.name, converted)


def _converted(value, hint):
    """`value` as `hint` says (itself where it is so already), or _REFUSED."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return next((converted for converted in (_converted(value, arg) for arg in args)
                     if converted is not _REFUSED), _REFUSED)
    if origin is tuple:
        if isinstance(value, (str, bytes)) or not isinstance(value, (tuple, list)):
            return _REFUSED
        kinds = [args[0]] * len(value) if len(args) == 2 and args[1] is Ellipsis else list(args)
        if len(kinds) != len(value):
            return _REFUSED
        items = [_converted(item, kind) for item, kind in zip(value, kinds)]
        if any(item is _REFUSED for item in items):
            return _REFUSED
        return value if isinstance(value, tuple) and all(a is b for a, b in zip(items, value)) else tuple(items)
    if hint is type(None):
        return value if value is None else _REFUSED
    if hint is bool:
        return value if isinstance(value, bool) else _REFUSED
    if isinstance(value, bool):  # Python counts a bool as an int: no number field takes one
        return _REFUSED
    if hint is int:
        return (value if type(value) is int else int(value)) if isinstance(value, numbers.Integral) else _REFUSED
    if hint is float:  # its range (finite, at least...) is the field's own check
        return (value if type(value) is float else float(value)) if isinstance(value, numbers.Real) else _REFUSED
    return value if isinstance(value, hint) else _REFUSED


def _described(hint) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_described(arg) for arg in args)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return f"a tuple (or list) of {_described(args[0])}"
        return f"({', '.join(_described(arg) for arg in args)})"
    return {type(None): "None", bool: "True or False", int: "a whole number", float: "a number",
            str: "text"}.get(hint) or f"{'an' if hint.__name__[0] in 'AEIOU' else 'a'} {hint.__name__}"


def _shown(value) -> str:
    text = repr(value)
    return f"{text[:60]}{'...' if len(text) > 60 else ''} ({type(value).__name__})"
