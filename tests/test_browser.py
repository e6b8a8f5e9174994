"""The dashboard in a real browser: JupyterLab on 127.0.0.1 with a token, Debian's chromium
driven by Playwright, notebooks/00_tour.ipynb executed in the page as a new user would run it
(all cells but its teardown, so the cluster stays up for the slider).

Checks that the plotly figures render (.js-plotly-plot), that the tour's layout change (dp2 x tp2)
ran, that moving the dp slider with the keyboard re-runs the layout and redraws the timeline, and
keeps a screenshot under artifacts/browser/ (git-ignored; its path is printed). Playwright's own browser download is
not available here, so chromium comes from apt (`apt-get install chromium`), as in .ci/run.
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
NOTEBOOK = ROOT / "notebooks" / "00_tour.ipynb"
TEARDOWN = "teardown"
"""Tag of the cells that close the Lab; the test leaves them out and closes it itself."""
ARTIFACTS = ROOT / "artifacts" / "browser"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]  # ARCHITECTURE.md
SLOW = 240  # seconds for the notebook's cluster to start and run under a loaded CI machine


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


@pytest.fixture
def jupyter(tmp_path):
    """JupyterLab serving a copy of the notebook, with a kernel that runs this interpreter."""
    if missing():  # only when LABKIT_REQUIRE_BROWSER=1 (else the module is skipped)
        pytest.fail(f"{missing()}; CI sets LABKIT_REQUIRE_BROWSER=1 and needs this test to run")
    root = tmp_path / "root"
    root.mkdir()
    nb = json.loads(NOTEBOOK.read_text())
    nb["cells"] = [c for c in nb["cells"] if TEARDOWN not in c.get("metadata", {}).get("tags", [])]
    (root / NOTEBOOK.name).write_text(json.dumps(nb))
    data = tmp_path / "data"
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
    labconfig = tmp_path / "config" / "labconfig"
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
        JUPYTER_CONFIG_DIR=str(tmp_path / "config"),
        JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"),
        IPYTHONDIR=str(tmp_path / "ipython"),
    )
    port, token = free_port(), secrets.token_hex(16)
    log = open(tmp_path / "jupyter.log", "w")
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
            f"--LabApp.workspaces_dir={tmp_path / 'workspaces'}",
            f"--LabApp.user_settings_dir={tmp_path / 'settings'}",
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
                    log = (tmp_path / "jupyter.log").read_text()
                    raise RuntimeError("jupyter lab did not start:\n" + log) from None
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


TIMELINE = """() => {
  const gd = [...document.querySelectorAll('.js-plotly-plot')]
    .find(g => g.layout && g.layout.title && String(g.layout.title.text || '').startsWith('Timeline'));
  return gd ? JSON.stringify({title: gd.layout.title.text, data: gd.data.map(t => [t.name, t.y, t.x])}) : null;
}"""
STATUS = "() => (document.querySelector('.labkit-status') || {}).textContent || ''"
DRAWN = """() => [...document.querySelectorAll('.js-plotly-plot')]
  .map(g => (g.layout && g.layout.title && g.layout.title.text || '') + ' [' + (g.data || []).length + ']')"""
"""Each plotly div's title and trace count, as drawn in the page."""


CONSOLE: list[str] = []
"""The page's console errors and warnings, shown when a wait fails."""


def until(page, js: str, what: str, seconds: float, arg=None) -> None:
    """Wait for a JS predicate; on timeout fail with what the page shows, its console errors
    and a screenshot."""
    try:
        page.wait_for_function(js, arg=arg, timeout=seconds * 1000)
    except Exception as e:  # playwright's TimeoutError
        shot = ARTIFACTS / "failure.png"
        page.screenshot(path=str(shot), full_page=True)
        raise AssertionError(
            f"{what}: not within {seconds} s ({type(e).__name__}); status "
            f"{page.evaluate(STATUS)!r}, figures {page.evaluate(DRAWN)}; see {shot}; console: "
            f"{CONSOLE[-12:]}"
        ) from None


def test_dashboard_renders_and_redraws_in_chromium(jupyter):
    chromium = chromium_path()
    base, token = jupyter
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shots = [ARTIFACTS / "dashboard-dp2.png", ARTIFACTS / "dashboard-dp1.png"]
    from playwright import sync_api as playwright

    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1500, "height": 2200})
            page.on(
                "console",
                lambda m: CONSOLE.append(f"{m.type}: {m.text}"[:400]) if m.type in ("error", "warning") else None,
            )
            page.on("pageerror", lambda e: CONSOLE.append(f"pageerror: {e}"[:400]))
            page.goto(f"{base}/lab/tree/{NOTEBOOK.name}?token={token}")
            page.wait_for_function(
                "() => window.jupyterapp && window.jupyterapp.shell.currentWidget "
                "&& window.jupyterapp.shell.currentWidget.sessionContext",
                timeout=SLOW * 1000,
            )
            page.evaluate(
                "async () => { const w = window.jupyterapp.shell.currentWidget;"
                " await w.context.ready; await w.sessionContext.ready; }"
            )
            page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")

            # the six figures render, and the first run finishes
            until(page, "() => document.querySelectorAll('.js-plotly-plot').length >= 6", "six plotly figures", SLOW)
            until(
                page,
                f"() => ({STATUS})().startsWith('dp2 x tp2') && ({STATUS})().includes('done')",
                "the tour's runs (dp4, then dp2 x tp2)",
                SLOW,
            )
            # every figure drawn with its title and data (not a blank plot)
            until(
                page,
                f"() => ({DRAWN})().filter(t => !t.startsWith(' ') && !t.endsWith('[0]')).length >= 6",
                "every figure drawn with data",
                60,
            )
            drawn = page.evaluate(DRAWN)
            for title in ("Memory per rank", "Communication per rank", "Traffic", "Timeline", "Mesh", "Loss"):
                assert any(t.startswith(title) for t in drawn), (title, drawn)
            raw = page.evaluate(TIMELINE)
            before = json.loads(raw)
            assert before["title"].startswith("Timeline") and before["data"]
            assert page.evaluate(STATUS).startswith("dp2 x tp2")
            page.locator(".labkit-dashboard").scroll_into_view_if_needed()
            page.screenshot(path=str(shots[0]), full_page=True)

            # move the dp slider one notch with the keyboard: dp 2 -> 1 (tp2 on ranks 0, 1), a re-run, a new timeline
            handle = page.locator(".labkit-dp .noUi-handle")
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
            assert after != before
            rows = {y for _, ys, _ in after["data"] for y in ys}
            assert rows and not any(y.startswith(("rank 2", "rank 3")) for y in rows)  # two ranks left
            assert page.locator(".js-plotly-plot").count() >= 6

            page.screenshot(path=str(shots[1]), full_page=True)
            print("\nscreenshots: " + ", ".join(map(str, shots)))

            # tear the notebook's cluster down from its own kernel before the server goes
            page.evaluate(
                "async () => { const k = window.jupyterapp.shell.currentWidget.sessionContext.session.kernel;"
                " await k.requestExecute({code: 'dash.close(); lab.close()'}).done; }"
            )
            page.evaluate("async () => { await window.jupyterapp.shell.currentWidget.sessionContext.shutdown(); }")
        finally:
            browser.close()
    assert all(shot.stat().st_size > 10_000 for shot in shots)
