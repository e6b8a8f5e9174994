"""Process groups under a job: every group times out with the job, and every creation is logged.

Creating a group is collective: every rank of the world must create the same groups in the same
order, or ranks pair up in the wrong groups and wait forever (torch names groups by a counter).
Each creation is logged as a 'new_group' op on the world group, its members beside it, so the
diagnosis (labkit/cluster/diagnose.py) sees where two ranks' creation orders part.

Runs on the engines; torch is imported inside the functions because the Lab imports
engines/runtime.py (and so this module) in the notebook kernel only to name what it sends.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable


def set_timeouts(seconds: float) -> None:
    """Every process group of this rank times out after `seconds` (gloo reads it per op)."""
    from torch.distributed import distributed_c10d as c10d  # engines only

    td = datetime.timedelta(seconds=seconds)
    for pg in list(c10d._world.pg_names):
        try:
            c10d._set_pg_timeout(td, pg)
        except Exception:  # a group this rank is not a member of, or a backend without timeouts
            pass


def install(group_timeout: Callable[[], float | None]) -> None:
    """Wrap torch's `_new_group_with_tag` (what `new_group` calls), once per process: a group
    created during a job gets `group_timeout()` seconds, and its creation goes into the running
    job's collective log (the comm meter's)."""
    import torch.distributed as dist  # engines only, like the comm meter
    from torch.distributed import distributed_c10d as c10d

    from labkit.engines.meters.comm import CommMeter

    if getattr(c10d._new_group_with_tag, "_labkit", False):
        return
    create = c10d._new_group_with_tag

    def new_group_logged(ranks=None, timeout=None, *args, **kwargs):
        seconds = group_timeout()
        if timeout is None and seconds is not None:
            timeout = datetime.timedelta(seconds=seconds)
        meter = CommMeter.current
        local = kwargs.get("use_local_synchronization", len(args) > 3 and args[3])
        if meter is None or local or not dist.is_initialized():
            return create(ranks, timeout, *args, **kwargs)
        members = sorted(ranks) if ranks is not None else list(range(dist.get_world_size()))
        ev = meter.begin("new_group", dist.group.WORLD, None, 0)
        ev["members"] = members
        pg = create(ranks, timeout, *args, **kwargs)
        meter.end(ev)
        return pg

    new_group_logged._labkit = True
    c10d._new_group_with_tag = new_group_logged
