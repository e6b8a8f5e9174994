"""Parameter metadata is one typed record per parameter (engines/parallel/common.py `ParamMeta`), kept
in the run's `ParamMetas`, never attributes stuck on tensors (or on any object from outside it) and
read back with getattr and a default, where a misspelt name reads the default."""

from __future__ import annotations

import ast
import gc
import pathlib

import pytest
import torch

from labkit.engines.parallel.common import ParamMeta, ParamMetas, norm_terms
from labkit.layout.mesh import DATA_DIMS, MeshLayout

ROOT = pathlib.Path(__file__).resolve().parents[1]
PREFIX = "_lk_"


def stuck_attributes(source: str) -> list[int]:
    """Lines that set, read or test an attribute named `_lk_...` (x._lk_y, getattr(x, "_lk_y"), ...)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr.startswith(PREFIX):
            lines.append(node.lineno)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
            and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant)
            and str(node.args[1].value).startswith(PREFIX)
        ):
            lines.append(node.lineno)
    return lines


def test_no_metadata_is_stuck_on_objects():
    found = {
        f"{path.relative_to(ROOT)}:{line}"
        for folder in ("engines", "labkit")
        for path in sorted((ROOT / folder).rglob("*.py"))
        for line in stuck_attributes(path.read_text())
    }
    assert found == set(), "keep what a strategy says of a parameter in its ParamMeta (engines/parallel/common.py)"


def test_the_check_catches_what_it_should():
    assert stuck_attributes("p._lk_reduce = ('dp',)") == [1]
    assert stuck_attributes("x = getattr(p, '_lk_box', None)") == [1]
    assert stuck_attributes("if hasattr(p, '_lk_name'):\n    pass") == [1]
    assert stuck_attributes("_lk_layout = 3\nprint(_lk_layout)") == []  # a name in a namespace is no attribute


def test_a_misspelt_field_is_an_error_not_a_default():
    meta = ParamMeta()
    with pytest.raises(AttributeError):
        meta.replica = ("tp",)  # misspelt: replicas
    with pytest.raises(AttributeError):
        _ = meta.reduce_dims
    assert (meta.reduce, meta.replicas, meta.tp_share, meta.chunk, meta.tied) == (DATA_DIMS, (), 1, 0, False)
    assert meta.full_name("blocks.0.attn.wq.weight") == "blocks.0.attn.wq.weight"
    assert ParamMeta(name="blocks.3.ln1.weight").full_name("blocks.0.ln1.weight") == "blocks.3.ln1.weight"


def test_records_follow_each_parameter_and_leave_with_it():
    metas = ParamMetas()
    a, b = (torch.nn.Parameter(torch.zeros(4, 4)) for _ in range(2))  # equal values, different parameters
    metas[a].replicas += ("tp",)
    metas[a].tied = True
    assert metas[a] is metas[a] and metas[a].replicas == ("tp",)
    assert metas[b] == ParamMeta()
    del a
    gc.collect()
    fresh = [torch.nn.Parameter(torch.zeros(4, 4)) for _ in range(64)]  # some may reuse a's address
    assert not any(metas[p].tied for p in fresh)


class _Mesh:
    """What norm_terms reads of a Mesh: sizes and this rank's coordinates (no process group)."""

    def __init__(self, rank: int, **sizes):
        self.layout = MeshLayout.from_sizes(**sizes)
        self.coords = self.layout.coords(rank)

    def size(self, *dims: str) -> int:
        return self.layout.size(*dims)

    def group(self, *dims: str) -> str:
        return "-".join(dims)


def test_the_norm_counts_each_replica_once_from_the_records():
    """tp=4 over 2 KV heads: each head on 2 consecutive tp ranks, counted on the first; a LayerNorm
    replicated over tp counted on tp rank 0 only; an ordinary slice everywhere."""
    records = [ParamMeta(tp_share=2), ParamMeta(replicas=("tp",)), ParamMeta()]
    counted = {r: norm_terms(records, _Mesh(r, tp=4))[1] for r in range(4)}
    assert counted == {
        0: [True, True, True],
        1: [False, False, True],
        2: [True, False, True],
        3: [False, False, True],
    }
    assert norm_terms(records, _Mesh(0, tp=4))[0] == "tp"
