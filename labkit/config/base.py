"""The configs' common base: the round trip through a plain dict (the form that crosses to the engines)."""

from __future__ import annotations

import dataclasses

from labkit.config.choices import (
    ConfigError,
)


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
        return dataclasses.replace(self, **changes)
