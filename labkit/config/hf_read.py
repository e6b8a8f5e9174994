"""Reading one key of a Hugging Face config.json, checked: the reader hf.py and the family readers
share (hf_moe.py imports it from here, as hf.py imports hf_moe)."""

from __future__ import annotations

_REQUIRED = object()


def _read(c: dict, key: str, kind: type, problems: list[str], default=_REQUIRED, within: str = ""):
    """c[key], checked to be a `kind` (int: a whole number; float: any number), or `default` when
    the key is absent or null; a missing required key or a value of another type is a problem
    naming the key (`within`: the dict holding it), and None comes back."""
    value = c.get(key)
    # JSON null reads as absent: transformers writes null for some defaults (GPT-2's n_inner)
    if value is None:
        if default is _REQUIRED:
            problems.append(
                f"config.json has no {within + key!r}, which this architecture needs; pass the model's config.json"
            )
        return None if default is _REQUIRED else default
    # bool is an int to Python, but true is no layer count; and 12.0 is no whole number to JSON
    whole = isinstance(value, int) and not isinstance(value, bool)
    fits = {int: whole, float: whole or isinstance(value, float), bool: isinstance(value, bool)}[kind]
    if not fits:
        problems.append(f"config.json's {within + key!r} is {value!r}, not a JSON {_KINDS[kind]}; write it as one")
        return None
    return float(value) if kind is float else value


_KINDS = {int: "whole number", float: "number", bool: "boolean (true or false)"}
