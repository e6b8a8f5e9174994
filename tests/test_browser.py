"""The notebooks in a real browser: JupyterLab on 127.0.0.1 with a token, Debian's chromium
driven by Playwright, each notebook with a figure run in the page as a new user would run it
(every cell but its teardown, which the test runs itself at the end).

Every figure is scrolled into view, as a person would, and must have drawn its traces (not an
empty set of axes), fit its cell (title included) and no control label may be cut short; the
notebooks show DataFrames and progress bars. The tour (00) also moves the dashboard's dp slider
with the keyboard and sees the timeline redrawn. Screenshots go to artifacts/browser/
(git-ignored). Playwright's own browser download is not available here, so chromium comes from
apt (`apt-get install chromium`), as in .ci/run.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
TOUR = "00_tour.ipynb"
WITH_FIGURES = {  # notebook -> how many plotly figures it shows at least
    "05_pipeline.ipynb": 6,
    "08_4d_mesh.ipynb": 3,
    "10_at_scale.ipynb": 4,
    "12_your_own_model.ipynb": 4,
}
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


pytestmark = [pytest.mark.browser]
if missing() and not REQUIRED:
    pytestmark.append(pytest.mark.skip(reason=missing()))


def teardown_code(name: str) -> str:
    nb = json.loads((NOTEBOOKS / name).read_text())
    return "\n".join("".join(c["source"]) for c in nb["cells"] if TEARDOWN in c.get("metadata", {}).get("tags", []))


@pytest.fixture(scope="module")
def jupyter(tmp_path_factory):
    """JupyterLab serving copies of the notebooks without their teardown cells, with a kernel
    that runs this interpreter."""
    if missing():  # only when LABKIT_REQUIRE_BROWSER=1 (else the module is skipped)
        pytest.fail(f"{missing()}; CI sets LABKIT_REQUIRE_BROWSER=1 and needs this test to run")
    tmp = tmp_path_factory.mktemp("jupyter")
    root = tmp / "root"
    root.mkdir()
    for name in [TOUR, *WITH_FIGURES]:
        nb = json.loads((NOTEBOOKS / name).read_text())
        nb["cells"] = [c for c in nb["cells"] if TEARDOWN not in c.get("metadata", {}).get("tags", [])]
        (root / name).write_text(json.dumps(nb))
    data = tmp / "data"
    spec = data / "kernels" / "python3"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(
        json.dumps(
            {
                "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": "Python 3 (labkit test)",
                "language": "python",
            }
        )
    )
    labconfig = tmp / "config" / "labconfig"
    labconfig.mkdir(parents=True)
    (labconfig / "page_config.json").write_text(
        json.dumps(  # no "get notified about news?" toast
            {"disabledExtensions": {"@jupyterlab/apputils-extension:announcements": True}}
        )
    )
    scripts = os.pathsep.join(dict.fromkeys([sysconfig.get_path("scripts"), os.path.join(sys.base_prefix, "bin")]))
    env = dict(
        os.environ,
        PATH=scripts + os.pathsep + os.environ.get("PATH", ""),  # where jupyter-lab lives
        JUPYTER_PATH=str(data),
        LABKIT_CORES_SHARED="1",  # chromium draws on the engines' cores: 05's timing claim is test_notebooks'
        JUPYTER_CONFIG_DIR=str(tmp / "config"),
        JUPYTER_RUNTIME_DIR=str(tmp / "runtime"),
        IPYTHONDIR=str(tmp / "ipython"),
    )
    port, token = free_port(), secrets.token_hex(16)
    log = open(tmp / "jupyter.log", "w")
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jupyter",
            "lab",
            "--no-browser",
            "--allow-root",
            "--ServerApp.ip=127.0.0.1",
            f"--ServerApp.port={port}",
            f"--IdentityProvider.token={token}",
            f"--ServerApp.root_dir={root}",
            "--LabApp.expose_app_in_browser=True",
            "--LabApp.news_url=None",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
            "--LabApp.extension_manager=readonly",
            f"--LabApp.workspaces_dir={tmp / 'workspaces'}",
            f"--LabApp.user_settings_dir={tmp / 'settings'}",
        ],
        cwd=root,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=5)
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("jupyter lab did not start:\n" + (tmp / "jupyter.log").read_text()) from None
                time.sleep(0.5)
        yield base, token
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)  # the server, and any kernel it still has
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
        log.close()


@pytest.fixture(scope="module")
def browser():
    from playwright import sync_api as playwright

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with playwright.sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS, headless=True)
        try:
            yield b
        finally:
            b.close()


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


TIMELINE = """() => {
  const gd = [...document.querySelectorAll('.js-plotly-plot')]
    .find(g => g.layout && g.layout.title && String(g.layout.title.text || '').startsWith('Timeline'));
  return gd ? JSON.stringify({title: gd.layout.title.text, data: gd.data.map(t => [t.name, t.y, t.x])}) : null;
}"""


def test_the_tour_draws_and_redraws_the_dashboard(browser, jupyter):
    page = open_and_run(browser, jupyter, TOUR)
    try:
        wait_ran(page, TOUR)
        until(
            page,
            f"() => ({STATUS})().startsWith('dp2 x tp2') && ({STATUS})().includes('done')",
            "the tour's runs (dp4, then dp2 x tp2)",
            SLOW,
        )
        figs = check_figures(page, TOUR, 6)
        for title in ("Memory per rank", "Communication per rank", "Traffic", "Timeline", "Mesh", "Loss"):
            assert any(f["title"].startswith(title) for f in figs), (title, figs)
        assert page.locator("table.dataframe").count() >= 2, "the tour's tables show as DataFrames"
        assert page.locator(".labkit-progress").count() >= 2, "the Lab's start and its run show progress bars"
        raw = page.evaluate(TIMELINE)
        before = json.loads(raw)
        assert before["title"].startswith("Timeline") and before["data"]

        # move the dp slider one notch with the keyboard: dp 2 -> 1 (tp2 on ranks 0, 1), a re-run, a new timeline
        handle = page.locator(".labkit-dp .noUi-handle")
        handle.scroll_into_view_if_needed()
        handle.focus()
        page.keyboard.press("ArrowLeft")
        until(
            page,
            f"() => ({STATUS})().startsWith('tp2') && ({STATUS})().includes('done')",
            "the run after the slider moved",
            SLOW,
        )
        until(page, f"(old) => ({TIMELINE})() !== old", "the timeline redrawn", 60, arg=raw)
        after = json.loads(page.evaluate(TIMELINE))
        rows = {y for _, ys, _ in after["data"] for y in ys}
        assert rows and not any(y.startswith(("rank 2", "rank 3")) for y in rows)  # two ranks left
        page.locator(".labkit-dashboard").scroll_into_view_if_needed()
        page.screenshot(path=str(ARTIFACTS / "dashboard-dp1.png"))
    finally:
        finish(page, TOUR)


@pytest.mark.parametrize("name", sorted(WITH_FIGURES), ids=lambda n: Path(n).stem)
def test_every_figure_draws(browser, jupyter, name):
    if not (NOTEBOOKS / name).exists():
        pytest.fail(f"{name} is missing")
    page = open_and_run(browser, jupyter, name)
    try:
        wait_ran(page, name)
        check_figures(page, name, WITH_FIGURES[name])
        if name != "10_at_scale.ipynb":  # 10 shows the theory's plans, no run of its own to speak of
            assert page.locator(".labkit-progress").count() >= 1, f"{name}: no progress bar"
        assert page.locator("table.dataframe").count() >= 1, f"{name}: no table shown as a DataFrame"
    finally:
        finish(page, name)
    print(f"\n{name}: screenshots in {ARTIFACTS}")
