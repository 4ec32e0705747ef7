"""The MLflow UI as a user sees it, started by `kiln ui` over a store that real `kiln run`s made:
one Successful run and one Failed run of the tiny recipe, from a recipe committed to git.

Drives Debian's chromium with Playwright (never a downloaded browser), each test in a fresh
browser context (no remembered UI settings, as a first visit has). Screenshots land in
test-artifacts/browser/ for people to look at.
"""

import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.pipeline.conftest import kiln, write_recipe

pytestmark = pytest.mark.browser

CHROMIUM = "/usr/bin/chromium"
SHOTS = Path(__file__).parents[2] / "test-artifacts" / "browser"
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]
# Both with a speed check any candidate passes (1% of the baseline's decode rate, the contention guard off:
# the machine may be busy), so that both rows show a speed-up with its interval
SPEED = {"kind": "performance", "metric": "decode_tok_s", "min_ratio": 0.01, "max_cpu_pressure": None,
         "max_cpu_steal": None}
VIEWPORT = {"width": 1600, "height": 900}
GATES = {"Successful": [{"kind": "size", "max_ratio": 1.0}, SPEED],  # int8 weights are smaller: passes
         "Failed": [{"kind": "size", "max_ratio": 0.01}, SPEED]}  # nothing is 100x smaller: fails


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def store(tmp_path_factory, tiny_model_dir):
    """A working folder under git holding two recipes that differ in their gate, each run once."""
    work = tmp_path_factory.mktemp("ui-store")
    git = ["git", "-c", "user.name=kiln", "-c", "user.email=kiln@localhost"]
    subprocess.run(git + ["init", "-q"], cwd=work, check=True)
    for verdict, checks in GATES.items():  # two policies: two registered models (each pins its own)
        own = {"tracking__registered_model": "tiny-failed"} if verdict == "Failed" else {}
        write_recipe(work / f"{verdict.lower()}.yaml", tiny_model_dir, gate__checks=checks, **own)
    subprocess.run(git + ["add", "."], cwd=work, check=True)
    subprocess.run(git + ["commit", "-qm", "recipes"], cwd=work, check=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=work, capture_output=True, text=True).stdout.strip()
    for verdict in GATES:
        proc = kiln("run", f"{verdict.lower()}.yaml", cwd=work)
        assert proc.returncode == (0 if verdict == "Successful" else 1), proc.stdout[-3000:] + proc.stderr[-3000:]
    return {"work": work, "commit": commit}


@pytest.fixture(scope="module")
def mlflow_ui(store):
    """`kiln ui` on the store: the server's address and the experiment link it printed."""
    port = _free_port()
    log = store["work"] / "ui.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kiln.pipeline", "ui", "--port", str(port), "--tracking-uri",
                                 f"sqlite:///{store['work'] / 'mlflow.db'}"], cwd=store["work"],
                                env={**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"}, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 180
    while time.time() < deadline:
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2)
            break
        except OSError:
            assert proc.poll() is None, "kiln ui exited:\n" + log.read_text()[-3000:]
            time.sleep(1)
    else:
        proc.kill()
        pytest.fail("kiln ui not ready in 180 s")
    link = re.search(r"^\s*kiln-test: (\S+)$", log.read_text(), re.M)
    yield {"url": url, "experiment": link and link.group(1), "log": log}
    proc.terminate()
    proc.wait(30)


@pytest.fixture(scope="module")
def browser():
    assert Path(CHROMIUM).exists(), "Debian's chromium is missing: apt-get install chromium (make test does it)"
    from playwright.sync_api import sync_playwright

    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS, headless=True)
        yield b
        b.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport=VIEWPORT)  # no localStorage: a first visit
    yield context.new_page()
    context.close()


def _client(store):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{store['work'] / 'mlflow.db'}"
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def _parents(store) -> dict:
    """The pipeline runs by verdict, and the experiment's id."""
    client = _client(store)
    exp = client.get_experiment_by_name("kiln-test")
    runs = client.search_runs([exp.experiment_id], "tags.`kiln.kind` = 'pipeline'")
    return {"experiment_id": exp.experiment_id, **{r.data.tags["kiln.verdict"]: r for r in runs}}


def _see(page, text: str, shot: str) -> None:
    page.get_by_text(text, exact=False).first.wait_for(timeout=60_000)
    page.screenshot(path=str(SHOTS / f"{shot}.png"), full_page=True)


def _row_index(page, run) -> int:
    """Where the run's row is in the runs table, top first."""
    named = page.locator("[role=row]").filter(has=page.get_by_text(run.info.run_name, exact=True)).first
    named.wait_for(timeout=60_000)
    return int(named.get_attribute("aria-rowindex"))


def _row(page, run) -> str:
    """The text of the run's row in the runs table, as rendered: the grid draws its pinned name
    column and the other columns as two rows with one index."""
    return "\n".join(page.locator(f'[role=row][aria-rowindex="{_row_index(page, run)}"]').all_inner_texts())


def test_kiln_ui_links_the_experiment_to_its_runs_table(mlflow_ui, page, store):
    assert mlflow_ui["experiment"], "kiln ui printed no link to the kiln-test experiment:\n" + mlflow_ui["log"].read_text()
    parents = _parents(store)
    page.goto(mlflow_ui["experiment"])
    for verdict in GATES:
        page.get_by_text(parents[verdict].info.run_name, exact=True).first.wait_for(timeout=60_000)
    page.screenshot(path=str(SHOTS / "0-experiment-opens-on-runs.png"), full_page=True)
    assert page.get_by_role("heading", name="Runs").count() == 1  # the runs table, not the GenAI overview
    assert _client(store).get_experiment(parents["experiment_id"]).tags["mlflow.experimentKind"] == "custom_model_development"


def test_an_experiment_opened_from_the_experiments_list_shows_its_runs(mlflow_ui, page, store):
    """A first visit (an empty browser profile) that starts at the home page, not at kiln's link:
    MLflow 3.17 would open the experiment on its GenAI overview; the page kiln ui serves makes
    'Model training' the browser's choice until the user picks another (kiln.pipeline.tracking.ui)."""
    parents = _parents(store)
    page.goto(f"{mlflow_ui['url']}/#/experiments")
    page.get_by_role("link", name="kiln-test", exact=True).first.click()
    for verdict in GATES:
        page.get_by_text(parents[verdict].info.run_name, exact=True).first.wait_for(timeout=60_000)
    page.screenshot(path=str(SHOTS / "0b-experiment-from-the-list.png"), full_page=True)
    assert page.get_by_role("heading", name="Runs").count() == 1
    assert page.evaluate("localStorage.getItem('mlflow.workflowType_v1')") == '"machine_learning"'


def test_runs_table_shows_verdict_dataset_and_source_of_each_run(mlflow_ui, page, store):
    parents = _parents(store)
    page.goto(mlflow_ui["experiment"])
    rows = {verdict: _row(page, parents[verdict]) for verdict in GATES}
    page.screenshot(path=str(SHOTS / "1-runs-table-verdicts.png"), full_page=True)
    for verdict, text in rows.items():
        run = parents[verdict]
        assert run.info.run_name.split(" · ")[0].endswith(verdict), run.info.run_name  # the first column says it
        assert run.data.metrics["kiln.passed"] == (1.0 if verdict == "Successful" else 0.0)  # and a column to sort by
        names = {d.dataset.name for d in run.inputs.dataset_inputs}
        assert names == {"eval.txt", "prompts.jsonl"}, names
        for name in names:  # Dataset column
            assert name in text, (name, text)
        assert f"{verdict.lower()}.yaml" in text, text  # Source column: the recipe
        assert run.data.tags["mlflow.source.git.commit"] == store["commit"]
    # told apart at a glance: each row, as drawn, names its own verdict and not the other's
    assert "Successful ·" in rows["Successful"] and "Failed" not in rows["Successful"]
    assert "Failed ·" in rows["Failed"] and "Successful" not in rows["Failed"]


def test_runs_table_sorts_by_the_verdict(mlflow_ui, page, store):
    parents = _parents(store)
    page.goto(mlflow_ui["experiment"] + "&orderByKey=metrics.%60kiln.passed%60&orderByAsc=false")
    rows = {verdict: _row_index(page, parents[verdict]) for verdict in GATES}
    page.screenshot(path=str(SHOTS / "1c-runs-sorted-by-verdict.png"), full_page=True)
    assert rows["Successful"] < rows["Failed"]  # passed first, though the Failed run is the newer


def test_parent_run_shows_verdict_commit_and_report(mlflow_ui, page, store):
    parents = _parents(store)
    exp_id, parent = parents["experiment_id"], parents["Failed"]
    page.goto(f"{mlflow_ui['url']}/#/experiments/{exp_id}/runs/{parent.info.run_id}")
    _see(page, "kiln.verdict", "2-parent-run")
    assert "Failed" in page.content() and store["commit"][:7] in page.content()
    page.goto(f"{mlflow_ui['url']}/#/experiments/{exp_id}/runs/{parent.info.run_id}/artifacts")
    _see(page, "report.html", "3-parent-artifacts")


def test_runs_table_shows_verdict_and_speedup_columns(mlflow_ui, page, store, tmp_path):
    """The view kiln's link opens: one row per pipeline run, counted as such, each showing its verdict
    and its speed-up from its own metrics, as columns to sort by."""
    parents = _parents(store)
    page.goto(mlflow_ui["experiment"])
    rows = {verdict: _row(page, parents[verdict]) for verdict in GATES}
    headers = page.locator("[role=columnheader]").all_inner_texts()
    for shot in (tmp_path / "runs-table-verdict-speedup.png", SHOTS / "1a-runs-table-verdict-speedup.png"):
        page.screenshot(path=str(shot))
    assert {"kiln.passed", "speedup", "speedup_lo", "speedup_hi"} <= set(headers), headers
    speedup = page.locator("[role=columnheader]").filter(has=page.get_by_text("speedup", exact=True)).first.bounding_box()
    assert speedup["x"] + speedup["width"] <= VIEWPORT["width"], speedup  # on screen, not scrolled off to the right
    assert page.evaluate("localStorage.getItem('mlflow.assistant.panelOpen_v1')") == "false"  # its panel left room
    for verdict, text in rows.items():
        metrics = parents[verdict].data.metrics
        assert f"{verdict} ·" in text, text
        assert _shown(metrics["speedup"]) in text, (metrics["speedup"], text)  # the speed-up column, this run's
    # child runs are no rows of their own, and the count is of pipeline runs
    assert page.get_by_text(f"{len(GATES)} matching runs", exact=True).count() == 1
    assert page.locator("[role=row]").filter(has=page.get_by_text("gate", exact=True)).count() == 0


def _shown(value: float) -> str:
    """A metric as the runs table writes it: JavaScript's String(value), which is Python's repr between
    1e-6 and 1e21, but for a whole number (1, not 1.0)."""
    return str(int(value)) if value == int(value) else repr(value)


def test_pipeline_run_page_lists_its_stage_children(mlflow_ui, page, store):
    """The stages are the pipeline run's children: its page lists them (the runs table, filtered to
    pipeline runs, does not; cleared, it nests them under their parent)."""
    parents = _parents(store)
    parent = parents["Successful"]
    page.goto(f"{mlflow_ui['url']}/#/experiments/{parents['experiment_id']}/runs/{parent.info.run_id}")
    _see(page, "Child runs", "1b-parent-run-children")
    for child in ("optimize[candidate]", "quality[candidate]", "benchmark[pair]", "gate"):
        page.get_by_text(child, exact=True).first.wait_for(timeout=30_000)


def test_stage_child_runs_link_to_parent(mlflow_ui, page, store):
    parents = _parents(store)
    parent = parents["Successful"]
    client = _client(store)
    children = client.search_runs([parents["experiment_id"]], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    assert len(children) >= 8
    quality = next(c for c in children if c.info.run_name == "quality[candidate]")
    page.goto(f"{mlflow_ui['url']}/#/experiments/{parents['experiment_id']}/runs/{quality.info.run_id}")
    _see(page, "perplexity", "4-quality-child")
    # the parent-run link, which the page may draw after the run's metrics (CI: absent right after them)
    page.get_by_text(parent.info.run_name, exact=False).first.wait_for(timeout=60_000)


def test_registry_version_with_challenger_alias(mlflow_ui, page):
    page.goto(f"{mlflow_ui['url']}/#/models/tiny")
    _see(page, "challenger", "5-registry")
    page.goto(f"{mlflow_ui['url']}/#/models/tiny/versions/1")
    _see(page, "kiln.verdict", "6-model-version")
