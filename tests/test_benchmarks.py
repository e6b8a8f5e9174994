"""benchmarks/run.py's pieces on the session cluster: interleaving, medians, the table and the
RESULTS.md block. Structure only (rows present, ratios finite and positive): timings on a
shared CI machine are not asserted; benchmarks/RESULTS.md holds the measured figures."""

from __future__ import annotations

import math

import pytest

from labkit import ParallelConfig as P


@pytest.fixture(scope="module")
def run(bench_script):
    return bench_script("run")


def test_interleave_calls_a_and_b_in_turn(run):
    calls = []
    got = run.interleave({"a": lambda: calls.append("a") or 1.0, "b": lambda: calls.append("b") or 2.0}, 3)
    assert calls == ["a", "b"] * 3
    assert got == {"a": [1.0] * 3, "b": [2.0] * 3}


def test_every_pair_runs_and_gives_a_finite_positive_ratio(run, lab, tiny, monkeypatch):
    monkeypatch.setattr(run, "PAIRS", {"DDP": run.PAIRS["DDP"], "TP / DTensor TP": (P(tp=2), P(tp=2, impl="torch"))})
    rows = run.ratio_rows(lab, tiny, repeats=1, steps=2)
    assert [r.name for r in rows] == ["DDP: ours / PyTorch", "TP / DTensor TP: ours / PyTorch"]
    for r in rows:
        assert math.isfinite(r.ratio) and r.ratio > 0 and r.samples == 1
        assert r.met() in ("yes", "NO")


def test_the_log_is_compared_in_back_to_back_pairs(run, lab, tiny, monkeypatch):
    monkeypatch.setattr(run, "COMM_LOG", {"collective log, DDP": P(dp=4)})
    calls = []
    real = run.step_time
    monkeypatch.setattr(run, "step_time", lambda *a, **kw: calls.append(kw.get("_comm_log", True)) or real(*a, **kw))
    (row,) = run.log_rows(lab, tiny, repeats=4, steps=2, blocks=2, ops=5)
    assert calls == [True, False, True, False, False, True, True, False, False, True]  # warm, then ABBA
    lo, hi = row.extra["range"]
    assert row.samples == 4 and 0 < lo <= row.ratio <= hi and math.isfinite(hi)
    assert "with the log" in row.note
    info = {**run.machine(), "load_after": (0.0, 0.0, 0.0), "seconds": 1.0, "repeats": 4, "steps": 2}
    assert "the median of 4 back-to-back pairs' ratios (ABBA)" in run.render([row], info)


def test_the_table_and_results_block(run, tmp_path):
    rows = [
        run.Row("cluster start", 15000.0, samples=1),
        run.Row("DDP: ours / PyTorch", 50.0, 60.0, target="<= 1.10"),
        run.Row("warm", 15000.0, 300.0, target=">= 10"),
        run.Row("dash", 1200.0, target="<= 1000 ms"),
    ]
    assert [r.met() for r in rows] == ["", "yes", "yes", "NO"]
    table = run.fmt_table(rows)
    assert table.count("\n") == len(rows) + 1 and "| DDP: ours / PyTorch | 50.0 ms | 60.0 ms | 0.83 |" in table
    info = {**run.machine(), "load_after": (0.0, 0.0, 0.0), "seconds": 1.0, "repeats": 1, "steps": 2}
    out = tmp_path / "RESULTS.md"
    out.write_text(
        "# Results\n\nprose before\n\n<!-- run.py table begin -->\nold\n<!-- run.py table end -->\n\nprose after\n"
    )
    run.write_results(str(out), rows, info)
    text = out.read_text()
    assert "prose before" in text and "prose after" in text and "\nold\n" not in text and table in text
    assert info["cpu"] in text and info["torch"] in text
