"""torchtitan's Python train configs, read without running them (labkit/config/jobs/torchtitan/).

torchtitan's newer configs are Python (torchtitan/models/llama3/train_configs/llama3_8b.py at
commit da236a8b: `default_config = Trainer.Config(job=JobConfig(...), training=TrainingConfig(...),
...)`, and config_registry.py's functions each returning one). labkit parses the file with `ast`
and reads each section's keywords as literals: the keyword of Trainer.Config is the TOML's section
name, the nested call's keywords its fields, so the TOML reader reads both. Nothing is imported or
executed; a value that is code (a name, an expression) is refused by name.
"""

from __future__ import annotations

import ast

from labkit.config.choices import ConfigError


def _calls(tree: ast.Module) -> dict[str, ast.Call]:
    """Each config the module defines: `NAME = Call(...)` at the top, or a function returning one Call."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and len(node.targets) == 1:
            target = node.targets[0]
            if isinstance(target, ast.Name):
                out[target.id] = node.value
        elif isinstance(node, ast.FunctionDef):
            # a registry function builds its config and returns it: the one Call returned is the config
            returned = [n.value for n in ast.walk(node) if isinstance(n, ast.Return) and isinstance(n.value, ast.Call)]
            if len(returned) == 1:
                out[node.name] = returned[0]
    return out


def _value(node: ast.expr, where: str):
    try:
        return ast.literal_eval(node)
    except ValueError:
        raise ConfigError(
            [
                f"{where} = {ast.unparse(node)} is code, not a value: labkit reads torchtitan's Python configs "
                "without running them; write the value"
            ]
        ) from None


def load(path, config: str | None = None) -> dict:
    """The sections of the config named `config` (default: `default_config`, or the module's only
    one) as the TOML reader's dict: section -> {field: value}."""
    try:
        tree = ast.parse(path.read_text())
    except SyntaxError as e:
        raise ConfigError([f"{path.name} is not valid Python ({e.msg}, line {e.lineno})"]) from None
    calls = _calls(tree)
    name = config or ("default_config" if "default_config" in calls else next(iter(calls), None))
    if name not in calls or (config is None and len(calls) > 1 and name != "default_config"):
        raise ConfigError(
            [f"{path.name} defines configs {sorted(calls) or 'none'}; name one (config=..., --config NAME)"]
        )
    doc = {}
    for kw in calls[name].keywords:
        if kw.arg is None:  # **kwargs: what it holds is only known by running the file
            raise ConfigError([f"{path.name}: {name}(**{ast.unparse(kw.value)}) cannot be read without running it"])
        if isinstance(kw.value, ast.Call):  # a section: its own config class, fields as keywords
            doc[kw.arg] = {k.arg: _value(k.value, f"{kw.arg}.{k.arg}") for k in kw.value.keywords if k.arg}
        else:
            doc[kw.arg] = _value(kw.value, kw.arg)
    return doc
