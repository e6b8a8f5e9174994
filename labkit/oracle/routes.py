"""A run's routing placed in the global batch: which experts each token of each MoE layer went to,
step by step (what the reference replays where the two arithmetics tie, labkit/oracle/replay.py).

Every rank sends the experts of each forward by layer and microbatch (engines/routes.py); where
those tokens sit in the global batch follows from the layout alone, as the engines shard it
(engines/train.py `data_index`, engines/data.py `shard` and `microbatches`, the cp ranks' zigzag
positions): rows [(dp·ep_size + ep)·B/(dp·ep) + m·b, ... + b) with b = B/(dp·ep·M), positions the
whole sequence or the cp rank's zigzag. The tp ranks of a data slice route the same tokens (an MoE
layer is replicated over tp, under SP on the gathered sequence): their copies must agree to the expert,
as replicated parameters must agree to the bit.
"""

from __future__ import annotations

import numpy as np

from labkit.layout.window import zigzag_positions
from labkit.oracle.assembly import PieceIssue


def place(reports: list[dict], cfg, seq: int, steps: int) -> tuple[dict[int, np.ndarray] | None, list[PieceIssue]]:
    """{layer: experts (steps, B, S, k), -1 where no rank routed} from the ranks' reports (with their
    'coords' and 'routes'), and the issues found: tp copies that disagree. None: no routes were sent."""
    sent = [r for r in reports if r.get("routes")]
    if not sent:
        return None, []
    B, M = cfg.global_batch, cfg.microbatches
    count = cfg.dp * cfg.ep  # the data slices (engines/train.py data_index)
    b = B // count // M  # rows of one microbatch
    out: dict[int, np.ndarray] = {}
    first: dict[int, np.ndarray] = {}  # per element: the rank whose copy was written, -1: none yet
    differs: dict[tuple[int, int, int], int] = {}
    for r in sent:
        c = r["coords"]
        index = c["dp"] * cfg.ep + c["ep"]
        positions = np.asarray(zigzag_positions(seq, cfg.cp, c["cp"]) if cfg.cp > 1 else range(seq))
        for step, layers in enumerate(r["routes"]):
            for layer, by_mb in layers.items():
                layer = int(layer)
                for mb, experts in by_mb.items():
                    got = np.asarray(experts, dtype=np.int16)  # (b, s_local, k)
                    if layer not in out:
                        out[layer] = np.full((steps, B, seq, got.shape[-1]), -1, dtype=np.int16)
                        first[layer] = np.full((steps, B, seq), -1, dtype=np.int64)
                    rows = index * (B // count) + int(mb) * b + np.arange(b)
                    where = (step, rows[:, None], positions[None, :])  # (b, s_local) cells of the global batch
                    seen = first[layer][where] >= 0
                    if seen.any():  # a tp copy: compared with the first copy, never overwritten
                        bad = (out[layer][where][seen] != got[seen]).any(-1)
                        for owner in np.unique(first[layer][where][seen][bad]):
                            key = (layer, int(owner), r["rank"])
                            differs[key] = differs.get(key, 0) + int(np.count_nonzero(bad))
                    mine = out[layer][where]
                    mine[~seen] = got[~seen]
                    out[layer][where] = mine
                    taken = first[layer][where]
                    taken[~seen] = r["rank"]
                    first[layer][where] = taken
    issues = [PieceIssue("differs", "routes", f"layer {layer}", (a, b), n) for (layer, a, b), n in differs.items()]
    return out, issues
