"""lab.activate(): %%px cells on the Lab's engines, with rank, world_size, mesh, torch and dist defined."""

from __future__ import annotations

import pytest

from labkit import ParallelConfig


def test_px_cells_run_collectives_on_every_rank(lab):
    view = lab.activate(ParallelConfig(dp=2, tp=2))
    view.execute(
        "t = torch.tensor([float(rank + 1)]); dist.all_reduce(t)\n"
        "g = torch.tensor([float(rank + 1)]); dist.all_reduce(g, group=mesh.group('tp'))\n"
        "got = (rank, world_size, t.item(), g.item(), mesh.ranks('tp'), mesh.coords)",
        block=True,
    )
    got = view.pull("got", block=True)
    world = lab.world
    assert [g[0] for g in got] == list(range(world)) and {g[1] for g in got} == {world}
    assert [g[2] for g in got] == [world * (world + 1) / 2] * world  # 1 + 2 + ... + world
    for rank, _, _, tp_sum, tp_ranks, coords in got:
        assert tp_sum == sum(r + 1 for r in tp_ranks) and rank in tp_ranks and len(tp_ranks) == 2
        assert coords == {"tp": rank % 2, "cp": 0, "ep": 0, "dp": rank // 2, "pp": 0}


def test_the_px_magic_itself(lab):
    """Through IPython's own magic machinery, as a notebook cell would run it."""
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.utils.capture import capture_output

    shell = InteractiveShell.instance()
    lab.activate()  # the last layout (or dp over every engine)
    with capture_output() as out:
        shell.run_cell(
            "%%px -e\nt = torch.ones(2) * rank; dist.all_reduce(t); print('sum', t.tolist())", store_history=False
        )
    total = float(sum(range(lab.world)))
    assert out.stdout.count(f"sum [{total}, {total}]") == lab.world, out.stdout
    shown = [out.stdout.index(f"[stdout:{e}]") for e in lab.engines.ids]  # grouped per engine, in rank order
    assert shown == sorted(shown), out.stdout
    assert shell.find_cell_magic("px") is not None


def test_activate_refuses_a_layout_larger_than_the_lab(lab):
    from labkit import ConfigError

    with pytest.raises(ConfigError):
        lab.activate(ParallelConfig(dp=lab.world * 2))
