"""Live figures: a plotly figure in a notebook output, redrawn in place.

Why not plotly's go.FigureWidget. It keeps a figure in two channels: a full copy
(`_widget_data`, `_widget_layout`: synced state, assigned only when the widget is displayed)
and a stream of edits (`_py2js_addTraces`, `_py2js_restyle`, ... set and reset at once), which
each view applies to its plot as it arrives. Its browser model applies those edits to a
deserialized copy of its state and throws the copy away, so the state a new view draws from is
the figure as it was when it was last displayed. A view made later — a cell scrolled into view
in JupyterLab, which renders off-screen outputs late, a widget whose 5 MB module loaded after
the edits — draws that old figure (or an empty one) and never receives the edits it missed;
and a view that receives edits while its first, asynchronous newPlot still runs can end blank.
That is why notebooks/08's second MeshView stayed an empty set of axes (it was healed by
resending the whole figure up to 90 s later, which this module used to do).

`LiveFigure` keeps one channel: the whole figure is its synced state (`_figure`, plotly's JSON,
numpy arrays as typed arrays), and every view draws that state with Plotly.react, one draw after
another (live_figure.js). A view made at any time draws the figure as it is now; a change that
comes while a view draws waits for that draw. An unchanged figure sends nothing (the state is
compared before it is sent), and react redraws only what changed.
"""

from __future__ import annotations

import collections
import pathlib
import threading

import anywidget
import numpy as np
import plotly
import plotly.graph_objects as go
import plotly.io as pio
import traitlets

_JS = pathlib.Path(__file__).with_name("live_figure.js")
_PLOTLY = pathlib.Path(plotly.__file__).parent / "package_data" / "plotly.min.js"


class PlotlyLibrary(anywidget.AnyWidget):
    """plotly.js (the copy plotly's Python package ships) for every LiveFigure of this kernel.

    A model of its own, not part of the figures' module: anywidget drops every state update of
    a model whose module takes over 2 s to load, and a module carrying these 4.6 MB did on a
    loaded machine (live_figure.js). One copy per kernel, sent once; each page evaluates it once."""

    _esm = "export default {};"
    source = traitlets.Unicode("").tag(sync=True)


_library: PlotlyLibrary | None = None


def plotly_library() -> PlotlyLibrary:
    """This kernel's PlotlyLibrary, made anew if it was closed (Widget.close_all)."""
    global _library
    # comm is None once the model was closed (Widget.close_all): figures must not point at a dead one
    if _library is None or _library.comm is None:
        _library = PlotlyLibrary(source=_PLOTLY.read_text())
    return _library


class LiveFigure(anywidget.AnyWidget):
    """A go.Figure shown in a notebook output and redrawn in place by `show(fig)`.

    `.figure` is the go.Figure shown; `.data`, `.layout` and `to_plotly_json()` read it, as on
    a go.Figure."""

    _esm = _JS.read_text()
    _figure = traitlets.Unicode("{}").tag(sync=True)
    _plotly = traitlets.Unicode("").tag(sync=True)  # the PlotlyLibrary's model id

    def __init__(self, fig: go.Figure | None = None, **layout):
        fig = fig if fig is not None else go.Figure()
        if layout:
            fig.update_layout(layout)
        # the figure goes out with the model itself: no first view ever draws an empty one
        super().__init__(_figure=pio.to_json(fig, validate=False), _plotly=plotly_library().model_id)
        self.figure = fig

    def show(self, fig: go.Figure, **layout) -> None:
        """Show `fig` (its layout updated with `layout`, e.g. a fixed height): every view of this
        widget redraws it, and a view made later draws it too."""
        if layout:
            fig.update_layout(layout)
        self.figure = fig
        # the builders made a valid figure: no second validation on every redraw
        self._figure = pio.to_json(fig, validate=False)

    @property
    def data(self):
        return self.figure.data

    @property
    def layout(self):
        return self.figure.layout

    def to_plotly_json(self) -> dict:
        return self.figure.to_plotly_json()


def same(a, b) -> bool:
    """Deep equality of plotly JSON values (dicts, lists, tuples, numpy arrays, scalars)."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        try:
            # == on arrays gives an array, not a bool
            return np.array_equal(np.asarray(a), np.asarray(b))
        except (TypeError, ValueError):
            return False
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    # the types first: 1 == 1.0 == True in Python, but not in the JSON a view receives
    return type(a) is type(b) and a == b


def refresh(fw: LiveFigure, fig: go.Figure, **layout) -> None:
    """Make `fw` show `fig` (then apply `layout` overrides, e.g. a fixed height)."""
    fw.show(fig, **layout)


def figure_widget(fig: go.Figure, **layout) -> LiveFigure:
    return LiveFigure(fig, **layout)


class UI:
    """Runs widget updates on the kernel's own thread.

    A widget's state sent from a background thread (the dashboard's worker, the explorer's comm
    computation) could interleave with the kernel's own messages about the same widget; so
    background threads hand their updates here, and they run on the kernel's IOLoop
    (`add_callback` is thread-safe), in order. Outside a kernel (scripts, tests) there is no
    browser and updates run at once, in the caller's thread. `flush()` runs what is queued;
    call it from the kernel's thread while it blocks (wait()).
    """

    def __init__(self):
        try:
            from IPython import get_ipython

            kernel = getattr(get_ipython(), "kernel", None)
        except ImportError:
            kernel = None
        self.loop = getattr(kernel, "io_loop", None)
        self.thread = threading.current_thread()
        self._jobs: collections.deque = collections.deque()
        self._lock = threading.Lock()
        self.idle = threading.Condition(self._lock)
        self.pending = 0

    @property
    def here(self) -> bool:
        return self.loop is None or threading.current_thread() is self.thread

    def call(self, fn, *args, **kwargs) -> None:
        # no kernel (scripts, tests), or already on its thread: run now, in order with everything else
        if self.here:
            fn(*args, **kwargs)
            return
        with self._lock:
            self._jobs.append((fn, args, kwargs))
            self.pending += 1
        # add_callback is the IOLoop's one method that is safe to call from another thread
        self.loop.add_callback(self.flush)

    def flush(self) -> None:
        while True:
            with self._lock:
                if not self._jobs:
                    return
                fn, args, kwargs = self._jobs.popleft()
            try:
                fn(*args, **kwargs)
            finally:
                # pending falls only once fn has run: Dashboard.wait reads it to know the figures are drawn
                with self._lock:
                    self.pending -= 1
                    self.idle.notify_all()
