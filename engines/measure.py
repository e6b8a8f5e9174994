"""Lab.measure on one rank: a user's function under the meters, its report as plain data.

The function runs in the job thread like Lab.apply's (engines/runtime.py), so its collectives
are in the job's collective log and a hang or an exception in it is diagnosed like a run's.
Around it a Tracker (engines/tracking.py) adds memory, the timeline and the phases that
`labkit.track` and `labkit.region` tell it. torch is imported only here on the engines: the
notebook names `measure_rank` without loading torch.
"""

from __future__ import annotations

from labkit.engines import runtime


def measure_rank(blob: bytes, *args, **kwargs) -> dict:
    """Lab.measure's body on every rank: fn (pickled by value) with the process group ready,
    under the job's collective log and a Tracker. Returns this rank's report (plain data) with
    fn's return value as 'value'."""
    import cloudpickle  # heavy; only a Lab call needs it
    import torch

    from labkit.engines.tracking import Tracker

    rt = runtime.current()
    fn = cloudpickle.loads(blob)
    comm = runtime.job_comm_meter()
    if comm is None:
        raise RuntimeError("measure_rank runs as a Lab job, under its collective log (Lab.measure)")
    tracker = Tracker(comm, torch.device(rt.device), rt.world_size, rt.rank)
    Tracker.current = tracker
    try:
        with tracker.memory.saved_tensors():
            value = fn(*args, **kwargs)
        value = tracker.take(value)
    finally:
        Tracker.current = None
        tracker.finish()
    return {
        "rank": rt.rank,
        "host": rt.host,
        "device": rt.device,
        "clock_offset": rt.clock_offset,
        "coords": tracker.coords,
        "steps": max(tracker.steps, 1),
        "memory": tracker.memory_report(),
        "comm": tracker.comm_events(),
        "timeline": tracker.timeline.events,
        "value": value,
    }
