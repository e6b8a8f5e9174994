"""Hang diagnosis from the ranks' collective logs (the analysis PyTorch's flight recorder tools do).

Each rank logs every op when it is entered and when it is left, with its group and a sequence
number per group. When a run stops making progress, the Lab reads the logs of every rank (the
engines still answer: work runs in a job thread) and this module says:
  - per rank, the op it entered and never left (op, dim, group, sequence number, shape);
  - which members of that group never reached that op, and where they are instead;
  - the first point where two ranks' sequences on one group differ (op, size or order).
Pure Python: it reads plain dicts.
"""
from __future__ import annotations


def _sig(e: dict) -> tuple:
    return (e["op"], e.get("numel"), e.get("dtype"))


def _fmt(e: dict) -> str:
    shape = "x".join(str(s) for s in e.get("shape") or []) or str(e.get("numel"))
    peer = f" peer {e['peer']}" if e.get("peer") is not None else ""
    return f"{e['op']}({shape} {e.get('dtype', '')}) on {e['dim']} group {e['group']}{peer}, seq {e['seq']}"


def analyse(logs: dict[int, list[dict]], hosts: dict[int, str] | None = None) -> dict:
    """logs: rank -> that rank's collective log (oldest first). Returns a dict with 'stuck'
    (rank -> first open op or None), 'missing' (list of {group, seq, op, ranks}), 'divergence'
    (first mismatch per group or None) and 'text' (the human summary)."""
    hosts = hosts or {}
    stuck: dict[int, dict | None] = {}
    for r, log in logs.items():
        open_ops = [e for e in log if e.get("end") is None]
        stuck[r] = min(open_ops, key=lambda e: e["start"]) if open_ops else None

    # each rank's ops per group, by sequence number
    per_group: dict[tuple, dict[int, dict[int, dict]]] = {}
    for r, log in logs.items():
        for e in log:
            per_group.setdefault(tuple(e["group"]), {}).setdefault(r, {})[e["seq"]] = e

    missing = []
    for r, e in stuck.items():
        if e is None:
            continue
        g = tuple(e["group"])
        absent = [m for m in g if m in logs and e["seq"] not in per_group.get(g, {}).get(m, {})]
        if absent:
            missing.append({"group": list(g), "seq": e["seq"], "op": e["op"], "dim": e["dim"], "ranks": absent})

    divergence = None
    for g, by_rank in sorted(per_group.items()):
        members = [m for m in g if m in by_rank]
        if len(members) < 2:
            continue
        seqs = sorted(set().union(*[set(by_rank[m]) for m in members]))
        for s in seqs:
            have = {m: by_rank[m][s] for m in members if s in by_rank[m]}
            if len(have) == len(members) and len({_sig(e) for e in have.values()}) > 1:
                divergence = {"group": list(g), "seq": s, "ops": {m: _fmt(e) for m, e in have.items()}}
                break
        if divergence:
            break

    lines = []
    for r in sorted(logs):
        where = f" ({hosts[r]})" if r in hosts else ""
        e = stuck[r]
        if e is not None:
            lines.append(f"rank {r}{where}: waiting in {_fmt(e)}")
        else:
            last = logs[r][-1] if logs[r] else None
            lines.append(f"rank {r}{where}: in no collective" +
                         (f"; last completed {_fmt(last)}" if last else "; no collective yet"))
    for m in missing:
        lines.append(f"ranks {m['ranks']} never reached {m['op']} seq {m['seq']} on {m['dim']} group {m['group']}")
    if divergence:
        lines.append(f"first divergence on group {divergence['group']} at seq {divergence['seq']}:")
        lines.extend(f"  rank {r}: {txt}" for r, txt in sorted(divergence["ops"].items()))
    if not any(stuck.values()):
        lines.append("no rank is inside a collective: the run is slow or stuck in computation, not in communication")
    return {"stuck": stuck, "missing": missing, "divergence": divergence, "text": "\n".join(lines)}
