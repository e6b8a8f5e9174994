"""A config's field values against the types their annotations declare: `int`, `float`, `bool`,
`str`, `X | None`, `tuple[int, ...]`, a nested config, and a `Literal`'s values (a choice,
labkit/config/choices.py). validation.py asks it first when a config is built. Plain Python, the
bottom rung of the ladder.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable
from typing import Literal

from labkit.config.choices import unknown


def _describe(hint) -> str:
    """What a value of type `hint` is, in words."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_describe(h) for h in typing.get_args(hint))
    if typing.get_origin(hint) is tuple:
        return "a tuple of whole numbers (int)"
    words = {int: "a whole number (int)", float: "a finite number", bool: "True or False", str: "a string"}
    return words.get(hint, "None" if hint is type(None) else f"a {getattr(hint, '__name__', hint)}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _test(hint) -> Callable[[object], bool]:
    """Whether a value is of type `hint`, as a function built once per field: a bool is not taken
    for an int, nor a NaN for a number, nor 1 for True among a Literal's values."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        allowed = {(type(a), a) for a in args}
        return lambda v: isinstance(v, (str, bool)) and (type(v), v) in allowed
    if origin in (typing.Union, types.UnionType):
        tests = [_test(h) for h in args]
        return lambda v: any(t(v) for t in tests)
    if origin is tuple:
        item = _test(args[0])
        return lambda v: isinstance(v, tuple) and all(item(x) for x in v)
    if hint is type(None):
        return lambda v: v is None
    return {int: _is_int, float: _is_number}.get(hint, lambda v: isinstance(v, hint))


_FIELDS: dict[type, list] = {}


def field_tests(cls) -> list:
    """(field, its resolved type, the test of a value) of a config class, resolved once."""
    if cls not in _FIELDS:
        hints = typing.get_type_hints(cls)
        _FIELDS[cls] = [(f, hints[f.name], _test(hints[f.name])) for f in dataclasses.fields(cls)]
    return _FIELDS[cls]


def typed_fields(obj):
    """(name, value, the problem of its type or "") of each of `obj`'s fields; a Literal's problem
    names its values."""
    for f, hint, fits in field_tests(type(obj)):
        v = getattr(obj, f.name)
        if fits(v):
            yield f.name, v, ""
        elif typing.get_origin(hint) is Literal:
            yield f.name, v, unknown(f.name, v, typing.get_args(hint))
        else:
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            yield (
                f.name,
                v,
                f"{type(obj).__name__}.{f.name}={v!r} must be {_describe(hint)}; the default is {default!r}",
            )


def type_problems(obj) -> list[str]:
    """Fields whose value is not of the type the dataclass declares."""
    return [problem for _, _, problem in typed_fields(obj) if problem]
