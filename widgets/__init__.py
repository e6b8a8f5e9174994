"""labkit.widgets: figures (pure builders) and the notebook widgets that drive them.

    from labkit.widgets import Dashboard, MeshView, ScaleExplorer, figures

Everything here runs in the notebook kernel; nothing imports torch.distributed. The widgets
are imported on first use, so `labkit.widgets.figures` stays light for the CLI's report.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "Dashboard": "labkit.widgets.dashboard",
    "MeshView": "labkit.widgets.meshview",
    "ScaleExplorer": "labkit.widgets.scale",
}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'labkit.widgets' has no attribute {name!r}")


__all__ = ["Dashboard", "MeshView", "ScaleExplorer", "figures"]
