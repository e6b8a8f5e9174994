"""lab.measure on real code, on the session's 4-engine cluster: PyTorch DDP on a plain module, a
Hugging Face model under FSDP2, a DTensor TP plan, and a function with its own collectives.

Every byte is checked against what the algorithm must move (the ring model: all-reduce
2(n-1)/n·B, all-gather and reduce-scatter (n-1)/n·B), computed here from the model's parameter
shapes, never read back from the meter; model states against the tensors' bytes by formula.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import labkit
from labkit import CollectiveTimeout, Measurement, RankError
from labkit.layout.wire import WIRE

N = 4
HF = dict(
    vocab_size=130,  # 130 rows do not split in 4: FSDP2 pads the embedding and the head to 132
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=32,
)


def ring(op: str, payload: float, n: int = N) -> float:
    return WIRE[op](payload, n)


def sent(m: Measurement, rank: int, op: str, step: int = -1) -> float:
    return sum(r["wire_bytes"] for r in m.comm_table(step) if r["rank"] == rank and r["op"] == op)


def adam_bytes(shapes) -> int:
    """AdamW's state: exp_avg and exp_avg_sq like each parameter (fp32), and a 4-byte step counter each."""
    return sum(8 * _numel(s) + 4 for s in shapes)


def _numel(shape) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


# -- 1. a plain nn.Module under PyTorch's DDP ------------------------------------------------------
def ddp_training(steps: int = 3):
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
    ddp = DDP(model, bucket_cap_mb=0.002)  # ~2 KB buckets: several all-reduces per step
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    labkit.track(ddp, opt)
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(steps):
        x = torch.randn(8, 16, generator=g)
        with labkit.region("loss"):
            loss = ddp(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [tuple(p.shape) for p in model.parameters()]


@pytest.fixture(scope="module")
def ddp(lab) -> Measurement:
    return lab.measure(ddp_training)


def test_ddp_bytes_follow_the_ring_model(ddp):
    m = ddp
    shapes = m.values[0]
    psi = sum(_numel(s) for s in shapes)
    assert m.steps == 3 and len(m.ranks) == N
    for rk in m.ranks:
        assert sent(m, rk.rank, "all_reduce") == ring("all_reduce", 4 * psi)  # every gradient, once
        assert {r["op"] for r in m.comm_table() if r["rank"] == rk.rank} == {"all_reduce"}
        assert next(r for r in m.comm_table() if r["rank"] == rk.rank)["calls"] > 1  # several buckets
        last = [e for e in rk.comm if e.step == 2]
        assert {e.phase for e in last} == {"backward"} and {e.dim for e in last} == {"world"}
        assert {e.phase for e in rk.comm if e.step == -1} == {"setup"}  # DDP's initial broadcast
        assert rk.memory["params"] == rk.memory["grads"] == 4 * psi
        assert rk.memory["optimizer"] == adam_bytes(shapes)
        assert rk.memory["activations"] > 0
        kinds = [(e.kind, e.microbatch) for e in rk.timeline if e.step == 2]
        assert kinds == [("loss", None), ("F", 0), ("B", 0), ("opt", None)] or kinds == [
            ("F", 0),
            ("loss", None),
            ("B", 0),
            ("opt", None),
        ], kinds
        f, b = (next(e for e in rk.timeline if e.step == 2 and e.kind == k) for k in ("F", "B"))
        reduces = [e for e in last if e.op == "all_reduce"]
        assert f.end <= b.start and all(b.start <= e.start <= b.end for e in reduces)


def test_the_figures_and_the_dashboard_take_a_measurement(lab, ddp):
    from labkit.widgets import Dashboard
    from labkit.widgets.figures import report_figures

    figs = report_figures(ddp)
    assert set(figs) == {"memory", "comm", "timeline", "traffic"}
    dash = Dashboard(lab, run=False)
    try:
        dash.show(ddp)
        comm = next(t for t in dash.figures["comm"].data if t.name == "all_reduce [world]")
        assert list(comm.y) == [sent(ddp, r, "all_reduce") / 1024 for r in range(N)]
        assert {"mb 0", "loss", "opt", "all_reduce [world]"} <= {t.name for t in dash.figures["timeline"].data}
        params = next(t for t in dash.figures["memory"].data if t.name == "params")
        assert list(params.y) == [rk.memory["params"] / 1024 for rk in ddp.ranks]
    finally:
        dash.close()
    html = ddp._repr_html_()
    assert "Measurement" in html and "all_reduce" in html and "<table" in html
    assert list(ddp.comm_table().df.columns) == ["rank", "dim", "op", "calls", "payload_bytes", "wire_bytes"]


# -- 2. a Hugging Face model under FSDP2 ---------------------------------------------------------
def hf_fsdp2(config: dict, steps: int = 2):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**config))  # from the config: no weights, no network
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    units = [[n for n in shapes if n.startswith(f"model.layers.{i}.")] for i in range(config["num_hidden_layers"])]
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    labkit.track(model, opt, mesh)
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(steps):
        tokens = torch.randint(0, config["vocab_size"], (2, 16), generator=g)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    return shapes, units


def test_fsdp2_on_a_hugging_face_model_moves_what_it_must(lab):
    pytest.importorskip("transformers")
    m = lab.measure(hf_fsdp2, HF)
    shapes, units = m.values[0]
    root = [n for n in shapes if not any(n in u for u in units)]

    def padded(names) -> int:
        """FSDP2 shards each parameter on dim 0 in chunks of ceil(d0 / N) rows, padded: the
        flat all-gather of a unit holds N chunks of every parameter (fp32, 4 bytes)."""
        return sum(-(-shapes[n][0] // N) * N * _numel(shapes[n][1:]) * 4 for n in names)

    layers = sum(padded(u) for u in units)
    # forward gathers every unit; backward gathers the layers again (resharded after forward),
    # not the root: fully_shard's default reshard_after_forward=None keeps the root unsharded
    # for the backward that follows at once (torch's _fsdp_state.py, "For the root, do not reshard")
    gathered = 2 * layers + padded(root)
    for rk in m.ranks:
        assert sent(m, rk.rank, "all_gather") == ring("all_gather", gathered)
        assert sent(m, rk.rank, "reduce_scatter") == ring("reduce_scatter", layers + padded(root))
        rows = m.comm_table()
        assert {r["dim"] for r in rows} == {"dp"} and {r["op"] for r in rows} == {"all_gather", "reduce_scatter"}
        phases = {(e.op, e.phase) for e in rk.comm if e.step == 1}
        assert phases == {("all_gather", "forward"), ("all_gather", "backward"), ("reduce_scatter", "backward")}
        assert rk.coords == {"dp": rk.rank}
        # model states: every rank stores padded chunks of parameters and gradients; Adam's
        # moments only for the rows it holds
        chunk = sum(-(-s[0] // N) * _numel(s[1:]) for s in shapes.values())
        held = [(max(0, min(-(-s[0] // N), s[0] - rk.rank * -(-s[0] // N))), *s[1:]) for s in shapes.values()]
        assert rk.memory["params"] == rk.memory["grads"] == 4 * chunk
        assert rk.memory["optimizer"] == adam_bytes(held)


# -- 3. a tensor-parallel plan through parallelize_module -----------------------------------------
class Block(nn.Module):
    def __init__(self, h: int = 16, f: int = 64):
        super().__init__()
        self.inp = nn.Linear(h, h)  # replicated: its output needs the gradient TP all-reduces back
        self.fc1 = nn.Linear(h, f)
        self.fc2 = nn.Linear(f, h)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(self.inp(x))))


def tp_training(steps: int = 2):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    model = parallelize_module(Block(), mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    labkit.track(model, opt, mesh)
    g = torch.Generator().manual_seed(0)  # TP: every rank sees the same batch
    for _ in range(steps):
        loss = model(torch.randn(4, 8, 16, generator=g)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    return [tuple(p.to_local().shape if hasattr(p, "to_local") else p.shape) for p in model.parameters()]


def test_a_tp_plan_all_reduces_forward_and_backward(lab):
    m = lab.measure(tp_training)
    local = m.values[0]
    B = 4 * 8 * 16 * 4  # the (4, 8, 16) fp32 activation
    h, f = 16, 64
    for rk in m.ranks:
        ops = [(e.op, e.phase, e.payload_bytes, e.dim) for e in rk.comm if e.step == 1]
        # g: RowwiseParallel's output all-reduced in forward; f: ColwiseParallel's input
        # gradient all-reduced in backward (Megatron's f and g)
        assert sorted(ops) == [("all_reduce", "backward", B, "tp"), ("all_reduce", "forward", B, "tp")]
        assert sent(m, rk.rank, "all_reduce") == 2 * ring("all_reduce", B)
        psi_local = (h * h + h) + (f // N * h + f // N) + (h * f // N + h)
        assert sum(_numel(s) for s in local) == psi_local
        assert rk.memory["params"] == rk.memory["grads"] == 4 * psi_local
        assert rk.memory["optimizer"] == adam_bytes(local)


# -- 4. the user's own collectives ----------------------------------------------------------------
def own_collectives():
    rank = dist.get_rank()
    pairs = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    mine = pairs[rank % 2]
    with labkit.region("exchange"):
        t = torch.ones(256)
        dist.all_reduce(t)  # world: 1 KiB
        out = torch.empty(2 * 64)
        dist.all_gather_into_tensor(out, torch.full((64,), float(rank)), group=mine)
        piece = torch.empty(32)
        dist.reduce_scatter_tensor(piece, torch.ones(64), group=mine)
    return float(t[0]), out[::64].tolist(), float(piece[0])


def test_own_collectives_are_named_by_their_groups(lab):
    m = lab.measure(own_collectives)
    assert m.values[0] == (4.0, [0.0, 2.0], 2.0) and m.values[1] == (4.0, [1.0, 3.0], 2.0)
    for rk in m.ranks:
        pair = "ranks 0,2" if rk.rank % 2 == 0 else "ranks 1,3"
        got = {(r["dim"], r["op"]): r["wire_bytes"] for r in m.comm_table() if r["rank"] == rk.rank}
        assert got == {
            ("world", "all_reduce"): ring("all_reduce", 1024),
            (pair, "all_gather"): ring("all_gather", 2 * 64 * 4, 2),
            (pair, "reduce_scatter"): ring("reduce_scatter", 64 * 4, 2),
        }
        (span,) = [e for e in rk.timeline if e.kind == "exchange"]
        assert all(span.start <= c.start <= span.end for c in rk.comm)
        # gloo's reduce-scatter Work never reports completion (is_completed() stays False after
        # wait(), torch 2.13), so the meter cannot stamp its end; the others end in the region
        assert all(c.end is not None and c.end <= span.end for c in rk.comm if c.op != "reduce_scatter")
        assert rk.memory["params"] == rk.memory["grads"] == rk.memory["optimizer"] == 0
    assert m.steps == 1 and {e.phase for rk in m.ranks for e in rk.comm} == {"user"}
    trace = m.trace()["traceEvents"]
    assert any(e.get("name") == "exchange" for e in trace) and any(e.get("name") == "all_reduce[world]" for e in trace)


# -- faults, as a run's ---------------------------------------------------------------------------
def one_rank_skips():
    t = torch.ones(8)
    if dist.get_rank() != 1:
        dist.all_reduce(t)


def one_rank_raises():
    if dist.get_rank() == 2:
        raise ValueError("rank 2 fails on purpose")
    dist.all_reduce(torch.ones(8))


def test_a_hang_and_an_exception_are_diagnosed_like_a_run(lab):
    with pytest.raises(CollectiveTimeout) as hang:
        lab.measure(one_rank_skips, timeout=5)
    assert "ranks [1] never reached all_reduce" in str(hang.value)
    with pytest.raises(RankError) as err:
        lab.measure(one_rank_raises, timeout=30)
    assert set(err.value.failures) == {2} and "rank 2 fails on purpose" in err.value.failures[2]["traceback"]
    assert lab.measure(own_collectives).values[0][0] == 4.0  # repaired at the next call


def test_track_and_region_do_nothing_outside_measure():
    labkit.track(nn.Linear(2, 2))
    with labkit.region("nothing"):
        pass
