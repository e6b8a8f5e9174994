"""torchrun's error summary for a failed script: which rank failed first, its exit code and
traceback, and which ranks the Lab stopped after it (torch/distributed/elastic/multiprocessing/errors
ChildFailedError.format_msg: 'Root Cause (first observed failure)', 'Other Failures'). Pure."""

from __future__ import annotations

import signal
import time


def _code(code) -> str:
    if code is None:
        return "no exit code (its engine went away)"
    if code < 0:
        try:
            return f"{code} ({signal.Signals(-code).name})"
        except ValueError:
            return str(code)
    return str(code)


def first_failure(reports: dict[int, dict | None], failures: dict[int, dict]) -> int:
    """The rank whose script failed first on its own (by the time it raised, else exited), among
    those that failed; a rank with no report (its script never started) first of all."""
    own = [r for r in failures if reports.get(r) is None]
    if own:
        return min(own)
    at = {r: ((reports[r].get("failure") or {}).get("at") or reports[r].get("ended") or 0.0) for r in failures}
    return min(at, key=lambda r: (at[r], r))


def summary(
    name: str, reports: dict[int, dict | None], *, failures: dict[int, dict], stopped: list[int]
) -> tuple[str, int]:
    """(the message, the first rank): reports: rank -> its agent's report (None: none came back);
    failures: rank -> {'host', 'traceback'} of the ranks that failed on their own (RankError's)."""
    first = first_failure(reports, failures)
    rep = reports.get(first)
    bar = "-" * 60
    lines = [f"{name} FAILED", bar, "Root Cause (first observed failure):", "[0]:"]
    if rep is None:
        lines += [f"  rank      : {first}", f"  host      : {failures[first]['host']}", "  error     :"]
        lines += ["    " + ln for ln in failures[first]["traceback"].strip().splitlines()[-12:]]
    else:
        fail = rep.get("failure") or {}
        when = fail.get("at") or rep.get("ended")
        lines += [
            f"  time      : {time.strftime('%Y-%m-%d_%H:%M:%S', time.localtime(when)) if when else '?'}",
            f"  host      : {rep['host']}",
            f"  rank      : {first}",
            f"  exitcode  : {_code(rep['exit_code'])} (pid: {rep['pid']})",
            # torchrun keeps its error files; the Lab's is read into the traceback, then removed with the call's files
            f"  error_file: {fail['error_file'] + ' (removed with the call)' if 'error_file' in fail else '<N/A>'}",
            "  traceback :" + ("" if fail.get("traceback") else " <none: the last lines of its stderr>"),
        ]
        text = fail.get("traceback") or "".join(rep["stderr"].splitlines(True)[-15:])
        lines += ["    " + ln for ln in text.rstrip().splitlines()]
    others = [r for r in sorted(failures) if r != first]
    if others:
        lines += [bar, "Other Failures:"]
        for i, r in enumerate(others, 1):
            o = reports.get(r)
            last = (failures[r]["traceback"].strip().splitlines() or ["?"])[-1]
            code = _code(o["exit_code"]) if o else "?"
            lines.append(f"[{i}]: rank {r} on {failures[r]['host']}: exitcode {code}: {last}")
    if stopped:
        lines += [bar, f"Stopped by the Lab after the first failure (SIGTERM, then SIGKILL): ranks {sorted(stopped)}"]
    lines += [bar, "(the Lab is ready for the next call; the error's .result holds what every rank did)"]
    return "\n".join(lines), first
