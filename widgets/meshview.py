"""MeshView: debug a layout without a cluster — which rank is in which group, and which
groups cross hosts.

    MeshView(ParallelConfig(dp=4, tp=2, pp=2), ranks_per_host=8)

Pick a dim (or a combination such as dp-cp) to colour the ranks by its groups; type any
order string (innermost first) to see how it regroups the ranks. Everything is the pure
arithmetic of labkit/layout/mesh.py (MeshLayout), so it draws a 16k-rank mesh as readily as 4.
With dp_replicate > 1 (HSDP) dp's two halves, dp_shard and dp_replicate, are dims to colour by.
"""

from __future__ import annotations

import html

import ipywidgets as W

from labkit.config import DIMS, ParallelConfig
from labkit.layout.mesh import COMBINED, SUB_DIMS, MeshLayout
from labkit.widgets import figures
from labkit.widgets.live import figure_widget, refresh

# groups written out under the figure; a large mesh has thousands
GROUPS_LISTED = 32


def order_problem(order: str, dp: int = 1, dp_replicate: int = 1) -> str:
    """Why an order string (or HSDP's split of dp) is not a mesh ('' when it is)."""
    if sorted(order.split("-")) != sorted(DIMS):
        return f"order={order!r} must name each of {'-'.join(DIMS)} exactly once, innermost first"
    if dp % dp_replicate:
        return f"dp_replicate={dp_replicate} must divide dp={dp} (HSDP's replicas of equal shard groups)"
    return ""


class MeshView:
    """A mesh figure with controls: the five degrees, the order, the dim to colour by, and how
    many ranks share a host (the groups that span hosts are outlined)."""

    def __init__(self, cfg: ParallelConfig | None = None, dim: str = "dp", ranks_per_host: int | None = None):
        cfg = cfg or ParallelConfig(dp=2, tp=2, pp=2)
        box = dict(style={"description_width": "110px"}, layout=W.Layout(width="200px"))
        # up to 16,384 a degree: the figure draws a mesh that large (tests/test_widgets.py)
        self.controls = {
            d: W.BoundedIntText(value=getattr(cfg, d), min=1, max=16384, description=d, **box) for d in DIMS
        }
        # HSDP: dp read as dp_replicate x dp_shard, the two drawn as dims of their own ('colour by')
        self.controls["dp_replicate"] = W.BoundedIntText(
            value=cfg.dp_replicate, min=1, max=16384, description="dp_replicate", **box
        )
        self.controls["order"] = W.Text(
            value=cfg.order,
            description="order",
            continuous_update=False,
            style={"description_width": "110px"},
            layout=W.Layout(width="320px"),
        )
        self.controls["dim"] = W.Dropdown(
            options=list(DIMS) + list(SUB_DIMS) + ["-".join(c) for c in COMBINED],
            value=dim,
            description="colour by",
            **box,
        )
        # ranks_per_host 0: no hosts given, every rank on one machine, nothing outlined
        self.controls["ranks_per_host"] = W.BoundedIntText(
            value=ranks_per_host or 0, min=0, max=16384, description="ranks per host", **box
        )
        self.figure = figure_widget(figures.empty_figure("Mesh", ""), height=520)
        self.text = W.HTML()
        self.groups: list[list[int]] = []
        for w in self.controls.values():
            w.observe(lambda _: self.update(), names="value")
        c = self.controls
        self.widget = W.VBox(
            [
                W.HBox(
                    [
                        W.VBox([c[d] for d in DIMS]),
                        W.VBox([c[k] for k in ("dp_replicate", "order", "dim", "ranks_per_host")]),
                    ]
                ),
                self.figure,
                self.text,
            ]
        ).add_class("labkit-meshview")
        self.update()

    @property
    def layout(self) -> MeshLayout:
        c = self.controls
        return MeshLayout.from_sizes(c["order"].value, c["dp_replicate"].value, **{d: c[d].value for d in DIMS})

    def hosts(self, world: int) -> list[str] | None:
        per = self.controls["ranks_per_host"].value
        return [f"host{r // per}" for r in range(world)] if per else None

    def update(self) -> None:
        c = self.controls
        problem = order_problem(c["order"].value, c["dp"].value, c["dp_replicate"].value)
        # a half-typed order: say why and leave the last figure as it was
        if problem:
            self.text.value = f"<pre style='color:#B00020'>{html.escape(problem)}</pre>"
            return
        layout = self.layout
        dim = self.controls["dim"].value
        hosts = self.hosts(layout.world)
        per = self.controls["ranks_per_host"].value
        # devices numbered within their host, one GPU per rank
        devices = [f"gpu{r % per}" for r in range(layout.world)] if per else None
        refresh(self.figure, figures.mesh_figure(layout, dim, hosts, devices), height=520)
        self.groups = layout.groups(*dim.split("-"))
        label = layout.label(*dim.split("-"))
        listed = " ".join(str(g) for g in self.groups[:GROUPS_LISTED])
        more = f" … and {len(self.groups) - GROUPS_LISTED} more" if len(self.groups) > GROUPS_LISTED else ""
        spans = f"; {len(layout.spans_hosts(dim.split('-'), hosts))} span hosts" if hosts else ""
        self.text.value = (
            f"<b>{len(self.groups)} {html.escape(label)} group(s) of {len(self.groups[0])}"
            f"{spans}</b>: <code>{html.escape(listed)}{more}</code>"
        )

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)
