"""Mesh arithmetic: coordinates, groups, orders (pure, no processes)."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from labkit.config import DIMS
from labkit.layout.mesh import MeshLayout

degrees = st.sampled_from([1, 2, 3, 4])
orders = st.permutations(list(DIMS)).map("-".join)


@settings(max_examples=200, deadline=None)
@given(tp=degrees, cp=degrees, ep=degrees, dp=degrees, pp=degrees, order=orders)
def test_coords_groups_are_consistent(tp, cp, ep, dp, pp, order):
    lay = MeshLayout.from_sizes(order, tp=tp, cp=cp, ep=ep, dp=dp, pp=pp)
    world = tp * cp * ep * dp * pp
    assert lay.world == world
    seen = set()
    for r in range(world):
        c = lay.coords(r)
        assert lay.rank(**c) == r  # a bijection
        seen.add(tuple(c[d] for d in DIMS))
    assert len(seen) == world
    inner = order.split("-")[0]
    if lay.size(inner) > 1:  # the innermost dim holds neighbours
        assert lay.coords(1)[inner] == 1
    for dims in [(d,) for d in DIMS] + list(itertools.combinations(DIMS, 2)):
        groups = lay.groups(*dims)
        assert sorted(r for g in groups for r in g) == list(range(world))  # a partition
        assert all(len(g) == lay.size(*dims) for g in groups)
        for g in groups:  # members differ only along `dims`
            base = lay.coords(g[0])
            for r in g:
                c = lay.coords(r)
                assert all(c[d] == base[d] for d in DIMS if d not in dims)
            assert len({tuple(lay.coords(r)[d] for d in dims) for r in g}) == len(g)


def test_megatron_order_example():
    # tp=2, dp=2, pp=2 with tp innermost and pp outermost (Megatron's default grouping)
    lay = MeshLayout.from_sizes("tp-cp-ep-dp-pp", tp=2, dp=2, pp=2)
    assert lay.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert lay.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert lay.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert lay.coords(5) == {"tp": 1, "cp": 0, "ep": 0, "dp": 0, "pp": 1}
    assert lay.groups("dp", "tp") == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_order_changes_neighbours():
    a = MeshLayout.from_sizes("tp-cp-ep-dp-pp", tp=2, dp=2)
    b = MeshLayout.from_sizes("dp-tp-cp-ep-pp", tp=2, dp=2)
    assert a.groups("tp") == [[0, 1], [2, 3]]
    assert b.groups("tp") == [[0, 2], [1, 3]]
    assert b.groups("dp") == [[0, 1], [2, 3]]


def test_label_drops_size_one_dims():
    lay = MeshLayout.from_sizes(dp=2)
    assert lay.label("dp", "ep", "cp") == "dp"
    assert MeshLayout.from_sizes(dp=2, cp=2).label("dp", "cp") == "cp-dp"


def test_spans_hosts():
    lay = MeshLayout.from_sizes(tp=2, dp=2)
    hosts = ["a", "a", "b", "b"]
    assert lay.spans_hosts(("tp",), hosts) == []
    assert lay.spans_hosts(("dp",), hosts) == [[0, 2], [1, 3]]
