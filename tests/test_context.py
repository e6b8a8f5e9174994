"""Context parallelism: ring attention alone against dense causal attention, and cp layouts on the
4-engine cluster against the reference, with measured bytes and memory against the theory."""

from __future__ import annotations

import pytest
from conftest import TINY

from labkit import ConfigError, ParallelConfig, theory, validate
from labkit.engines.parallel.context import ring_schedule, zigzag_chunks, zigzag_index
from labkit.layout.mesh import MeshLayout
from labkit.oracle.checks import assert_matches, loss_errors

# (cp, seq, batch, heads, head_dim): odd shapes on purpose (3 heads, chunks of 3 and 5 tokens)
RING_CASES = [(2, 8, 2, 2, 4), (2, 20, 1, 3, 8), (4, 24, 2, 3, 5), (4, 64, 1, 4, 16)]


def _ring_against_dense(cases):
    """On every rank: random q, k, v (the same on all ranks, float64); dense causal attention on the
    whole sequence, ring attention on this rank's zigzag tokens; the largest relative error of the
    outputs and of dq, dk, dv at this rank's positions, per case."""
    import torch
    import torch.nn.functional as F

    from labkit.engines import runtime
    from labkit.engines.mesh import Mesh
    from labkit.engines.parallel.context import Ring, zigzag_index
    from labkit.layout.mesh import MeshLayout

    rank = runtime.current().rank
    errors = []
    for cp, seq, b, nh, hd in cases:
        mesh = Mesh.build(MeshLayout.from_sizes(cp=cp, dp=4 // cp), rank)
        r = mesh.coord("cp")
        gen = torch.Generator().manual_seed(1000 * cp + seq)
        q, k, v, w = (torch.randn(b, nh, seq, hd, generator=gen, dtype=torch.float64) for _ in range(4))
        dense = [t.clone().requires_grad_() for t in (q, k, v)]
        out = F.scaled_dot_product_attention(*dense, is_causal=True)
        (out * w).sum().backward()
        idx = zigzag_index(seq, cp, r)
        local = [t[:, :, idx].clone().requires_grad_() for t in (q, k, v)]
        y = Ring(mesh.group("cp"), r, cp)(*local)
        (y * w[:, :, idx]).sum().backward()
        want = [out[:, :, idx]] + [t.grad[:, :, idx] for t in dense]
        got = [y] + [t.grad for t in local]
        errors.append(max(float((g - x).abs().max() / x.abs().max()) for g, x in zip(got, want)))
    return errors


def test_ring_attention_matches_dense_causal_attention(lab):
    per_rank = lab.apply(_ring_against_dense, RING_CASES)
    for rank, errors in enumerate(per_rank):
        for case, err in zip(RING_CASES, errors):
            assert err < 1e-6, (rank, case, err)


@pytest.mark.parametrize("cp", [2, 3, 4, 8])
def test_zigzag_schedule_covers_every_causal_pair_once_with_equal_work(cp):
    seq = 2 * cp * 3
    assert sorted(int(i) for r in range(cp) for i in zigzag_index(seq, cp, r)) == list(range(seq))
    seen = {}
    for rank in range(cp):
        work = []
        for t, pairs in enumerate(ring_schedule(rank, cp)):
            holder = (rank - t) % cp
            for qa, kb, mask in pairs:
                qc, kc = zigzag_chunks(rank, cp)[qa], zigzag_chunks(holder, cp)[kb]
                seen[qc, kc] = seen.get((qc, kc), 0) + 1
                assert (mask == "causal") == (qc == kc) and kc <= qc
            work.append(sum(0.5 if m == "causal" else 1.0 for _, _, m in pairs))
        assert work == [2.0] * cp  # the zigzag's point: every rank, every step, two blocks
    assert seen == {(q, k): 1 for q in range(2 * cp) for k in range(q + 1)}


def test_torch_context_parallel_is_refused_on_the_cpu_path():
    with pytest.raises(ConfigError, match="context_parallel needs CUDA"):
        validate(ParallelConfig(cp=2, dp=2, impl="torch"), TINY, 4)


@pytest.mark.parametrize("cfg", [ParallelConfig(cp=2, dp=2), ParallelConfig(cp=4)], ids=["cp2xdp2", "cp4"])
def test_context_parallel_trains_like_one_process(lab, ref_cache, cfg):
    """Losses, parameters and gradient norms match the reference; comm rows equal the theory's
    (calls included); model states and activations equal it exactly (one rank's s/cp tokens)."""
    res = lab.run(cfg, model=TINY, steps=3, return_params=True)
    ref = ref_cache()
    assert_matches(res, ref)
    est = theory.estimate(cfg, TINY, world=4)
    assert res.comm_table() == est.comm_table()
    b, s, h, cp = cfg.global_batch // cfg.dp, TINY.seq, TINY.hidden, cfg.cp
    for rk in res.ranks:
        assert max(loss_errors(rk.grad_norms, ref.grad_norms)) < 1e-5  # the clip is inactive on TINY
        for k in ("params", "grads", "optimizer", "activations"):
            assert rk.memory[k] == est.memory[rk.rank][k], (rk.rank, k)
        assert rk.memory["activations"] == theory.activation_bytes(TINY.replace(seq=s // cp), b)
        sends = [c for c in rk.comm if c.op == "send" and c.step == 2]
        assert len(sends) == 3 * (cp - 1) * TINY.layers  # K/V forward; K/V and dK/dV backward
        assert [c.phase for c in sends].count("forward") == (cp - 1) * TINY.layers
        assert {c.payload_bytes for c in sends} == {4 * 2 * b * (s // cp) * h}
        nxt = MeshLayout.of(cfg).rank(**{**rk.coords, "cp": (rk.coords["cp"] + 1) % cp})
        assert {c.peer for c in sends} == {nxt}  # round the ring, one way
