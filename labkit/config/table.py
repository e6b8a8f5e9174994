"""Tables as a notebook user expects them: rows that display as a pandas DataFrame.

Every table labkit returns (a run's or a measurement's comm and memory tables, an estimate's,
the plans) is a `Rows`: a list of plain dict rows, so it compares with `==`, iterates, and goes
to JSON as before, and a notebook shows it as a DataFrame (`rows.df` is that DataFrame). `card`
is the small HTML summary that Lab, results, measurements and estimates show as their rich repr.
Plain data: the bottom rung of the ladder; pandas is imported only when a table is shown.
"""

from __future__ import annotations

import html


class Rows(list):
    """A list of dict rows that displays as a pandas DataFrame (`.df`)."""

    @property
    def df(self):
        """The rows as a pandas DataFrame, one column per key."""
        import pandas as pd  # deferred: ~100 ms, and only a displayed table needs it

        return pd.DataFrame(list(self))

    def _repr_html_(self) -> str:
        return self.df._repr_html_()


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB' (powers of 1024, as memory is counted)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.0f} B" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return str(n)


def card(title: str, facts: list[tuple[str, str]], tables: list[tuple[str, Rows]] = ()) -> str:
    """An HTML summary: a title, a two-column list of facts (name, value; values are escaped),
    and small tables under their captions."""
    rows = "".join(
        f"<tr><th style='text-align:left;padding-right:1em'>{html.escape(k)}</th>"
        f"<td style='text-align:left'>{html.escape(v)}</td></tr>"
        for k, v in facts
    )
    parts = [f"<div class='labkit-card'><b>{html.escape(title)}</b><table>{rows}</table>"]
    for caption, t in tables:
        if t:
            parts.append(f"<div style='margin-top:6px'><i>{html.escape(caption)}</i>{t._repr_html_()}</div>")
    parts.append("</div>")
    return "".join(parts)
