"""The shared layout rules against numbers worked out by hand, here in the test: the ring model's byte
table (labkit/layout/wire.py), the bucket rules (layout/buckets.py) and the padding of flat buffers
(layout/flat.py). The engines and the theory both read these rules, so measured-equals-predicted
cannot see a bug in them (two agreeing wrongs); these tests can. No cluster.
"""

from __future__ import annotations

from conftest import TINY
from test_sharding import ODD

from labkit import ParallelConfig, theory
from labkit.layout.buckets import grouped_buckets, lab_buckets, torch_ddp_buckets
from labkit.layout.flat import bucket_layouts, unit_layouts
from labkit.layout.wire import WIRE
from labkit.theory import param_shapes
from labkit.theory.exact import sharding

# TINY (h 32, f 128, V 128, s 16, 2 layers), parameter by parameter:
#   embedding  tok 128*32 = 4096, pos 16*32 = 512                          ->  4,608
#   per block  ln1, ln2 4*32 = 128; wq wk wv wo 4*32*32 = 4,096;
#              fc1, fc2 2*32*128 = 8,192                                   -> 12,416
#   head       norm 2*32 = 64, proj 128*32 = 4,096                         ->  4,160
PSI = 4_608 + 2 * 12_416 + 4_160  # = 33,600


def rows(cfg, model=TINY, rank=0):
    """The theory's comm rows of one rank: {(dim, op): (calls, payload bytes, wire bytes)}."""
    out = {}
    for r in theory.estimate(cfg, model).comm_table():
        if r["rank"] == rank:
            out[r["dim"], r["op"]] = (r["calls"], r["payload_bytes"], r["wire_bytes"])
    return out


def test_the_ring_models_bytes():
    """What one rank sends, for B = 1,000 bytes and n = 4 (Patarasuk & Yuan 2009 for the ring
    all-reduce: a reduce-scatter then an all-gather, each (n-1)/n of B)."""
    assert WIRE["all_reduce"](1000, 4) == 1500
    assert WIRE["all_gather"](1000, 4) == WIRE["reduce_scatter"](1000, 4) == 750
    assert WIRE["all_to_all"](1000, 4) == WIRE["broadcast"](1000, 4) == 750
    assert WIRE["gather"](1000, 4) == 250 and WIRE["send"](1000, 4) == 1000 and WIRE["recv"](1000, 4) == 0
    assert WIRE["all_reduce"](1000, 1) == 0  # a group of one sends nothing


def test_ddp_sends_two_psi_times_three_quarters():
    """dp=4, one bucket (25 MB): one all-reduce of the fp32 gradients, 4Ψ bytes; the norm needs no
    collective (nothing is split)."""
    assert theory.num_params(TINY) == PSI == 33_600
    assert rows(ParallelConfig(dp=4)) == {("dp", "all_reduce"): (1, 4 * 33_600, 2 * 3 / 4 * 4 * 33_600)}


def test_zero3_gathers_twice_and_scatters_once():
    """dp=4, units embed / block / block / head (each a multiple of 4 elements: no padding):
    forward and backward all-gather every unit (2 x 4Ψ bytes), backward reduce-scatters it (4Ψ),
    the norm all-reduces one fp32 scalar."""
    assert rows(ParallelConfig(dp=4, sharding="zero3")) == {
        ("dp", "all_gather"): (8, 2 * 4 * 33_600, 3 / 4 * 2 * 4 * 33_600),
        ("dp", "reduce_scatter"): (4, 4 * 33_600, 3 / 4 * 4 * 33_600),
        ("dp", "all_reduce"): (1, 4, 2 * 3 / 4 * 4),
    }


def test_tensor_parallel_all_reduces_4l_plus_2_activations():
    """tp=2 x dp=2: b = 8/2 = 4 sequences, B = 4 bytes * b*s*h = 4*4*16*32 = 8,192. Over tp: 4L+2 = 10
    all-reduces of B (embedding, wo and fc2 forward; the attention and MLP inputs and the head
    backward), the loss's max (4bs = 256 B) and sum-exp with target logit (8bs = 512 B), the norm
    (4 B). Over dp: this rank's half of every matrix, whole LayerNorms and positions:
    tok 2,048 + pos 512 + 2 * (128 + 2,048 + 4,096) + 64 + 2,048 = 17,216 elements."""
    tp = 10 * 8_192 + 256 + 512 + 4
    assert rows(ParallelConfig(tp=2, dp=2)) == {
        ("tp", "all_reduce"): (13, tp, 2 * 1 / 2 * tp),
        ("dp", "all_reduce"): (1, 4 * 17_216, 2 * 1 / 2 * 4 * 17_216),
    }


def test_buckets_close_before_the_cap_ours_after_it_pytorchs():
    """Sizes in bytes; reverse registration order. Ours closes a bucket before the parameter that
    would overflow it; PyTorch's after the parameter that reaches the cap."""
    assert lab_buckets([4, 4, 8, 2], 10) == [[3, 2], [1, 0]]
    assert lab_buckets([6, 6, 6], 10) == [[2], [1], [0]]
    assert torch_ddp_buckets([6, 6, 6], 10) == [[2, 1], [0]]
    assert lab_buckets([20, 3], 10) == [[1], [0]]  # larger than the cap: a bucket of its own
    # two reduce groups: each bucketed alone, then launched by their last parameter, latest first
    assert grouped_buckets([4, 4, 4, 4], ["a", "b", "a", "b"], 8) == [("b", [3, 1]), ("a", [2, 0])]


def test_tinys_buckets_at_20_kb():
    """int(0.02 MiB) = 20,971 bytes. Backward's order: head.proj 16,384 + head.norm 128 + 128 =
    16,640, then blocks.1.mlp.fc2 (16,384) would overflow; fc2 alone; fc1 16,384 + ln2 256 + wo
    4,096 = 20,736; wv wk wq 12,288 + ln1 256 = 12,544; block 0 the same; its wv wk wq and ln1 with
    pos (2,048): 14,592; the token table alone."""
    sizes = [4 * (a * b if b else a) for _, (a, *rest) in param_shapes(TINY) for b in [rest[0] if rest else 0]]
    assert lab_buckets(sizes, int(0.02 * 2**20)) == [
        [24, 23, 22],
        [21],
        [20, 19, 18, 17],
        [16, 15, 14, 13, 12],
        [11],
        [10, 9, 8, 7],
        [6, 5, 4, 3, 2, 1],
        [0],
    ]


def test_padding_of_odd_units():
    """ODD (h 27, f 81, V 125, s 18) in ZeRO-3 units over N = 4:
    embed 125*27 + 18*27 = 3,861 -> padded 3,864, shard 966;
    block 4*27 + 4*27*27 + 2*27*81 = 108 + 2,916 + 4,374 = 7,398 -> 7,400, shard 1,850;
    head 2*27 + 125*27 = 3,429 -> 3,432, shard 858."""
    layouts = unit_layouts(param_shapes(ODD), 4, "zero3")
    assert [(p.unit, p.numel, p.padded, p.shard) for p in layouts] == [
        ("embed", 3_861, 3_864, 966),
        ("blocks.0", 7_398, 7_400, 1_850),
        ("blocks.1", 7_398, 7_400, 1_850),
        ("head", 3_429, 3_432, 858),
    ]
    block = layouts[1]
    # shard 3 holds [5,550, 7,400): matrices end at 2,916 + 4,374 = 7,290, so 1,740 decayed
    # elements, then 108 LayerNorm elements, then 2 of padding
    assert block.owned(3) == (5_550, 7_400) and block.real(3) == 1_848
    assert block.runs(3) == [(0, 1_740, True), (1_740, 1_850, False)]
    assert block.runs(0) == [(0, 1_850, True)]


def test_zero3_state_bytes_on_odd_by_hand():
    """16 bytes per element of this rank's shards (fp32 params, grads, Adam's two moments):
    S = 966 + 2 * 1,850 + 858 = 5,524 elements."""
    s = 966 + 2 * 1_850 + 858
    assert sharding.state_bytes(ParallelConfig(dp=4, sharding="zero3"), ODD, 4) == {
        "params": 4 * s,
        "grads": 4 * s,
        "optimizer": 8 * s,
    }


def test_a_flat_bucket_of_zero1_pads_to_its_group():
    """ZeRO-1 at N = 4 over TINY's 20 KB buckets: each bucket one buffer, padded to a multiple of 4
    (every TINY bucket already is). The first holds what backward produces first, matrices first:
    head.proj, then the final norm's bias and weight: 4,096 + 32 + 32 = 4,160 elements, 1,040 a rank."""
    first = bucket_layouts(param_shapes(TINY), 4, int(0.02 * 2**20), 4)[0]
    assert first.names == ("head.proj.weight", "head.norm.bias", "head.norm.weight")
    assert (first.numel, first.padded, first.shard, first.decay_numel) == (4_160, 4_160, 1_040, 4_096)
