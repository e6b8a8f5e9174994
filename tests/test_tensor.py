"""Tensor (+ sequence) parallelism on the real 4-engine cluster: against the reference, against
the theory (comm rows and memory, exactly), and its primitives against dense computation."""

from __future__ import annotations

import pytest
from conftest import TINY

from labkit import ParallelConfig, theory
from labkit.config import ConfigError
from labkit.config.validation import validate
from labkit.oracle.checks import assert_matches

LAYOUTS = {
    "tp4": ParallelConfig(tp=4),
    "tp2": ParallelConfig(tp=2),
    "tp2-dp2": ParallelConfig(tp=2, dp=2),
    "tp2-sp": ParallelConfig(tp=2, sequence_parallel=True),
    "tp2-sp-dp2-mb2": ParallelConfig(tp=2, dp=2, sequence_parallel=True, microbatches=2),
    "tp2-torch": ParallelConfig(tp=2, impl="torch"),
    "tp2-sp-torch": ParallelConfig(tp=2, sequence_parallel=True, impl="torch"),
}


@pytest.fixture(scope="module")
def runs(lab):
    """Each layout run once (3 steps, final parameters back), shared by the tests below."""
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = lab.run(LAYOUTS[name], model=TINY, steps=3, return_params=True)
        return cache[name]

    return get


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_tensor_parallel_trains_like_one_process(runs, ref_cache, name):
    res = runs(name)
    assert_matches(res, ref_cache())
    cfg = LAYOUTS[name]
    assert len(res.ranks) == cfg.world
    est = theory.estimate(cfg, TINY, world=4)
    # DTensor's vocab-parallel embedding leaves a Replicate (V, h) gradient on every rank
    extra_grad = 4 * TINY.vocab * TINY.hidden * (cfg.tp - 1) // cfg.tp if cfg.impl == "torch" else 0
    for rk in res.ranks:
        assert rk.memory["params"] == est.memory[rk.rank]["params"]
        assert rk.memory["grads"] == est.memory[rk.rank]["grads"] + extra_grad
        assert rk.memory["optimizer"] == est.memory[rk.rank]["optimizer"]
    if cfg.impl == "lab":
        assert res.comm_table() == est.comm_table()  # row for row: calls, payload, wire bytes
        for rk in res.ranks:
            assert rk.memory["activations"] == est.memory[rk.rank]["activations"]
    styles = res.ranks[0].info["tp_styles"]
    assert styles["blocks.0.attn.wq"]["style"] == "colwise" and styles["blocks.0.attn.wo"]["style"] == "rowwise"


def test_sequence_parallel_same_bytes_less_activation_memory(runs):
    """SP replaces each (b, s, h) all-reduce by a reduce-scatter + all-gather pair: the same wire
    bytes; what it saves is activation memory (the LayerNorm regions hold s/tp rows)."""
    tp, sp = runs("tp2"), runs("tp2-sp")
    b, s, h, t = 8, TINY.seq, TINY.hidden, 2
    big = 4 * b * s * h

    def wire(res, ops):
        return sum(e.wire_bytes for e in res.ranks[0].comm if e.step == 2 and e.op in ops and e.payload_bytes == big)

    per_step = (4 * TINY.layers + 2) * 2 * (t - 1) / t * big  # 4L + 2 all-reduces of (b, s, h)
    assert wire(sp, ("all_gather", "reduce_scatter")) == wire(tp, ("all_reduce",)) == per_step
    for r in range(2):
        a_tp, a_sp = tp.ranks[r].memory["activations"], sp.ranks[r].memory["activations"]
        assert a_sp < a_tp
        assert a_tp == pytest.approx(theory.estimate(ParallelConfig(tp=2), TINY).memory[r]["activations"], rel=0.1)
        assert a_sp == pytest.approx(
            theory.estimate(ParallelConfig(tp=2, sequence_parallel=True), TINY).memory[r]["activations"], rel=0.1
        )
    # what SP saves is exactly the replicated LayerNorm inputs and stats, and the head's norm input
    saved = (4 * (2 * TINY.layers + 1) * b * h + 4 * 2 * (2 * TINY.layers + 1) * b) * (s - s // t)
    assert tp.ranks[0].memory["activations"] - sp.ranks[0].memory["activations"] == saved


def test_meter_sees_dtensor_internal_collectives(lab):
    """DTensor issues some collectives from inside its own dispatch (loss_parallel's reductions,
    clip_grad_norm_ over sharded gradients); the meter sees them, and an audit that lets DTensor
    desugar first counts the same ops."""
    res = lab.run(ParallelConfig(tp=2, impl="torch"), model=TINY, steps=2, audit=True)
    tokens = 8 * TINY.seq
    for rk, counts in zip(res.ranks, res.audit):
        assert sum(counts.values()) == len(rk.comm)
        steady = [c for c in rk.comm if c.step == 1]
        assert [c for c in steady if c.phase == "forward" and c.payload_bytes == 4 * tokens]  # loss_parallel
        assert [c for c in steady if c.phase == "optimizer"]  # the grad norm


def _primitives(seed: int) -> dict[str, float]:
    """On every rank (the world is the tp group): each TP/SP primitive's forward and backward
    against the same computation done densely, in float64. Returns the worst relative errors."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from labkit.engines.parallel import tensor as tpl

    group, t, r = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(seed)  # the same full tensors on every rank
    b, s, h, f, v = 2, 8, 12, 16, 20

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    def err(a, b_):
        return float((a - b_).norm() / b_.norm())

    x, w1, w2, gy = rand(b, s, h), rand(f, h), rand(h, f), rand(b, s, h)
    rows, cols = slice(r * f // t, (r + 1) * f // t), slice(r * s // t, (r + 1) * s // t)  # ffn, sequence
    out = {}

    # dense MLP: y = gelu(x W1^T) W2^T, its gradients under the upstream gradient gy
    xd, w1d, w2d = (a.clone().requires_grad_() for a in (x, w1, w2))
    (F.gelu(xd @ w1d.T) @ w2d.T).mul(gy).sum().backward()
    dense_y = F.gelu(x @ w1.T) @ w2.T
    for sp in (False, True):
        xp = (x[:, cols] if sp else x).clone().requires_grad_()
        w1p, w2p = w1[rows].clone().requires_grad_(), w2[:, rows].clone().requires_grad_()
        enter = tpl.Gather.apply(xp, group) if sp else tpl.Copy.apply(xp, group)  # f / all-gather
        part = F.gelu(enter @ w1p.T) @ w2p.T  # column, then row
        y = tpl.Scatter.apply(part, group) if sp else tpl.Reduce.apply(part, group)
        y.mul(gy[:, cols] if sp else gy).sum().backward()
        tag = "sp" if sp else "tp"
        out[f"{tag} forward"] = err(y, dense_y[:, cols] if sp else dense_y)
        out[f"{tag} dx"] = err(xp.grad, xd.grad[:, cols] if sp else xd.grad)
        out[f"{tag} dW1"] = err(w1p.grad, w1d.grad[rows])
        out[f"{tag} dW2"] = err(w2p.grad, w2d.grad[:, rows])

    # vocab-parallel embedding and cross-entropy against nn.functional's
    tokens = torch.randint(0, v, (b, s), generator=gen)
    table, proj = rand(v, h), rand(v, h)
    vs = slice(r * v // t, (r + 1) * v // t)
    td, pd = table.clone().requires_grad_(), proj.clone().requires_grad_()
    emb_d = F.embedding(tokens, td)
    loss_d = F.cross_entropy((emb_d @ pd.T).flatten(0, 1), tokens.roll(1, 1).flatten())
    loss_d.backward()
    pp_ = proj[vs].clone().requires_grad_()
    pos = torch.nn.Embedding(s, h).double()
    torch.nn.init.zeros_(pos.weight)  # tokens only
    tok = torch.nn.Embedding(v // t, h).double()
    tok.weight = torch.nn.Parameter(table[vs].clone())
    embed = tpl.VocabParallelEmbedding(tok, pos, vs.start, lambda z: tpl.Reduce.apply(z, group))
    emb = embed(tokens, torch.arange(s))  # (b, s, h) summed
    logits = tpl.Copy.apply(emb, group) @ pp_.T  # (b, s, V/t)
    loss = tpl.VocabParallelCrossEntropy.apply(logits.flatten(0, 1), tokens.roll(1, 1).flatten(), vs.start, group)
    loss.backward()
    out["embedding forward"] = err(emb, emb_d)
    out["loss"] = abs(float(loss) - float(loss_d)) / float(loss_d)
    out["dtable"] = err(embed.tok.weight.grad, td.grad[vs])
    out["dproj"] = err(pp_.grad, pd.grad[vs])
    return out


def test_primitives_match_dense_computation(lab):
    for seed in (0, 1):
        for rank_errors in lab.apply(_primitives, seed):
            worst = max(rank_errors, key=rank_errors.get)
            assert rank_errors[worst] < 1e-12, (worst, rank_errors)


def test_config_accepts_tp_and_refuses_what_is_not_built():
    validate(ParallelConfig(tp=2, dp=2, sequence_parallel=True), TINY, 4)
    validate(ParallelConfig(tp=2), TINY.replace(experts=4, top_k=2), 4)  # MoE replicated over tp
    with pytest.raises(ConfigError, match="FSDP2 over dp"):  # DTensor TP composes with FSDP2
        validate(ParallelConfig(tp=2, dp=2, impl="torch"), TINY, 4)
    with pytest.raises(ConfigError, match="not built yet"):
        validate(ParallelConfig(tp=2, impl="torch"), TINY.replace(experts=4, top_k=2), 4)


def test_activation_theory_shrinks_as_korthikanti_says():
    """Per block, TP leaves the LayerNorm regions (and the column-parallel inputs) whole; SP with
    Megatron's re-gather divides every saved tensor by t (Korthikanti et al. 2022, table 2)."""
    from labkit.theory.exact import tensor

    def block(t, sp, regather=False):
        one, two = TINY.replace(layers=1), TINY.replace(layers=2)
        return tensor.activation_bytes(two, 4, t, sp, megatron_regather=regather) - tensor.activation_bytes(
            one, 4, t, sp, megatron_regather=regather
        )

    full = block(1, False)
    assert full == theory.activation_bytes(TINY, 4, layers=1, head=False, embed=False)
    for t in (2, 4):
        assert block(t, True, regather=True) * t == full
        assert block(t, False) > block(t, True) > block(t, True, regather=True)
