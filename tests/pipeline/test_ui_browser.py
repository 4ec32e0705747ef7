"""The MLflow UI as a user sees it, over the store a real `kiln run` produced.

Drives Debian's chromium with Playwright (never a downloaded browser). Screenshots land in
test-artifacts/browser/ for people to look at.
"""

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.browser

CHROMIUM = "/usr/bin/chromium"
SHOTS = Path(__file__).parents[2] / "test-artifacts" / "browser"
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def mlflow_ui(tiny_run):
    port = _free_port()
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "MLFLOW_DISABLE_TELEMETRY": "true"}
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--backend-store-uri",
                             f"sqlite:///{tiny_run['work'] / 'mlflow.db'}", "--host", "127.0.0.1", "--port", str(port),
                             "--workers", "1"], cwd=tiny_run["work"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 180
    while time.time() < deadline:
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2)
            break
        except OSError:
            assert proc.poll() is None, "mlflow server exited"
            time.sleep(1)
    else:
        proc.kill()
        pytest.fail("mlflow server not ready in 180 s")
    yield url
    proc.terminate()
    proc.wait(30)


@pytest.fixture(scope="module")
def page():
    assert Path(CHROMIUM).exists(), "Debian's chromium is missing: apt-get install chromium (make test does it)"
    from playwright.sync_api import sync_playwright

    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS, headless=True)
        pg = browser.new_page(viewport={"width": 1400, "height": 900})
        yield pg
        browser.close()


def _ids(tiny_run):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tiny_run['work'] / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    exp = client.get_experiment_by_name("kiln-test")
    parent = client.search_runs([exp.experiment_id], "tags.`kiln.kind` = 'pipeline'")[0]
    children = client.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    return exp.experiment_id, parent, children


def _see(page, text: str, shot: str) -> None:
    page.get_by_text(text, exact=False).first.wait_for(timeout=60_000)
    page.screenshot(path=str(SHOTS / f"{shot}.png"), full_page=True)


def test_runs_list_shows_the_pipeline_run_and_its_stage_children(mlflow_ui, page, tiny_run):
    exp_id, parent, _ = _ids(tiny_run)
    page.goto(f"{mlflow_ui}/#/experiments/{exp_id}/runs")
    _see(page, parent.info.run_name, "1-runs-list")
    page.locator("[role=row] button").nth(1).click()  # the parent row's expander
    for child in ("optimize[candidate]", "quality[candidate]", "benchmark[pair]", "gate"):
        page.get_by_text(child, exact=True).first.wait_for(timeout=30_000)
    page.screenshot(path=str(SHOTS / "1b-runs-list-children.png"), full_page=True)


def test_parent_run_shows_verdict_tag_and_report(mlflow_ui, page, tiny_run):
    exp_id, parent, _ = _ids(tiny_run)
    page.goto(f"{mlflow_ui}/#/experiments/{exp_id}/runs/{parent.info.run_id}")
    _see(page, "kiln.verdict", "2-parent-run")
    assert parent.data.tags["kiln.verdict"] in page.content()
    page.goto(f"{mlflow_ui}/#/experiments/{exp_id}/runs/{parent.info.run_id}/artifacts")
    _see(page, "report.html", "3-parent-artifacts")


def test_stage_child_runs_link_to_parent(mlflow_ui, page, tiny_run):
    exp_id, parent, children = _ids(tiny_run)
    assert len(children) >= 8
    quality = next(c for c in children if c.info.run_name == "quality[candidate]")
    page.goto(f"{mlflow_ui}/#/experiments/{exp_id}/runs/{quality.info.run_id}")
    _see(page, "perplexity", "4-quality-child")
    assert parent.info.run_name in page.content()  # the parent-run link


def test_registry_version_with_challenger_alias(mlflow_ui, page, tiny_run):
    page.goto(f"{mlflow_ui}/#/models/tiny")
    _see(page, "challenger", "5-registry")
    page.goto(f"{mlflow_ui}/#/models/tiny/versions/1")
    _see(page, "kiln.verdict", "6-model-version")
