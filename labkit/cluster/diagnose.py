"""Hang diagnosis from the ranks' collective logs (the analysis PyTorch's flight recorder tools do).

Each rank logs every op when it is entered and when it is left, with its process group and a
sequence number per process group (engines/meters/comm.py; group creation is logged too, as a
'new_group' op on the world group). When a run stops making progress, the Lab reads every
rank's log (the engines still answer: work runs in a job thread) and this module says:
  - per rank, the op it entered and never left (op, dim, group ranks, sequence number, shape),
    or, if it is in none, whether it finished, failed, or where its job thread is computing;
  - which members of that group never reached that op, and where they are instead;
  - the first point where two ranks' sequences in one group differ (op, shape or order), a
    group that ranks know under different process-group names (they created their groups in
    different orders), and a cycle of ranks each waiting for the next.

Like with like: sequence numbers count per process group, so two ops are compared only when
they ran on the same process group (same name *and* same ranks): rebuilt worlds reuse names,
and a name can stand for different ranks on ranks that created groups in different orders.

On NCCL the log's ends are enqueue times (a Work completes when the op is queued on the GPU), so
a hung rank looks as if it left everything. There the ranks also send what PyTorch's flight
recorder says the GPU has not completed (engines/flight.py, 'gpu'), with how far each group got
on each rank by its own (collective) sequence numbers; the diagnosis names the op each rank's GPU
is stuck in and the members that never enqueued it, beside what the log says.
Pure Python: it reads plain dicts.
"""

from __future__ import annotations


def _key(e: dict) -> tuple:
    # a process group is its name and its ranks: rebuilt worlds reuse names (the module docstring)
    return (str(e.get("pg", "")), tuple(e["group"]))


def _sig(e: dict) -> tuple:
    # what ranks must agree on at one seq of one group: op, shape, size, dtype, a new group's members
    return (e["op"], tuple(e.get("shape") or ()), e.get("numel"), e.get("dtype"), tuple(e.get("members") or ()))


def _fmt(e: dict) -> str:
    if e["op"] == "new_group":
        what = f"new_group({e.get('members')})"
    else:
        shape = "x".join(str(s) for s in e.get("shape") or []) or str(e.get("numel"))
        what = f"{e['op']}({shape} {e.get('dtype', '')})".replace(" )", ")")
    peer = f" peer {e['peer']}" if e.get("peer") is not None else ""
    pg = f" (pg {e['pg']})" if e.get("pg") not in (None, "") else ""
    return f"{what} on {e['dim']} group {list(e['group'])}{pg}{peer}, seq {e['seq']}"


def _as_poll(x) -> dict:
    return {"log": x} if isinstance(x, list) else x


def analyse(polls: dict[int, dict | list], hosts: dict[int, str] | None = None) -> dict:
    """polls: rank -> what runtime.poll(log_tail=N) returned for that rank ('log' oldest first,
    'groups' {pg: [ops entered, ranks]}, 'state', 'stack', 'error'), or just the log list.

    Returns 'stuck' (rank -> open op or None), 'missing' (one entry per open op some members
    never reached; from the flight records too, marked 'gpu'), 'gpu_stuck' (rank -> the op its
    GPU has not completed, NCCL only), 'divergence' (first mismatch of two ranks on one process group, or None),
    'renamed' (groups whose members use different process-group names), 'cycle' (ranks that
    wait on each other in a ring, or None) and 'text' (the summary the error message shows)."""
    hosts = hosts or {}
    polls = {r: _as_poll(p) for r, p in polls.items()}
    logs = {r: p.get("log") or [] for r, p in polls.items()}

    stuck: dict[int, dict | None] = {}
    for r, log in logs.items():
        open_ops = [e for e in log if e.get("end") is None]
        # the oldest open op: the later ones (work queued behind it) follow from it
        stuck[r] = min(open_ops, key=lambda e: e["start"]) if open_ops else None

    by_key: dict[tuple, dict[int, dict[int, dict]]] = {}  # (pg, ranks) -> rank -> seq -> event
    for r, log in logs.items():
        for e in log:
            by_key.setdefault(_key(e), {}).setdefault(r, {})[e["seq"]] = e

    def reached(m: int, key: tuple, seq: int) -> bool:
        counts = polls[m].get("groups") or {}
        pg, ranks = key
        # the rank's own count of ops entered on that group: exact even for ops past the log's tail
        if pg in counts and tuple(counts[pg][1]) == ranks:
            return counts[pg][0] > seq
        # else the log, which holds only its last entries
        return seq in by_key.get(key, {}).get(m, {})

    def where(m: int) -> str:
        e, p = stuck.get(m), polls[m]
        if e is not None:
            return f"waits in {e['op']} seq {e['seq']} on group {list(e['group'])}"
        state = p.get("state")
        if state == "done":
            return "finished its job"
        if state == "error":
            return "failed (" + ((p.get("error") or "").strip().splitlines() or ["?"])[-1] + ")"
        if p.get("stack"):
            return "computes at " + _last_frame(p["stack"])
        return "is in no collective"

    missing, waits_for = [], {}
    seen = {}
    for r, e in sorted(stuck.items()):
        if e is None:
            continue
        key = _key(e)
        # members that were not read are not accused
        absent = [m for m in key[1] if m != r and m in polls and not reached(m, key, e["seq"])]
        waits_for[r] = absent
        if not absent:
            continue
        # one entry per open op, however many ranks wait in it
        ident = (key, e["seq"])
        if ident in seen:
            seen[ident]["waiting"].append(r)
            continue
        seen[ident] = {
            "group": list(key[1]),
            "pg": key[0],
            "seq": e["seq"],
            "op": e["op"],
            "dim": e["dim"],
            "ranks": absent,
            "waiting": [r],
            "where": {m: where(m) for m in absent},
        }
        missing.append(seen[ident])

    renamed = []
    names: dict[tuple, dict[int, set]] = {}  # group ranks -> member -> its names for them
    for r, p in polls.items():
        for pg, ranks in (p.get("registry") or {}).items():
            names.setdefault(tuple(ranks), {}).setdefault(r, set()).add(pg)
    for ranks, per in sorted(names.items()):
        # the members know the same ranks by different names: they created their groups in different orders
        if len(per) > 1 and len({frozenset(v) for v in per.values()}) > 1:
            renamed.append({"group": list(ranks), "names": {r: sorted(v) for r, v in sorted(per.items())}})

    divergence = None
    for key, per_rank in by_key.items():
        members = [m for m in key[1] if m in per_rank]
        # the seqs any member logged, in order, up to the first where two members disagree
        for s in sorted(set().union(*[set(per_rank[m]) for m in members]) if members else []):
            have = {m: per_rank[m][s] for m in members if s in per_rank[m]}
            if len(have) > 1 and len({_sig(e) for e in have.values()}) > 1:
                start = min(e["start"] for e in have.values())
                # over all groups, the divergence that began first is the cause; the others follow from it
                if divergence is None or start < divergence["start"]:
                    divergence = {
                        "group": list(key[1]),
                        "pg": key[0],
                        "seq": s,
                        "start": start,
                        "ops": {m: _fmt(e) for m, e in sorted(have.items())},
                    }
                break

    cycle = _cycle(waits_for)
    gpu_stuck, gpu_missing = _gpu(polls, logs, where)

    lines = []
    for r in sorted(logs):
        at = f" ({hosts[r]})" if r in hosts else ""
        e = stuck[r]
        if e is not None:
            # ops entered after the oldest open one: nonblocking work queued behind it
            others = sum(1 for x in logs[r] if x.get("end") is None) - 1
            more = f" (+{others} later op(s) also open)" if others > 0 else ""
            lines.append(f"rank {r}{at}: entered and never left {_fmt(e)}{more}")
        elif r in gpu_stuck:
            g = gpu_stuck[r]
            lines.append(
                f"rank {r}{at}: on the GPU (flight recorder) {_fmt_gpu(g)} is {g['state']}, never completed"
                " (NCCL: the log's ends are enqueue times)"
            )
        else:
            done = [x for x in logs[r] if x.get("end") is not None]
            last = f"; last completed {_fmt(done[-1])}" if done else "; no collective completed"
            lines.append(f"rank {r}{at}: {where(r)}, in no collective{last}")
    for m in missing:
        lines.append(
            f"ranks {m['ranks']} never reached {m['op']} seq {m['seq']} on {m['dim']} group {m['group']}"
            f" (pg {m['pg']}), where ranks {m['waiting']} wait: "
            + "; ".join(f"rank {r} {w}" for r, w in m["where"].items())
        )
    for m in gpu_missing:
        lines.append(
            f"ranks {m['ranks']} never enqueued {m['op']} #{m['seq']} on {m['dim']} group {m['group']} (pg {m['pg']}),"
            f" where the GPUs of ranks {m['waiting']} wait: "
            + "; ".join(f"rank {r} {w}" for r, w in m["where"].items())
        )
    for g in renamed:
        lines.append(
            f"group {g['group']} has different process-group names on its ranks "
            + ", ".join(f"rank {r}: {v}" for r, v in g["names"].items())
            + ": the ranks created their groups in different orders"
        )
    if divergence:
        lines.append(
            f"first divergence on group {divergence['group']} (pg {divergence['pg']}) at seq {divergence['seq']}:"
        )
        lines.extend(f"  rank {r}: {txt}" for r, txt in divergence["ops"].items())
    if cycle:
        lines.append(
            "ranks wait on each other in a cycle: "
            + " -> ".join(str(r) for r in cycle + cycle[:1])
            + " (each waits in a collective the next one has not entered: collectives issued "
            "in different orders)"
        )
    # no rank waits in a collective: saying so spares a search of the communication
    if not any(stuck.values()) and not gpu_stuck:
        lines.append("no rank is inside a collective: the run is slow or stuck in computation, not in communication")
    return {
        "stuck": stuck,
        "missing": missing + gpu_missing,
        "gpu_stuck": gpu_stuck,
        "divergence": divergence,
        "renamed": renamed,
        "cycle": cycle,
        "text": "\n".join(lines),
    }


def _gpu(polls: dict, logs: dict, where) -> tuple[dict, list]:
    """From the flight records ('gpu', NCCL only): rank -> the oldest op its GPU has not completed,
    and one entry per such op that some members of its group never enqueued (flight.summary's
    collective sequence numbers, which count per group on every rank alike)."""
    stuck, missing, seen = {}, [], {}
    for r, p in sorted(polls.items()):
        g = p.get("gpu") or {}
        if g.get("open"):
            # the oldest op the GPU has not completed
            stuck[r] = dict(g["open"][0])
    for r, e in stuck.items():
        ranks = (polls[r].get("registry") or {}).get(e["pg"], [])
        e["group"] = list(ranks)
        e["dim"] = next((x["dim"] for x in logs[r] if str(x.get("pg")) == e["pg"]), "?")
        if e["p2p"]:
            continue  # p2p sequence numbers count per pair of ranks, not per group
        absent = [
            m
            for m in ranks
            if m != r and m in polls and (polls[m].get("gpu") or {}).get("entered", {}).get(e["pg"], 0) < e["seq"]
        ]
        if not absent:
            continue
        ident = (e["pg"], e["seq"])
        if ident in seen:
            seen[ident]["waiting"].append(r)
            continue
        seen[ident] = {
            "group": list(ranks),
            "pg": e["pg"],
            "seq": e["seq"],
            "op": e["op"],
            "dim": e["dim"],
            "ranks": absent,
            "waiting": [r],
            "where": {m: _gpu_where(m, stuck, where) for m in absent},
            "gpu": True,
        }
        missing.append(seen[ident])
    return stuck, missing


def _gpu_where(m: int, stuck: dict, where) -> str:
    if m in stuck:
        return f"its GPU waits in {_fmt_gpu(stuck[m])}"
    return where(m)


def _fmt_gpu(e: dict) -> str:
    sizes = "x".join(str(s) for s in (e.get("sizes") or [[]])[0]) if e.get("sizes") else ""
    return f"{e['op']}({sizes}) #{e['seq']} on {e.get('dim', '?')} group {e.get('group', [])} (pg {e['pg']})"


def _last_frame(stack: str) -> str:
    """'file.py:12 in fn' of the innermost frame of a formatted stack."""
    for line in reversed(stack.strip().splitlines()):
        line = line.strip()
        if line.startswith('File "'):
            path, _, rest = line[6:].partition('", line ')
            num, _, fn = rest.partition(", in ")
            return f"{path.rsplit('/', 1)[-1]}:{num} in {fn}"
    return "?"


def _cycle(waits_for: dict[int, list[int]]) -> list[int] | None:
    """A cycle in the wait-for graph (rank -> ranks it waits for), smallest rank first, or None."""
    for start in sorted(waits_for):
        path, node = [start], start
        while True:
            # only ranks that wait themselves can close a cycle
            nxt = [m for m in waits_for.get(node, []) if m in waits_for]
            if not nxt:
                break
            node = nxt[0]
            if node in path:
                loop = path[path.index(node) :]
                # from its smallest rank: a cycle reads the same whichever rank it was found from
                i = loop.index(min(loop))
                return loop[i:] + loop[:i]
            path.append(node)
    return None
