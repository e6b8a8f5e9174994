"""labkit's figure style, shared by every pure figure builder of widgets/: colours per category, op,
microbatch, mesh dim, rank and cp kind, and a plotly layout that skips the default template and
carries its own paper and ink, so a figure reads the same in JupyterLab's light and dark themes."""

from __future__ import annotations

import colorsys

import plotly.graph_objects as go

CATEGORIES = ("params", "grads", "optimizer", "activations")
CATEGORY_COLORS = {"params": "#4C78A8", "grads": "#F58518", "optimizer": "#54A24B", "activations": "#E45756"}
OP_COLORS = {
    "all_reduce": "#1F4E79",
    "all_gather": "#0E7C7B",
    "reduce_scatter": "#B35806",
    "all_to_all": "#6A3D9A",
    "send": "#1B7837",
    "recv": "#5D6D7E",
    "broadcast": "#B8860B",
    "reduce": "#C51B7D",
    "scatter": "#8C510A",
    "gather": "#35978F",
    "barrier": "#4D4D4D",
}
"""Dark, saturated: communication never shares a colour with a microbatch (light, Tableau 10)."""
MICROBATCH_COLORS = [
    "#4C78A8",
    "#F58518",
    "#54A24B",
    "#E45756",
    "#72B7B2",
    "#EECA3B",
    "#B279A2",
    "#FF9DA6",
    "#9D755D",
    "#BAB0AC",
]
KIND_PATTERNS = {"F": "", "B": "/", "W": "x"}
"""Forward solid, backward hatched, weight-gradient cross-hatched: F/B/W told apart in one colour."""
KIND_COLORS = {"sync": "#8E8E8E", "opt": "#7B4F2C", "send": "#2E8B57", "recv": "#708090"}
"""Spans outside any microbatch: waiting for the gradient reduction, the optimizer step, ...;
a user's own regions (lab.measure) start from REGION_COLOR."""
REGION_COLOR = "#9E9AC8"
DIM_COLORS = {
    "dp": "#0072B2",
    "dp_shard": "#56B4E9",
    "dp_replicate": "#003F63",
    "tp": "#E69F00",
    "pp": "#009E73",
    "cp": "#CC79A7",
    "ep": "#D55E00",
    "world": "#4D4D4D",
}
"""One colour per mesh dim in every figure that tells dims apart (Okabe and Ito's colour-blind-safe
set; HSDP's two halves of dp in dp's blue, lighter inside a node and darker across)."""
CP_KIND_COLORS = {"ring": "#CC79A7", "allgather": "#7F7F7F", "ulysses": "#0072B2", "hierarchical": "#D55E00"}
"""The context-parallel kinds (ParallelConfig.cp_kind): the ring in cp's own colour."""


def dim_color(name: str) -> str:
    """The colour of a comm dim as reports name it: a mesh dim ('tp'), a combined one ('dp-cp', in a
    shade of its first dim's colour) or a part of one ('cp ring', 'cp all-to-all': cp's)."""
    first = name.split()[0]
    parts = first.split("-")
    base = DIM_COLORS.get(parts[0], DIM_COLORS["world"])
    return base if len(parts) == 1 else shade(base, len(parts))


def rank_color(rank: int) -> str:
    """One colour per rank, the same in every figure: the microbatch palette's ten, then their shades."""
    return shade(MICROBATCH_COLORS[rank % len(MICROBATCH_COLORS)], rank // len(MICROBATCH_COLORS))


def shade(color: str, k: int) -> str:
    """The k-th variant of a colour (k = 0: the colour itself): k = 1..6 alternately lighter and
    darker, by 30%, 60% and 90% towards white or black; from k = 7 on, its hue turned by 47°
    steps (coprime to 360: 360 different hues before one comes back)."""
    color = color.upper()
    rgb = [int(color[i : i + 2], 16) / 255 for i in (1, 3, 5)]
    if k == 0:
        return color
    if k <= 6:
        t, target = 0.3 * ((k + 1) // 2), 1.0 if k % 2 else 0.0
        out = [c + (target - c) * t for c in rgb]
    else:
        h, light, sat = colorsys.rgb_to_hls(*rgb)
        out = colorsys.hls_to_rgb((h + (k - 6) * 47 / 360) % 1.0, light, sat)
    return "#" + "".join(f"{round(255 * c):02X}" for c in out)


class Palette:
    """The colours of one figure's series: each gets its preferred colour, or, when another
    series of the figure has it already (all_reduce on dp and on tp; the eleventh microbatch),
    the first shade of it no series has: no two series of a figure share a colour."""

    def __init__(self):
        self.of: dict[str, str] = {}

    def __call__(self, name: str, preferred: str) -> str:
        if name not in self.of:
            taken, k = set(self.of.values()), 0
            while shade(preferred, k) in taken and k < 400:  # past 366 shades, one repeats
                k += 1
            self.of[name] = shade(preferred, k)
        return self.of[name]


KIB = 1024


PAPER = "#FFFFFF"
"""The figures' own background, opaque: under JupyterLab's dark theme a transparent one would show the
page's near-black behind dark text (plotly's renderer switches only figures without a template)."""
INK = "#2A2A2A"
"""Text and axis lines: 14.4:1 against PAPER (WCAG 2.1 asks 7:1 of small text, level AAA)."""
GRID = "#EBF0F8"
STYLE = dict(
    template="none",
    paper_bgcolor=PAPER,
    plot_bgcolor=PAPER,
    font=dict(family="sans-serif", size=12, color=INK),
    xaxis=dict(gridcolor=GRID, zerolinecolor=GRID, automargin=True),
    yaxis=dict(gridcolor=GRID, zerolinecolor=GRID, automargin=True),
    hoverlabel=dict(align="left"),
)
"""plotly_white's look without its template: a template is copied and validated into every
figure, which costs more than drawing the figure (the dashboard redraws six per change)."""


BASE = dict(STYLE, margin=dict(l=60, r=20, t=60, b=50), legend=dict(orientation="h", y=-0.25))


def _figure(data=None) -> go.Figure:
    """A new figure in labkit's style. Passing the style to the constructor skips plotly's
    default template (copied and validated on every go.Figure(): most of a small figure's cost)."""
    return go.Figure(data=data, layout=BASE)


def _layout(fig: go.Figure, title: str, **kw) -> go.Figure:
    """Title and the figure's own layout settings (and labkit's style, for a figure made elsewhere)."""
    if fig.layout.paper_bgcolor != PAPER:
        fig.update_layout(BASE)
    fig.update_layout(title=title, **kw)
    return fig


def _level(fig: go.Figure, y: float, text: str, color: str = INK) -> None:
    """A dashed horizontal line across the plot with a label: add_hline's look, a fraction of its cost."""
    fig.add_shape(type="line", xref="paper", x0=0, x1=1, y0=y, y1=y, line=dict(dash="dash", color=color))
    fig.add_annotation(
        text=text,
        xref="paper",
        x=0,
        y=y,
        xanchor="left",
        yanchor="bottom",
        showarrow=False,
        font=dict(color=color, size=11),
    )
