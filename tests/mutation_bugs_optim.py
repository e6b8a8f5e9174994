"""The optimizers' bugs tests/test_mutations.py plants (ZeRO's sharded AdamW, clipping where sharded,
Muon's whole matrices and its routing rule), written as tests/mutation_bugs.py writes the strategies'."""

from __future__ import annotations


def moments_of_the_next_shard(original):
    """engines/parallel/zero.py ZeRO12.step, which from the second step on updates each shard with the
    next rank's Adam moments (each flat buffer's state gathered and taken one rank round)."""
    import torch
    import torch.distributed as dist

    def step(self):
        opt = self.optimizer.opt
        if opt.t >= 1:
            at = 0
            for layout, (group, n, index) in zip(self.layouts, self.groups):
                k = len(layout.runs(index))
                for state in (opt.exp_avg, opt.exp_avg_sq):
                    mine = torch.cat([s.reshape(-1) for s in state[at : at + k]])
                    every = [torch.empty_like(mine) for _ in range(n)]
                    dist.all_gather(every, mine, group=group) if n > 1 else every.__setitem__(0, mine)
                    theirs, o = every[(index + 1) % n], 0
                    for s in state[at : at + k]:
                        s.copy_(theirs[o : o + s.numel()].view_as(s))
                        o += s.numel()
                at += k
        return original(self)

    return step


def adam_counts_from_two(original):
    """engines/optim.py AdamW.step whose step counter starts one ahead: every bias correction is the next
    step's."""

    def step(self, grads, scale=1.0):
        if self.t == 0:
            self.t = 1
        return original(self, grads, scale)

    return step


def sharded_clip_skipped(original):
    """engines/parallel/shards.py ShardedOptimizer.step, updating every shard with the unclipped gradients."""
    from labkit.engines.optim import grad_norm

    def step(self, grads):
        mine = [
            g[at : at + hi - lo]
            for p, i, g in zip(self.layouts, self.indices, grads)
            for name, _, lo, hi, at in p.pieces(i)
            if self.counted[name]
        ]
        norm = grad_norm(mine, None, self.norm_group)
        runs = [g[lo:hi] for p, i, g in zip(self.layouts, self.indices, grads) for lo, hi, _ in p.runs(i)]
        self.opt.step(runs, 1.0)  # the bug: no clip_coefficient(norm, clip)
        return float(norm)

    return step


def slice_orthogonalized_alone(original):
    """engines/muon.py Whole.gather, which hands Newton-Schulz the rank's own tp slice of the update instead of
    the whole matrix gathered from its tp group: a different update (the slice's orthogonalization is not
    the matrix's), the real bug a Muon under TP is prone to."""

    def gather(self, piece):
        return piece.bfloat16()

    return gather


def slice_kept_whole(original):
    """Whole.mine without the slicing: the pair of `slice_orthogonalized_alone`, so that the update it made
    fits the rank's piece."""

    def mine(self, full):
        return full

    return mine


def momentum_reset_every_step(original):
    """engines/muon.py Muon.step with its momentum buffers zeroed first: each step's update from that step's
    gradient alone (a buffer made anew each step)."""

    def step(self, grads, scale=1.0):
        for b in self.bufs:
            b.zero_()
        return original(self, grads, scale)

    return step


def fc1_routed_to_adamw(original):
    """labkit/layout/optimizer.py takes_muon as engines/muon.py reads it, sending the MLP's first layer to
    AdamW: the wrong parameters on the wrong optimizer."""

    def takes_muon(name, shape):
        return original(name, shape) and "mlp.fc1" not in name

    return takes_muon


def shard_orthogonalized_alone(original):
    """engines/muon.py ShardedMuon.gather without the gather: each ZeRO rank hands Newton-Schulz its own slice
    of the update, zeros where the other ranks' slices lie, instead of the whole matrix (Distributed Muon's
    DP Gather skipped: a different update wherever a matrix spans two slices)."""
    import torch

    def gather(self, k, mine):
        layout = self.layouts[k]
        full = torch.zeros(layout.padded, dtype=mine.dtype, device=mine.device)
        a, b = layout.owned(self.indices[k])
        full[a:b] = mine
        return full

    return gather
