"""lab.verify on a plain module: correct plans pass (DDP, FSDP2, TP with SP, the user's own
collectives), and the bugs are each caught, the report's first line naming the check
and the tensor (or the uniform factor). On the session's 4-engine cluster, 2 steps each."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from verify_cases import (
    BUGS,
    Net,
    accumulate,
    batch,
    build,
    ddp,
    fsdp2,
    halved_after_backward,
    loss,
    loss_parallel_step,
    options_in,
    own_allreduce,
    plain_tp,
    summed,
    tp_sp,
)


def test_ddp_on_a_plain_module_is_right(lab):
    report = lab.verify(build, ddp, {"dp": 4}, batch, loss)
    report.assert_ok()
    assert report.summary().startswith("verify OK on dp=4")
    assert len(report.df) == 8 and set(report.df["status"]) == {"ok"}
    assert (report.df["initial error"] == 0).all() and (report.df["gradient error"] < 1e-5).all()


def test_fsdp2_and_own_collectives_are_right(lab):
    lab.verify(build, fsdp2, {"dp": 4}, batch, loss).assert_ok()
    lab.verify(build, own_allreduce, {"dp": 4}, batch, loss).assert_ok()


def test_correct_plans_pass(lab):
    """The controls of the bugs below: the same plans, written right."""
    lab.verify(build, tp_sp, {"dp": 2, "tp": 2}, batch, loss, step=loss_parallel_step).assert_ok()
    lab.verify(build, plain_tp, {"tp": 4}, batch, loss).assert_ok()
    lab.verify(build, ddp, {"dp": 4}, batch, loss, step=accumulate(True)).assert_ok()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("bug", list(BUGS))
def test_each_bug_is_caught_and_named(lab, bug, precision):
    parallelize, mesh, options, expect = BUGS[bug]
    report = lab.verify(build, parallelize, mesh, batch, loss, **options_in(precision, options))
    assert not report.ok
    expect(report)
    with pytest.raises(AssertionError, match="verify FAILED"):
        report.assert_ok()


# -- bad input: a clear error, the Lab usable after ------------------------------------------------------
def test_bad_input_is_refused_before_the_engines(lab):
    from labkit import ConfigError

    jobs = lab.jobs
    with pytest.raises(
        ConfigError, match=r"mesh=\{'dp': 2, 'tp': 3\}: dp\(2\) \* tp\(3\) = 6 ranks, but this Lab has 4"
    ):
        lab.verify(build, ddp, {"dp": 2, "tp": 3}, batch, loss)
    with pytest.raises(ConfigError, match=r"loss\(model, batch\) gave \(8, 8, 32\) at step 0; it must be a scalar"):
        lab.verify(build, ddp, {"dp": 4}, batch, lambda m, b: m(b[:, :-1]))
    calls = iter(range(100))

    def drifting():
        torch.manual_seed(next(calls))  # a different seed at every call
        return Net()

    with pytest.raises(ConfigError, match=r"build\(\) is not deterministic: two calls .* gave different weights"):
        lab.verify(drifting, ddp, {"dp": 4}, batch, loss)
    with pytest.raises(ConfigError, match="steps=0 must be a whole number >= 1"):
        lab.verify(build, ddp, {"dp": 4}, batch, loss, steps=0)
    with pytest.raises(ConfigError, match=r"data_dims: 'fsdp' is not a dim of mesh=\{'dp': 4\}"):
        lab.verify(build, ddp, {"dp": 4}, batch, loss, data_dims=("fsdp",))
    with pytest.raises(ConfigError, match=r"parallelize=None is not callable"):
        lab.verify(build, None, {"dp": 4}, batch, loss)
    assert lab.jobs == jobs  # nothing reached the engines


def test_a_build_that_depends_on_the_rank_is_refused(lab):
    from labkit import ConfigError

    def by_rank():
        rank = dist.get_rank() if dist.is_initialized() else 0
        torch.manual_seed(rank)  # the bug: each rank its own weights
        return Net()

    with pytest.raises(ConfigError, match=r"build\(\) gave rank\(s\) \[1, 2, 3\] other weights than this process"):
        lab.verify(by_rank, ddp, {"dp": 4}, batch, loss)


def test_parallelize_raising_or_hanging_on_one_rank(lab):
    from labkit import CollectiveTimeout, RankError

    def fails_on_2(model, mesh):
        if dist.get_rank() == 2:
            raise RuntimeError("rank 2's plan fails on purpose")
        return ddp(model, mesh)

    def hangs_on_1(model, mesh):
        if dist.get_rank() != 1:
            dist.all_reduce(torch.ones(1))
        return model

    with pytest.raises(RankError) as err:
        lab.verify(build, fails_on_2, {"dp": 4}, batch, loss, timeout=60)
    assert set(err.value.failures) == {2} and "rank 2's plan fails on purpose" in err.value.failures[2]["traceback"]
    with pytest.raises(CollectiveTimeout, match=r"ranks \[1\] never reached all_reduce"):
        lab.verify(build, hangs_on_1, {"dp": 4}, batch, loss, timeout=10)
    lab.verify(build, ddp, {"dp": 4}, batch, loss).assert_ok()  # the Lab repaired at the next call


def test_bf16_compute_is_held_to_the_bf16_bounds(lab):
    """FSDP2 computing in bf16 against the fp32 reference: inside bf16's bounds, outside fp32's."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    def bf16(model, mesh):
        return fully_shard(model, mesh=mesh["dp"], mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))

    lab.verify(build, bf16, {"dp": 4}, batch, loss, precision="bf16").assert_ok()
    report = lab.verify(build, bf16, {"dp": 4}, batch, loss)
    assert report.first().check == "gradients" and report.factor is None, report.summary()


def test_bf16_bounds_count_the_parallelized_graphs_roundings_and_catch_a_halved_gradient(lab):
    """bf16's bound of each tensor counts the roundings the ranks' own step makes (engines/verify.py), not
    every op of build(): a gradient halved after backward is over it, in bf16 as in fp32, and named."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    def bf16(model, mesh):
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        return fully_shard(model, mesh=mesh["dp"], mp_policy=policy)

    ok = lab.verify(build, bf16, {"dp": 4}, batch, loss, precision="bf16")
    ok.assert_ok()
    worst = max(ok.bounds.grad(n) for n in dict(build().named_parameters()))
    assert worst < 0.5, f"the bf16 bound ({worst:.3g}) would hold a halved gradient"
    for precision, parallelize in (("bf16", bf16), ("fp32", fsdp2)):
        report = lab.verify(build, parallelize, {"dp": 4}, batch, loss, step=halved_after_backward, precision=precision)
        assert not report.ok and report.factor == pytest.approx(0.5, rel=0.02), (precision, report.summary())


def test_the_report_shows_as_a_card_and_a_table(lab):
    report = lab.verify(build, summed, {"dp": 4}, batch, loss, steps=1)
    html = report._repr_html_()
    assert "verify: FAILED" in html and "4 x the reference" in html and "<table" in html
    assert list(report.df.columns) == [
        "tensor",
        "shape",
        "initial error",
        "gradient error",
        "gradient bound",
        "final error",
        "status",
    ]
    assert set(report.df["status"]) == {"gradients"} and len(report.losses) == 1
    assert report.losses.df["run"][0] == pytest.approx(report.losses.df["reference"][0], rel=1e-5)


def test_the_dashboard_shows_a_verdict_beside_a_measurement(lab):
    from labkit.widgets import Dashboard

    def measured():  # the same plan, trained as a script would, under lab.measure
        from torch.distributed.device_mesh import init_device_mesh

        import labkit

        torch.manual_seed(0)
        model = ddp(build(), init_device_mesh("cpu", (4,), mesh_dim_names=("dp",)))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        labkit.track(model, opt)
        for s in range(2):
            loss(model, batch(s)[2 * dist.get_rank() : 2 * dist.get_rank() + 2]).backward()
            opt.step()
            opt.zero_grad()

    report = lab.verify(build, ddp, {"dp": 4}, batch, loss)
    dash = Dashboard(lab, run=False)
    try:
        dash.show(lab.measure(measured), verified=report)
        assert "verify OK on dp=4" in dash.status.value and "verify: OK" in dash.error_box.value
        assert any(t.name.startswith("all_reduce") for t in dash.figures["comm"].data)
    finally:
        dash.close()
