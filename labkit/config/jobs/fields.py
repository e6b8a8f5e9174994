"""What the readers share: a section of a file whose fields are taken one by one, so that the ones
never taken come back as notes by name (a reader cannot forget a field silently)."""

from __future__ import annotations

from labkit.config.choices import ConfigError


class Fields:
    """The fields of one section (`where`: how the file names it, e.g. '[parallelism]'), read with
    `take`; `rest()` names every field not taken, with its value, for Job.notes."""

    def __init__(self, data: dict, where: str):
        if not isinstance(data, dict):
            raise ConfigError([f"{where} is a {type(data).__name__}, not a table of fields; write it as one"])
        self.data, self.where, self.taken = data, where, set()

    def name(self, key: str) -> str:
        return f"{self.where} {key}" if self.where else key

    def has(self, key: str) -> bool:
        return key in self.data

    def take(self, key: str, kind, default=None):
        """data[key] as a `kind` (int, float, bool, str, list), or `default` when absent; a value of
        another type is a ConfigError naming the field and its value."""
        self.taken.add(key)
        if key not in self.data:
            return default
        v = self.data[key]
        whole = isinstance(v, int) and not isinstance(v, bool)
        fits = {int: whole, float: whole or isinstance(v, float), bool: isinstance(v, bool)}.get(kind)
        if fits is None:
            fits = isinstance(v, kind)
        if not fits:
            names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
            raise ConfigError([f"{self.name(key)} = {v!r} is not a {names}; write it as one"])
        return float(v) if kind is float else v

    def skip(self, *keys: str) -> None:
        """Fields read elsewhere or meaningless to a layout, taken without a note."""
        self.taken.update(keys)

    def rest(self, why: str) -> list[str]:
        """'where key = value: why' for each field never taken."""
        return [f"{self.name(k)} = {self.data[k]!r}: {why}" for k in self.data if k not in self.taken]
