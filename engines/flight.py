"""What the GPU did with each collective: PyTorch's flight recorder, read on NCCL worlds.

On NCCL a collective's Work (and its future) completes when the op is enqueued, not when the GPU
has run it, so the collective log (engines/meters/comm.py) shows every op of a hung rank as left.
The flight recorder, on by default (TORCH_FR_BUFFER_SIZE, 2000 entries), keeps each op's
GPU-side state ('scheduled', 'started', 'completed', from the CUDA events the watchdog queries)
and is readable in-process through torch._C._distributed_c10d._dump_fr_trace_json, which not
every build has (guarded). On gloo its states say nothing (entries stay 'scheduled' once done,
checked with torch 2.13), so the Lab reads it on NCCL only. labkit/cluster/diagnose.py reads `summary`.
"""

from __future__ import annotations

import json


def gpu_ops() -> dict | None:
    """This rank's flight record as `summary` gives it, or None where it cannot be read."""
    import torch  # engines only: runtime.poll imports this module in the notebook's sight

    dump = getattr(torch._C._distributed_c10d, "_dump_fr_trace_json", None)
    if dump is None:
        return None
    try:
        return summary(json.loads(dump(True, False)))
    except Exception:  # a build whose recorder is off or whose dump format differs
        return None


def summary(trace: dict) -> dict:
    """A flight-recorder dump (its JSON, parsed) -> {'open': every op the GPU has not completed,
    oldest first, each {'op', 'pg' (process-group name), 'seq' (its collective or p2p sequence
    number on that group, from 1), 'p2p', 'state', 'sizes'}, 'entered': pg name -> the highest
    collective sequence number this rank enqueued on it}.

    An op counts as completed when a later op of its group has: a group's ops run one after
    another on its communicator's stream, and some entries have no CUDA events to show their own
    state (each op inside a batch_isend_irecv; the batch's 'coalesced' entry has them)."""
    entries = sorted(trace.get("entries", []), key=lambda e: (e.get("record_id", 0), e.get("time_created_ns", 0)))
    last_done = {str(e["process_group"][0]): i for i, e in enumerate(entries) if e.get("state") == "completed"}
    out, entered = [], {}
    for i, e in enumerate(entries):
        pg = str(e["process_group"][0])
        p2p = bool(e.get("is_p2p"))
        seq = int(e["p2p_seq_id"] if p2p else e["collective_seq_id"])
        if not p2p:
            entered[pg] = max(entered.get(pg, 0), seq)
        if e.get("state") != "completed" and i > last_done.get(pg, -1):
            out.append(
                {
                    "op": str(e.get("profiling_name", "?")).split(":")[-1],
                    "pg": pg,
                    "seq": seq,
                    "p2p": p2p,
                    "state": e.get("state"),
                    "sizes": e.get("input_sizes"),
                }
            )
    return {"open": out, "entered": entered}
