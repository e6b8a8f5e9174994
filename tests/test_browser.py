"""The notebooks in a real browser: JupyterLab on 127.0.0.1 with a token, Debian's chromium
driven by Playwright, each notebook with a figure run in the page as a new user would run it
(every cell but its teardown, which the test runs itself at the end).

Every figure is scrolled into view, as a person would, and must have drawn its traces (not an
empty set of axes), fit its cell (title included) and no control label may be cut short; the
notebooks show progress bars, and those whose results are tables show DataFrames. In 13, 14 and
15 one number drawn in each of their figures is read from the page's plotly data and held to the
run it came from, asked of the notebook's own kernel. The tour (00) also moves the dashboard's dp
slider with the keyboard and sees the timeline redrawn, then changes dp_replicate and cp_kind
through the page's controls and sees the communication and memory figures redrawn. Screenshots go
to artifacts/browser/ (git-ignored). Playwright's own browser download is not available here, so
chromium comes from apt (`apt-get install chromium`), as in .ci/run.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import sysconfig
import time
import urllib.request
from pathlib import Path

import pytest
from browser_tools import (
    ARTIFACTS,
    CHROMIUM_ARGS,
    COMM,
    FIGURE_DATA,
    IN_THE_BROWSER,
    REQUIRED,
    TEARDOWN,
    TIMELINE,
    check_drawn_numbers,
    check_figures,
    choose,
    chromium_path,
    finish,
    free_port,
    missing,
    notch,
    open_and_run,
    settle,
    until,
    wait_ran,
)

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
TOUR = "00_tour.ipynb"
WORST = "__import__('labkit.widgets.verify_figure', fromlist=['worst_ratios']).worst_ratios"
WITH_FIGURES = {  # notebook -> how many plotly figures it shows at least
    "05_pipeline.ipynb": 6,
    "08_4d_mesh.ipynb": 3,
    "10_at_scale.ipynb": 4,
    "12_your_own_model.ipynb": 4,
    "13_is_my_plan_right.ipynb": 6,
    "14_your_job.ipynb": 4,
    "15_fine_grained_moe.ipynb": 3,
}
NUMBERS = {  # notebook -> (a figure's title, what it draws, the same number from the run, in the kernel)
    "13_is_my_plan_right.ipynb": [
        (
            "verify OK on dp=2, tp=2",
            ("gradients", "x", 0),
            "right.rows[0]['gradient error'] / right.rows[0]['gradient bound']",
        ),
        (
            "verify FAILED on dp=2, tp=2<br><sup>first failure: [gradient replicas]",
            ("replicas per rank", "z-sum", "gradient replicas"),
            "sum(f.check == 'gradient replicas' for f in no_sp_norms.findings)",
        ),
        (
            "verify FAILED on dp=2, tp=2<br><sup>first failure: [plan] nrom",
            ("gradients", "x@y", "model.norm.weight"),
            "next(r['gradient error'] / r['gradient bound'] for r in typo_report.rows"
            " if r['tensor'] == 'model.norm.weight')",
        ),
        ("3 of 3 plans fail", ("gradients", "y@x", "summed"), f"{WORST}(summed)['gradients']"),
        ("verify FAILED on dp=4", ("parameters", "x", 0), "repeated.rows[0]['final error'] / repeated.bounds.params"),
        ("All 4 plans pass", ("gradients", "y@x", "FSDP2"), f"{WORST}(fixed['FSDP2'])['gradients']"),
    ],
    "14_your_job.ipynb": [
        (
            "llama3_70b.toml's layout ranks",
            ("llama3_70b.toml's layout", "x", 0),
            "full['titan'][2].tokens_per_second_per_gpu",
        ),
        (
            "megatron_llama31_405b.sh's layout ranks",
            ("megatron_llama31_405b.sh's layout", "x", 0),
            "full['megatron'][2].tokens_per_second_per_gpu",
        ),
        ("Which dims cross nodes", ("pp across nodes", "x", 0), "len(layout.spans_hosts(['pp'], hosts))"),
    ],
    "15_fine_grained_moe.ipynb": [
        (
            "Tokens that leave their node",
            ("unlimited: tokens reaching 2+ nodes", "y", 0),
            "crossing(free[0])['tokens reaching 2+ nodes']",
        ),
        # step 0, block 1, rank 0: the rows the one-process routing (counts) sends to rank 0's two experts
        ("Rows each rank's experts receive", ("bias moving (γ = 0.05)", "z", (0, 0)), "sum(counts[0][:per_rank])"),
    ],
}
"""Each new figure of 13, 14 and 15: one number it draws, and the expression that gives the same number
from the run (or the reference routing) in the notebook's kernel."""
assert {TOUR, *WITH_FIGURES} == set(IN_THE_BROWSER)  # test_notebooks.py leaves these to this test
WITH_TABLES = {"05_pipeline.ipynb", "08_4d_mesh.ipynb", "10_at_scale.ipynb", "12_your_own_model.ipynb"}
"""The notebooks whose results include a table; 13, 14 and 15 draw theirs."""

pytestmark = [pytest.mark.browser]
if missing() and not REQUIRED:
    pytestmark.append(pytest.mark.skip(reason=missing()))


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
    # the notebooks read their data where the repository keeps it, beside them: 14's jobs are ../tests/data/jobs
    (tmp / "tests").symlink_to(NOTEBOOKS.parent / "tests")
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


@pytest.fixture(scope="module")
def tour(browser, jupyter):
    """The tour's page, every cell run and its dashboard's two layouts drawn (dp4, then dp2 x tp2); the
    tests below go on from one another's last layout; its Lab closes at the end."""
    page = open_and_run(browser, jupyter, TOUR)
    try:
        wait_ran(page, TOUR)
        settle(page, "dp2 x tp2", "the tour's runs (dp4, then dp2 x tp2)")
        yield page
    finally:
        finish(page, TOUR)


def test_the_tour_draws_and_redraws_the_dashboard(tour):
    page = tour
    figs = check_figures(page, TOUR, 6)
    for title in ("Memory per rank", "Communication per rank", "Traffic", "Timeline", "Mesh", "Loss"):
        assert any(f["title"].startswith(title) for f in figs), (title, figs)
    assert page.locator("table.dataframe").count() >= 2, "the tour's tables show as DataFrames"
    assert page.locator(".labkit-progress").count() >= 2, "the Lab's start and its run show progress bars"
    raw = page.evaluate(TIMELINE)
    before = json.loads(raw)
    assert before["title"].startswith("Timeline") and before["data"]

    # move the dp slider one notch with the keyboard: dp 2 -> 1 (tp2 on ranks 0, 1), a re-run, a new timeline
    notch(page, "dp", "ArrowLeft")
    settle(page, "tp2", "the run after the slider moved")
    until(page, f"(old) => ({TIMELINE})() !== old", "the timeline redrawn", 60, arg=raw)
    after = json.loads(page.evaluate(TIMELINE))
    rows = {y for _, ys, _ in after["data"] for y in ys}
    assert rows and not any(y.startswith(("rank 2", "rank 3")) for y in rows)  # two ranks left
    page.locator(".labkit-dashboard").scroll_into_view_if_needed()
    page.screenshot(path=str(ARTIFACTS / "dashboard-dp1.png"))


def test_the_dashboard_redraws_for_hsdp_and_a_cp_kind(tour):
    """Through the page's own controls, from the last layout (tp2 on two ranks): dp over the four
    engines sharded by FSDP, then HSDP (dp_replicate=2: the comm figure's dp splits into dp_shard and
    dp_replicate, and each rank holds twice FSDP's parameters), then cp=2, the ring's sends becoming an
    all-gather on cp when cp_kind changes."""
    page = tour
    notch(page, "tp", "ArrowLeft")
    settle(page, "1 rank", "tp back to 1")
    notch(page, "dp", "ArrowRight", times=2)  # dp 1 -> 2 -> 4
    settle(page, "dp4:", "dp over the four engines")
    choose(page, "sharding", "fsdp")
    settle(page, "dp4, sharding=fsdp:", "FSDP")
    assert "all_gather [dp]" in page.evaluate(COMM)
    memory = page.evaluate(FIGURE_DATA, "Memory per rank")
    notch(page, "dp_replicate", "ArrowRight")
    settle(page, "dp4, sharding=fsdp, dp_replicate=2:", "HSDP")
    until(page, f"() => ({COMM})().some(n => n.endsWith('[dp_replicate]'))", "the comm figure with HSDP", 60)
    names = page.evaluate(COMM)
    assert "all_reduce [dp_replicate]" in names and "all_gather [dp_shard]" in names, names
    assert not [n for n in names if n.endswith("[dp]")], names
    # the memory figure redrawn too: a rank of a shard group of 2 holds more than FSDP's over 4 (about twice)
    params = lambda traces: next(t for t in traces if t["name"] == "params")["y"]  # noqa: E731
    hsdp = params(page.evaluate(FIGURE_DATA, "Memory per rank"))
    assert len(hsdp) == 4 and all(1.5 * b < a for a, b in zip(hsdp, params(memory))), (hsdp, params(memory))
    page.screenshot(path=str(ARTIFACTS / "dashboard-hsdp.png"))

    notch(page, "dp_replicate", "ArrowLeft")
    settle(page, "dp4, sharding=fsdp:", "HSDP off again")
    notch(page, "dp", "ArrowLeft")
    settle(page, "dp2, sharding=fsdp:", "dp 2")
    notch(page, "cp", "ArrowRight")
    settle(page, "dp2 x cp2, sharding=fsdp:", "cp 2, the ring")
    until(page, f"() => ({COMM})().includes('send [cp]')", "the ring's sends drawn", 60)
    choose(page, "cp_kind", "allgather")
    settle(page, "dp2 x cp2, sharding=fsdp, cp_kind=allgather:", "the all-gather kind")
    until(
        page,
        f"() => ({COMM})().includes('all_gather [cp]') && !({COMM})().includes('send [cp]')",
        "the comm figure with the all-gather on cp",
        60,
    )
    page.locator(".labkit-dashboard").scroll_into_view_if_needed()
    page.screenshot(path=str(ARTIFACTS / "dashboard-allgather.png"))


@pytest.mark.parametrize("name", sorted(WITH_FIGURES), ids=lambda n: Path(n).stem)
def test_every_figure_draws(browser, jupyter, name):
    if not (NOTEBOOKS / name).exists():
        pytest.fail(f"{name} is missing")
    page = open_and_run(browser, jupyter, name)
    try:
        wait_ran(page, name)
        figs = check_figures(page, name, WITH_FIGURES[name])
        if name != "10_at_scale.ipynb":  # 10 shows the theory's plans, no run of its own to speak of
            assert page.locator(".labkit-progress").count() >= 1, f"{name}: no progress bar"
        if name in WITH_TABLES:
            assert page.locator("table.dataframe").count() >= 1, f"{name}: no table shown as a DataFrame"
        checked = check_drawn_numbers(page, name, NUMBERS.get(name, []))
    finally:
        finish(page, name)
    print(f"\n{name}: {len(figs)} figures drawn; numbers checked against the run: {checked}")
    print(f"screenshots in {ARTIFACTS}")
