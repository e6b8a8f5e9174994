"""Functions shipped to the engines: pickled by value when the engines cannot import their module.

A notebook's functions, a script's or a test module's live where the engines cannot import them;
cloudpickle sends those by value. Functions of installed packages (labkit, torch, transformers)
travel by name and are imported on the engine.
"""

from __future__ import annotations

import sys

import cloudpickle


def register(fn) -> None:
    """Have cloudpickle send fn's module by value when the engines cannot import it by name."""
    mod = sys.modules.get(getattr(fn, "__module__", "") or "")
    path = getattr(mod, "__file__", None) or ""
    # an installed module the engines import by name; a notebook's, a script's or a test's they cannot
    installed = "site-packages" in path or "dist-packages" in path or path.startswith(sys.base_prefix)
    # __main__'s functions cloudpickle sends by value already; labkit is installed beside the engines
    if mod is not None and mod.__name__ != "__main__" and not installed and not mod.__name__.startswith("labkit"):
        cloudpickle.register_pickle_by_value(mod)


def by_value(obj) -> bytes:
    """Pickle a function, or a dict of them (None allowed), so that an engine can run them."""
    for fn in obj.values() if isinstance(obj, dict) else (obj,):
        if fn is not None:
            register(fn)
    return cloudpickle.dumps(obj)
