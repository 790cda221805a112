"""What users look at of a real two-agent run in MLflow: the names each module's metrics get, then
the MLflow UI itself in a real browser, driven headless.

The module trains two iterations of the built-in two-agent env on the session's Ray (sampled in
the driver) into a sqlite store; the names test reads the store. The browser tests use Debian's
``chromium`` package (``apt-get install chromium``; ``.ci/run`` installs it) through Playwright's
Python package with ``executable_path`` (a browser build downloaded by Playwright cannot be
fetched here), serve the store with ``mlflow server`` on a free loopback port, then:

- find every head's norm chart under *Model metrics* (searching its metric name) and save a
  screenshot of each;
- open each plot under *Artifacts*, save a screenshot, check the image the browser shows is the
  PNG the run logged, and read the lines plot's pixels: each module's value line sits on its
  value axes' healthy (green) shading, judged by the value edges, never on a red band.

Screenshots go to ``$GRADMON_SCREENSHOTS`` when set (to look at them), else to a temp folder.
The browser tests are skipped, with the reason, only where ``/usr/bin/chromium`` is absent.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from matplotlib.image import imread
from mlflow.tracking import MlflowClient

from gradmon_ray import metric_names as mn
from gradmon_ray.app.train.run import run_training
from gradmon_ray.config import config_from_dict
from gradmon_ray.viz.plots import ENTROPY_FILE, HEATMAP_FILE, LINES_FILE, lines_figure
from gradmon_ray.viz.report import PLOTS_ARTIFACT_DIR
from gradmon_ray.viz.runs import load_history
from tests.e2e.processes import MLFLOW_SERVER_ENV, free_port, kill_group, mlflow_server_argv, wait_http

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
]
pytestmark = pytest.mark.e2e
needs_chromium = pytest.mark.skipif(
    not CHROMIUM.exists(), reason="no /usr/bin/chromium: install Debian's package (apt-get install -y chromium)"
)
AGENTS = ("agent_0", "agent_1")
UI_TIMEOUT_MS = 120_000  # the first page load compiles MLflow's JS bundle: slow on a loaded 2-core box


@pytest.fixture(scope="module")
def real_run(ray_session, tmp_path_factory):
    """Two iterations of the built-in two-agent env through ``run_training`` (what ``gradmon-ray train``
    runs); its store and artifacts (the plots) under the temp folder."""
    tmp = tmp_path_factory.mktemp("browser")
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    client = MlflowClient(uri)
    client.create_experiment("browser", artifact_location=str(tmp / "artifacts"))  # not ./mlruns of the cwd
    cfg = config_from_dict(
        {
            "seed": 5,
            "iterations": 2,
            "checkpoint_dir": str(tmp / "ckpt"),
            "env": {"id": "gradmon/FactoredOpsMultiAgent-v0"},
            "resources": {"num_env_runners": 0},  # sampled here: the run is the material, not its EnvRunners
            "ppo": {"train_batch_size": 256, "minibatch_size": 128, "num_epochs": 1},
            "model": {"trunk_hiddens": [16]},
            "mlflow": {"tracking_uri": uri, "experiment": "browser"},
        }
    )
    outcome = run_training(cfg)
    assert outcome.mlflow_complete
    run = client.get_run(outcome.run_id)
    return tmp, client, run


def test_each_modules_metrics_are_prefixed_with_its_id_and_the_heads_tagged_in_order(real_run):
    _, _, run = real_run
    metrics = run.data.metrics
    for mid in AGENTS:
        for head in ("op", "tempo", "value"):
            assert f"module/{mid}/grad/head/{head}/norm" in metrics, (mid, head)
        assert f"module/{mid}/grad/global_norm" in metrics
    assert not any(k.startswith("grad/") for k in metrics), "no unprefixed per-module metric in a multi-module run"
    tagged = run.data.tags[mn.TAG_HEAD_NAMES].split(",")
    # the declared order, op first, module by module
    assert tagged[0] == "agent_0/op" and tagged[8] == "agent_0/value" and tagged[-1] == "agent_1/value"
    assert len(tagged) == 18


@pytest.fixture(scope="module")
def mlflow_ui(real_run):
    """``mlflow server`` on a free loopback port serving the run's store; stopped afterwards."""
    tmp, client, _ = real_run
    port = free_port()
    log = (tmp / "mlflow-server.log").open("w")
    proc = subprocess.Popen(
        mlflow_server_argv(port, "--backend-store-uri", client.tracking_uri),
        env={**os.environ, **MLFLOW_SERVER_ENV},
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        wait_http(f"http://127.0.0.1:{port}/health", 180)
        yield f"http://127.0.0.1:{port}"
    finally:
        kill_group(proc)
        log.close()


@pytest.fixture(scope="module")
def page(mlflow_ui):
    from playwright.sync_api import sync_playwright  # the dev extra; only this test needs it

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_FLAGS)
        try:
            yield browser.new_page(viewport={"width": 1600, "height": 1100})
        finally:
            browser.close()


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    out = Path(os.environ.get("GRADMON_SCREENSHOTS") or tmp_path_factory.mktemp("screenshots"))
    out.mkdir(parents=True, exist_ok=True)
    return out


def _open(page, url: str) -> None:
    page.goto(url, timeout=UI_TIMEOUT_MS)
    close = page.get_by_role("button", name="Close")  # MLflow 3's assistant panel covers the right third
    with contextlib.suppress(Exception):  # no assistant panel in this MLflow build
        close.first.click(timeout=15_000)


@needs_chromium
def test_every_heads_norm_chart_is_in_the_mlflow_ui(real_run, mlflow_ui, page, shots):
    _, _, run = real_run
    heads = run.data.tags[mn.TAG_HEAD_NAMES].split(",")
    assert len(heads) == 18 and heads[8] == "agent_0/value" and heads[-1] == "agent_1/value"
    _open(page, f"{mlflow_ui}/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}/model-metrics")
    search = page.get_by_placeholder("Search metric charts")
    search.wait_for(timeout=UI_TIMEOUT_MS)
    for head in heads:
        name = mn.head_metric(mn.HEAD_GRAD_NORM, head)
        search.fill(name)
        legend = page.get_by_text(f"({name})", exact=False).first  # the chart's legend: run name (metric)
        legend.wait_for(timeout=30_000)
        section = name.rsplit("/", 1)[0]  # MLflow groups charts by the name's prefix: the head is in it
        assert page.get_by_text(section, exact=True).first.is_visible()
        page.screenshot(path=shots / f"chart_{head.replace('/', '_')}.png")


@needs_chromium
def test_the_plots_under_artifacts_are_what_the_run_logged_and_the_value_lines_sit_on_green(
    real_run, mlflow_ui, page, shots, tmp_path
):
    _, client, run = real_run
    _open(page, f"{mlflow_ui}/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}/artifacts")
    page.get_by_text(PLOTS_ARTIFACT_DIR, exact=True).first.click(timeout=UI_TIMEOUT_MS)
    shown: dict[str, np.ndarray] = {}
    for name in (LINES_FILE, HEATMAP_FILE, ENTROPY_FILE):
        page.get_by_text(name, exact=True).first.click(timeout=30_000)
        page.get_by_text(f"{PLOTS_ARTIFACT_DIR}/{name}", exact=True).first.wait_for(timeout=30_000)
        image = page.locator("img[src^='blob:'] >> visible=true").first  # (a hidden copy serves the zoom)
        image.wait_for(timeout=30_000)
        page.wait_for_function("e => e.complete && e.naturalWidth > 0", arg=image.element_handle(), timeout=30_000)
        data = image.evaluate(
            "async e => Array.from(new Uint8Array(await (await fetch(e.src)).arrayBuffer()))"
        )  # the bytes the browser displays
        shown[name] = imread(io.BytesIO(bytes(data)))[..., :3]
        logged = imread(client.download_artifacts(run.info.run_id, f"{PLOTS_ARTIFACT_DIR}/{name}", str(tmp_path)))
        np.testing.assert_array_equal(shown[name], logged[..., :3])
        page.screenshot(path=shots / f"artifact_{name}")
    # The same drawing again from the run's history gives the axes' transforms for the pixels.
    figure = lines_figure(load_history(client, run.info.run_id))
    figure.savefig(tmp_path / "again.png")
    np.testing.assert_array_equal(imread(tmp_path / "again.png")[..., :3], shown[LINES_FILE])
    value_axes = [ax for ax in figure.axes if "value head" in ax.get_title()]
    assert [ax.get_title().split(":")[0] for ax in value_axes] == ["module agent_0", "module agent_1"]
    image = shown[LINES_FILE]
    for ax in value_axes:
        assert ax.get_title().endswith("(bands 0.01 / 0.1 / 10 / 50)")
        line = ax.get_lines()[0]  # the head's line (the band edges' lines come after it)
        x, y = line.get_xdata()[0], line.get_ydata()[0]
        assert 0.1 <= y <= 10.0, "a value head of the built-in env trains at a healthy norm"
        left = (ax.get_xlim()[0] + x) / 2  # beside the first point, in the axes' x margin: only the shading
        px, py = (float(v) for v in ax.transData.transform((left, y)))
        r, g, b = image[round(image.shape[0] - py), round(px)]
        assert g > r and g > b, f"{ax.get_title()}: pixel behind the value line is {r:.3f}, {g:.3f}, {b:.3f}"
