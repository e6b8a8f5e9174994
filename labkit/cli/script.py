"""`labkit torchrun`: a training script run on a local Lab as torchrun would run it, measured.

    labkit torchrun --engines 4 train.py --steps 3                 # torchrun --nproc-per-node 4 train.py --steps 3
    labkit torchrun --engines 4 --report report.html -m pkg.train  # python -m pkg.train on every rank, an HTML report

Every flag after the script is the script's. Each rank's lines are printed as they come, with its rank
(`[rank1]:...`); then each rank's exit code, steps, memory and what it sent. Exits 0 when every rank's
script did, 1 otherwise (torchrun's ChildFailedError: the summary on stderr), 2 for a refused call.
"""

from __future__ import annotations

import argparse
import html
import sys

from labkit.cluster.errors import CollectiveTimeout, ScriptFailed
from labkit.config.table import human_bytes


def add(sub) -> None:
    """The `torchrun` subcommand on the CLI's subparsers."""
    tr = sub.add_parser("torchrun", help="run a training script on a local Lab as torchrun would, measured")
    tr.add_argument("--engines", type=int, default=4, help="ranks (torchrun's --nproc-per-node)")
    tr.add_argument("--timeout", type=float, default=300.0, help="seconds before a hang is diagnosed")
    tr.add_argument("--report", default=None, help="write a self-contained HTML report here")
    tr.add_argument("--trace", default=None, help="write a Chrome/Perfetto trace JSON here")
    tr.add_argument("-m", dest="module", action="store_true", help="run the script as a module (python -m)")
    tr.add_argument("script", help="the script's path (or, with -m, its module)")
    tr.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    tr.set_defaults(fn=cmd_torchrun)


def cmd_torchrun(ns: argparse.Namespace) -> int:
    from labkit.cluster.lab import Lab  # deferred: ipyparallel, so that `labkit estimate` starts fast

    with Lab(engines=ns.engines, device="cpu", timeout=ns.timeout, progress=True) as lab:
        try:
            res = lab.torchrun(ns.script, *ns.args, module=ns.module)
        except ScriptFailed as e:
            print(f"labkit torchrun: {e}", file=sys.stderr)
            return 1
        except CollectiveTimeout as e:
            print(f"labkit torchrun: {e}", file=sys.stderr)
            return 1
    print(res.command)
    for rk, code, steps in zip(res.ranks, res.exit_codes, res.steps_seen):
        mem = ", ".join(f"{k} {human_bytes(v)}" for k, v in rk.memory.items())
        print(f"rank {rk.rank}: exit {code}, {steps} steps; {mem}; process peak {human_bytes(res.rss[rk.rank])}")
    for row in res.comm_table(step=None):
        print(
            f"rank {row['rank']} {row['dim']:>8} {row['op']:<15} {row['calls']:>4} calls "
            f"{human_bytes(row['wire_bytes'])} sent"
        )
    if ns.report:
        write_report(ns.report, res)
        print(f"report written to {ns.report}")
    if ns.trace:
        res.save_trace(ns.trace)
        print(f"trace written to {ns.trace} (open in ui.perfetto.dev)")
    return 0


def write_report(path: str, res) -> None:
    """One self-contained HTML page: the command, each rank's exit code and steps, every figure."""
    from labkit.widgets.figures import report_figures  # deferred: plotly

    parts = []
    for i, (name, fig) in enumerate(report_figures(res).items()):
        parts.append(f'<section id="{name}">' + fig.to_html(full_html=False, include_plotlyjs=(i == 0)) + "</section>")
    head = (
        f"<h1>labkit torchrun</h1><p><code>{html.escape(res.command)}</code>: exit codes {res.exit_codes}, "
        f"steps {res.steps_seen}, {res.wall_seconds:.1f} s</p>"
    )
    with open(path, "w") as f:
        f.write(
            "<!DOCTYPE html><html><head><meta charset='utf-8'><title>labkit torchrun</title></head><body>"
            + head
            + "\n".join(parts)
            + "</body></html>"
        )
