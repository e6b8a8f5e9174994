"""A script's collective log on its engine: what the script's process ships (engines/script/ship.py),
in the shape of the comm meter that is a Lab job's log (engines/meters/comm.py), so that the Lab's
poll, its hang diagnosis (labkit/cluster/diagnose.py) and its stop (labkit/cluster/faults.py) read a
script's collectives as they read a run's.

The groups are the script's own world's, never the engine's: once the process has exited that world
is gone, and no group of it can be left half-entered (`group_counts` and `open_events` are then empty,
so a cancelled script does not make the Lab rebuild the engines' own groups). Torch-free: the
notebook imports the agent that holds one.
"""

from __future__ import annotations

import threading


class ScriptLog:
    """The job's collective log while a script runs: events by the child's index, its groups' counts
    and registry, the dims of its meshes, where its main thread is."""

    def __init__(self):
        self.events: list[dict] = []
        self.dims_by_ranks: dict[tuple[int, ...], str] = {}
        self.gone = False
        """The process has exited: its world no longer exists."""
        self._counts: dict[str, list] = {}
        self._registry: dict[str, list[int]] = {}
        self._stack = ""
        self._lock = threading.Lock()

    def take(self, kind: str, body: list) -> None:
        """One message of the child's (ship.py's kinds)."""
        with self._lock:
            if kind == "ev":
                self.events.append(body[0])
            elif kind == "end":
                self.events[body[0]]["end"] = body[1]
            elif kind == "err":
                self.events[body[0]]["error"] = body[1]
            elif kind == "groups":
                self._counts, self._registry = body[0], body[1]
            elif kind == "dims":
                self.dims_by_ranks = {tuple(ranks): name for ranks, name in body[0]}
            elif kind == "stack":
                self._stack = body[0]

    # -- what a comm meter answers (engines/runtime.py poll) ------------------------------------
    def sweep(self) -> None:
        """Nothing to stamp here: the child's meter stamps its own ops and ships the ends."""

    def open_events(self) -> list[dict]:
        if self.gone:
            return []
        with self._lock:
            return [e for e in self.events if e["end"] is None]

    def group_counts(self) -> dict[str, list]:
        return {} if self.gone else dict(self._counts)

    def registry(self) -> dict[str, list[int]]:
        """The script's process groups (name -> ranks), in place of the engine's own."""
        return {} if self.gone else dict(self._registry)

    def stack(self) -> str:
        """Where the script's main thread was at the child's last look (ship.STACK_S)."""
        return "" if self.gone else self._stack

    def comm_events(self, world: int) -> list[dict]:
        """The events as CommEvent dicts, named by the mesh dims the script built (else 'world' or
        the group's ranks): what a rank reports when its process died before its own report."""
        out = []
        for e in self.events:
            if e["op"] == "new_group":
                continue
            group = tuple(e["group"])
            dim = self.dims_by_ranks.get(group) or (
                "world" if len(group) == world else "ranks " + ",".join(map(str, group))
            )
            out.append({**{k: v for k, v in e.items() if k not in ("pg", "members", "error")}, "dim": dim})
        return out
