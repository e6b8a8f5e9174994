"""Reading a Hugging Face config.json's keys, checked: the reader hf/__init__.py and the family readers
share (moe.py and gpt_oss.py import it from here, as __init__.py and families.py import them), and the
YaRN fields that DeepSeek-V3's and GPT-OSS's readers both take."""

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


def yarn_fields(rp: dict, problems: list[str]) -> dict:
    """YarnRope's fields from a config's rope_parameters / rope_scaling of type 'yarn' (transformers'
    _compute_yarn_parameters defaults); without an mscale pair transformers gains cos/sin by mscale(factor)
    and leaves the softmax unscaled (labkit/config/latent.py yarn_gain)."""
    w = "rope_scaling."
    return {
        "factor": _read(rp, "factor", float, problems, within=w),
        "original_max_position": _read(rp, "original_max_position_embeddings", int, problems, within=w),
        "beta_fast": _read(rp, "beta_fast", float, problems, 32.0, w),
        "beta_slow": _read(rp, "beta_slow", float, problems, 1.0, w),
        "mscale": _read(rp, "mscale", float, problems, 0.0, w),
        "mscale_all_dim": _read(rp, "mscale_all_dim", float, problems, 0.0, w),
    }
