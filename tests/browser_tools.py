"""What tests/test_browser.py drives the page with: Debian's chromium found and launched without network
or sandbox, a notebook opened and run in JupyterLab, waits that fail with what the page shows, its
figures measured (drawn, within their cell), one number read from a figure's plotly data and the same
expression asked of the notebook's kernel, and a dashboard's controls moved as a person moves them."""

from __future__ import annotations

import json
import os
import shutil
import socket
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
TEARDOWN = "teardown"
"""Tag of the cells that close the Lab; the page runs every other cell, the test runs these last."""
ARTIFACTS = ROOT / "artifacts" / "browser"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]  # ARCHITECTURE.md
SLOW = 300  # seconds for a notebook's cluster to start and its cells to run on a loaded CI machine
VIEWPORT = {"width": 1280, "height": 900}
"""An ordinary laptop window: the figures and controls must fit it."""


def chromium_path() -> str | None:
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


IN_THE_BROWSER = (
    "00_tour.ipynb",
    "05_pipeline.ipynb",
    "08_4d_mesh.ipynb",
    "10_at_scale.ipynb",
    "12_your_own_model.ipynb",
    "13_is_my_plan_right.ipynb",
    "14_your_job.ipynb",
    "15_fine_grained_moe.ipynb",
)
"""The notebooks tests/test_browser.py runs whole in JupyterLab (every cell but the teardown, its asserts
included, no cell may fail); tests/test_notebooks.py leaves them to it where it runs (each
notebook's cluster work once per suite)."""

REQUIRED = os.environ.get("LABKIT_REQUIRE_BROWSER") == "1"
"""Set by .ci/run: CI must run this test, so a missing chromium or Playwright fails it there
instead of skipping it."""


def missing() -> str | None:
    """Why the test cannot run here, or None."""
    if chromium_path() is None:
        return "no chromium on PATH: apt-get install -y chromium (Playwright's own browser download is not used)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed (pip install playwright)"
    return None


def teardown_code(name: str) -> str:
    nb = json.loads((NOTEBOOKS / name).read_text())
    return "\n".join("".join(c["source"]) for c in nb["cells"] if TEARDOWN in c.get("metadata", {}).get("tags", []))


CONSOLE: list[str] = []
"""The page's console errors and warnings, shown when a wait fails."""
STATUS = "() => (document.querySelector('.labkit-status') || {}).textContent || ''"
FIGURES = """() => [...document.querySelectorAll('.js-plotly-plot')].map(g => {
  const full = g._fullLayout, out = g.closest('.jp-OutputArea-output') || g.parentElement;
  const title = g.querySelector('.gtitle');
  return {title: String(g.layout && g.layout.title && (g.layout.title.text || g.layout.title) || ''),
          traces: (g.data || []).length,
          drawn: g.querySelectorAll('.trace, .hm, .point').length,
          notes: [...g.querySelectorAll('.annotation-text')].filter(a => a.textContent.trim()).length,
          width: full ? full.width : 0, cell: out.clientWidth,
          titleRight: title ? title.getBoundingClientRect().right - g.getBoundingClientRect().left : 0};
})"""
"""Each plotly figure in the page: its title, traces given and drawn, notes drawn, width against its cell's."""
DRAWN = "(f) => f && ((f.traces > 0 && f.drawn > 0) || (f.traces === 0 && f.notes > 0))"
"""A figure drew its traces, or, when it has none on purpose (a panel with nothing to show, e.g. a
measurement's loss), the note that says so: either is plotly's drawing of the synced figure."""
CUT_LABELS = """() => [...document.querySelectorAll(
    '.widget-label, .widget-toggle-button, .widget-button, .widget-checkbox label, .widget-readout')]
  .filter(e => e.offsetParent !== null && e.scrollWidth > e.clientWidth + 1)
  .map(e => (e.textContent || '').trim())"""
"""Visible control labels whose text does not fit (shown with an ellipsis, or cut)."""


def until(page, js: str, what: str, seconds: float, arg=None) -> None:
    """Wait for a JS predicate; on timeout fail with what the page shows, its console errors
    and a screenshot."""
    try:
        page.wait_for_function(js, arg=arg, timeout=seconds * 1000)
    except Exception as e:  # playwright's TimeoutError
        shot = ARTIFACTS / "failure.png"
        page.screenshot(path=str(shot), full_page=True)
        raise AssertionError(
            f"{what}: not within {seconds} s ({type(e).__name__}); status {page.evaluate(STATUS)!r}, "
            f"figures {page.evaluate(FIGURES)}; see {shot}; console: {CONSOLE[-12:]}"
        ) from None


def open_and_run(browser, jupyter, name: str):
    """A page with `name` open, its cells run (all but the teardown) until the kernel is idle."""
    base, token = jupyter
    page = browser.new_page(viewport=VIEWPORT)
    page.on(
        "console",
        lambda m: CONSOLE.append(f"{m.type}: {m.text}"[:400]) if m.type in ("error", "warning") else None,
    )
    page.on("pageerror", lambda e: CONSOLE.append(f"pageerror: {e}"[:400]))
    # ?reset: a fresh workspace, else JupyterLab reopens the previous page's notebooks beside this
    # one (each with a kernel) and run-all can land on whichever of them is current at that moment
    page.goto(f"{base}/lab/tree/{name}?reset&token={token}")
    page.wait_for_function(
        "(name) => window.jupyterapp && window.jupyterapp.shell.currentWidget "
        "&& window.jupyterapp.shell.currentWidget.sessionContext "
        "&& window.jupyterapp.shell.currentWidget.context.path === name",
        arg=name,
        timeout=SLOW * 1000,
    )
    page.evaluate(
        "async () => { const w = window.jupyterapp.shell.currentWidget;"
        " await w.context.ready; await w.sessionContext.ready; }"
    )
    page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
    return page


RAN = """() => { const w = window.jupyterapp.shell.currentWidget;
  const cells = [...w.content.widgets].filter(c => c.model.type === 'code');
  const failed = cells.find(c => c.model.outputs.toJSON().some(o => o.output_type === 'error'));
  if (failed) return 'error';
  return w.sessionContext.session.kernel.status === 'idle' && cells.every(c => c.model.executionCount) ? 'done' : '';
}"""
ERRORS = """() => [...window.jupyterapp.shell.currentWidget.content.widgets]
  .flatMap(c => c.model.type === 'code' ? c.model.outputs.toJSON() : [])
  .filter(o => o.output_type === 'error').map(o => o.ename + ': ' + o.evalue)"""


def wait_ran(page, name: str) -> None:
    until(page, f"() => ({RAN})() !== ''", f"{name}: every cell run", SLOW)
    errors = page.evaluate(ERRORS)
    assert not errors, f"{name}: a cell failed in the browser: {errors}"


def check_figures(page, name: str, at_least: int) -> list[dict]:
    """Scroll each figure into view and wait for it to draw its traces; then every figure fits
    its cell (its title too) and no control label is cut. Screenshots under artifacts/."""
    stem = Path(name).stem
    plots = page.locator(".js-plotly-plot")
    count = plots.count()
    assert count >= at_least, f"{name}: {count} figures in the page, expected at least {at_least}"
    for i in range(count):
        plots.nth(i).scroll_into_view_if_needed()
        until(
            page,
            f"(i) => ({DRAWN})(({FIGURES})()[i])",
            f"{name}: figure {i} drawn",
            30,
            arg=i,
        )
        plots.nth(i).screenshot(path=str(ARTIFACTS / f"{stem}-figure{i}.png"))
    figs = page.evaluate(FIGURES)
    for f in figs:
        assert (f["traces"] > 0 and f["drawn"] > 0) or (f["traces"] == 0 and f["notes"] > 0), (name, f)
        assert f["width"] <= f["cell"] + 1, f"{name}: {f['title']!r} is {f['width']} px wide in a {f['cell']} px cell"
        assert f["titleRight"] <= f["width"] + 1, f"{name}: the title of {f['title']!r} is cut"
    cut = page.evaluate(CUT_LABELS)
    assert not cut, f"{name}: control labels cut short: {cut}"
    page.screenshot(path=str(ARTIFACTS / f"{stem}.png"), full_page=True)
    return figs


def finish(page, name: str) -> None:
    """Run the notebook's teardown in its own kernel (it closes the Lab), then stop the kernel."""
    page.evaluate(
        "async (code) => { const k = window.jupyterapp.shell.currentWidget.sessionContext.session.kernel;"
        " await k.requestExecute({code}).done; }",
        teardown_code(name),
    )
    page.evaluate("async () => { await window.jupyterapp.shell.currentWidget.sessionContext.shutdown(); }")
    page.close()


FIGURE_DATA = """(title) => {
  const gd = [...document.querySelectorAll('.js-plotly-plot')]
    .find(g => g.layout && g.layout.title && String(g.layout.title.text || '').startsWith(title));
  const row = (v) => (v != null && typeof v === 'object' ? Array.from(v) : v);
  const list = (a) => (a == null ? null : Array.from(a, row));
  // _fullData: what plotly drew, numpy's base64 arrays (plotly.py's {dtype, bdata, shape}) decoded
  return gd ? gd._fullData.map(t => ({name: t.name, x: list(t.x), y: list(t.y), z: list(t.z)})) : null;
}"""
"""The data plotly drew in the figure whose title starts with `title` (typed arrays as lists)."""
KERNEL_VALUE = """async (expr) => {
  const k = window.jupyterapp.shell.currentWidget.sessionContext.session.kernel;
  const ask = {code: '', silent: true, store_history: false, user_expressions: {v: expr}};
  const reply = await k.requestExecute(ask).done;
  const v = reply.content.user_expressions.v;
  return v.status === 'ok' ? v.data['text/plain'] : 'error: ' + v.ename + ': ' + v.evalue;
}"""
"""`expr` evaluated in the notebook's kernel, as text."""


def drawn_number(traces: list[dict], what: tuple) -> float:
    """One number a figure draws: (trace, 'x' | 'y', index), (trace, 'x@y' | 'y@x', category) for the
    value at a category, (trace, 'z', (row, column)), or (trace, 'z-sum', a row's y label)."""
    name, how, at = what
    t = next(t for t in traces if t["name"] == name)
    if how in ("x", "y"):
        return t[how][at]
    if how == "x@y":
        return t["x"][t["y"].index(at)]
    if how == "y@x":
        return t["y"][t["x"].index(at)]
    if how == "z":
        return t["z"][at[0]][at[1]]
    return sum(t["z"][t["y"].index(at)])  # 'z-sum'


def check_drawn_numbers(page, name: str, numbers: list) -> list[tuple]:
    """Each (figure title, what it draws, the kernel's expression) of `numbers`: the number drawn
    equals the kernel's number from the run."""
    seen = []
    for title, what, expr in numbers:
        traces = page.evaluate(FIGURE_DATA, title)
        assert traces, f"{name}: no figure titled {title!r}"
        got = drawn_number(traces, what)
        text = page.evaluate(KERNEL_VALUE, f"float({expr})")
        assert not text.startswith("error"), f"{name}: {expr}: {text}"
        assert got == pytest.approx(float(text), rel=1e-9), (name, title, what, got, text)
        seen.append((title.split("<br>")[0], what[0], got))
    return seen


TIMELINE = """() => {
  const gd = [...document.querySelectorAll('.js-plotly-plot')]
    .find(g => g.layout && g.layout.title && String(g.layout.title.text || '').startsWith('Timeline'));
  return gd ? JSON.stringify({title: gd.layout.title.text, data: gd.data.map(t => [t.name, t.y, t.x])}) : null;
}"""


COMM = """() => {
  const gd = [...document.querySelectorAll('.js-plotly-plot')]
    .find(g => g.layout && g.layout.title && String(g.layout.title.text || '').startsWith('Communication per rank'));
  return gd ? gd.data.map(t => t.name) : [];
}"""
"""The series of the dashboard's communication figure: '<op> [<dim>]'."""


def settle(page, layout: str, what: str) -> None:
    """Wait until the dashboard's status says `layout` (its first words) is done: run and drawn."""
    until(page, f"(w) => ({STATUS})().startsWith(w) && ({STATUS})().includes('done')", what, SLOW, arg=layout)


def notch(page, field: str, key: str, times: int = 1) -> None:
    """Move a control's slider with the keyboard, as a person would: one option per key press."""
    handle = page.locator(f".labkit-{field.replace('_', '-')} .noUi-handle")
    handle.scroll_into_view_if_needed()
    handle.focus()
    for _ in range(times):
        page.keyboard.press(key)


def choose(page, field: str, option: str) -> None:
    """Click one of a control's toggle buttons."""
    page.locator(f".labkit-{field.replace('_', '-')}").get_by_role("button", name=option, exact=True).click()
