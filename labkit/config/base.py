"""The configs' common base: the round trip through a plain dict (the form that crosses to the engines)."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses

from labkit.config.choices import (
    ConfigError,
)

REPLACING: contextvars.ContextVar = contextvars.ContextVar("replacing", default=None)
"""(the config being replaced, the fields it changes) while _Dict.replace builds the new one: check_fields
(validation.py) then tests those fields alone, the others having passed when the old one was built."""


@contextlib.contextmanager
def replacing(old, changes: dict):
    token = REPLACING.set((old, changes))
    try:
        yield
    finally:
        REPLACING.reset(token)


_NAMES: dict[type, frozenset] = {}


def _field_names(cls) -> frozenset:
    if cls not in _NAMES:
        _NAMES[cls] = frozenset(f.name for f in dataclasses.fields(cls))
    return _NAMES[cls]


class _Dict:
    """Round-trip a dataclass through a plain dict (the form that crosses to the engines)."""

    def to_dict(self) -> dict:
        """Field -> value, nested configs as dicts. Optional fields left unset (None, or an empty
        stage_layers) stay out, so a default config is a dict of plain scalars; from_dict puts
        their defaults back: the round trip is exact."""
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is None or v == ():
                continue
            out[f.name] = v.to_dict() if isinstance(v, _Dict) else v
        return out

    @classmethod
    def from_dict(cls, d: dict):
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ConfigError([f"{cls.__name__} has no field(s) {unknown}; known: {sorted(names)}"])
        return cls(**d)

    def replace(self, **changes):
        """A copy with `changes`, checked as a new config is (__post_init__), `changes` alone tested again:
        the other fields are this one's, checked when it was built. The planner's search replaces ~30,000
        configs; dataclasses.replace rebuilt every field through __init__ (a third of its time)."""
        unknown = set(changes) - _field_names(type(self))
        if unknown:
            raise TypeError(f"{type(self).__name__} has no field(s) {sorted(unknown)}")
        new = object.__new__(type(self))
        state = {k: v for k, v in self.__dict__.items() if k != "_hash"}  # a cached hash is the old values'
        state.update(changes)
        new.__dict__.update(state)
        post = getattr(new, "__post_init__", None)
        if post is None:  # a config with nothing to check at construction (RunSpec's parts, OptimConfig's own)
            return dataclasses.replace(self, **changes)
        with replacing(self, changes):
            post()
        return new
