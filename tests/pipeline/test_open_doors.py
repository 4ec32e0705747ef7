"""No open doors (issue 52, point 7), tried as an attacker would: a key that strips to nothing is refused at
start by every command and library entry point that serves (it used to announce "API key required" and serve
open), `kiln ui` and `kiln fake-engine` keep `kiln serve`'s exposure rule, and `kiln ui` with a key demands it
of every request, checked against the real `mlflow server` it starts. The router's keys are in
tests/deploy/test_router_keys.py."""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from kiln.core.errors import BadInput

REPO = Path(__file__).parents[2]
KEY = "ui-test-key"
KEY_VARS = ("KILN_API_KEY", "KILN_UI_API_KEY", "KILN_ADMIN_KEY", "KILN_UPSTREAM_API_KEY")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra: str) -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if k not in KEY_VARS}, "MLFLOW_DISABLE_TELEMETRY": "true", **extra}


def _kiln_refused(*args: str, env: dict[str, str], cwd: Path = REPO) -> tuple[int, str, str]:
    """Exit code, stdout, stderr of a kiln command that must stop at once; one that starts serving
    instead is killed (with what it started) after 60 s and reported as such."""
    proc = subprocess.Popen([sys.executable, "-m", "kiln.pipeline", *args], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"`kiln {' '.join(args)}` started serving instead of refusing:\n{out[-2000:]}{err[-2000:]}")
    return proc.returncode, out, " ".join(err.split())  # rich wraps lines at the terminal width


@pytest.mark.parametrize("command, blank", [
    (["serve", "ENGINE"], ","), (["route", "--stable", "http://127.0.0.1:9"], " "),
    (["fake-engine"], "a,,"), (["ui", "--tracking-uri", "sqlite:///TMP/mlflow.db"], ""),
    (["serve", "ENGINE", "--api-key-env", "TEAM_KEY"], " , ")])
def test_a_key_that_strips_to_nothing_is_refused_at_start(command, blank, tmp_path):
    """`KILN_API_KEY=","` printed "(API key required)" and then served /v1/completions to anyone."""
    var = command[command.index("--api-key-env") + 1] if "--api-key-env" in command else "KILN_API_KEY"
    args = [a.replace("ENGINE", str(tmp_path)).replace("TMP", str(tmp_path)) for a in command]
    code, out, err = _kiln_refused(*args, "--port", str(_port()), env=_env(**{var: blank}), cwd=tmp_path)
    assert code == 2, out + err
    assert f"${var}: holds an empty API key" in err and "leave it unset" in err, err
    assert "API key required" not in out and "Traceback" not in err


@pytest.mark.parametrize("blank", [",", " ", "", "a,,"])
def test_the_library_entry_points_refuse_it_too(blank, tmp_path):
    """A caller passing "," got an open server from each of them."""
    from kiln.deploy.config import DeployConfig
    from kiln.deploy.local import BackendSpec
    from kiln.deploy.run import deploy_local
    from kiln.engine.serve.fake import FakeEngineConfig, FakeServer, run_fake_server
    from kiln.engine.serve.server import create_app, serve

    arm = BackendSpec(url="http://127.0.0.1:9")  # never reached: the key is refused first
    starts = [lambda: create_app(lambda: None, api_key=blank), lambda: serve(tmp_path, api_key=blank),
              lambda: FakeServer(FakeEngineConfig(), api_key=blank),
              lambda: __import__("asyncio").run(run_fake_server(FakeEngineConfig(), api_key=blank)),
              lambda: deploy_local(None, DeployConfig(), arm, arm, api_key=blank)]  # `kiln deploy canary`'s
    for start in starts:
        with pytest.raises(BadInput, match="api_key: holds an empty API key"):
            start()


@pytest.mark.parametrize("command", [["ui", "--tracking-uri", "sqlite:///TMP/mlflow.db"], ["fake-engine"]])
def test_ui_and_fake_engine_beyond_loopback_need_a_key_or_the_explicit_flag(command, tmp_path):
    """`kiln ui --host 0.0.0.0` was an unauthenticated MLflow on which anyone could set `champion`."""
    args = [a.replace("TMP", str(tmp_path)) for a in command]
    code, out, err = _kiln_refused(*args, "--host", "0.0.0.0", "--port", str(_port()), env=_env(), cwd=tmp_path)
    assert code == 2 and "--insecure-no-api-key" in err and "$KILN_API_KEY holds no API key" in err, out + err
    help_text = subprocess.run([sys.executable, "-m", "kiln.pipeline", *command[:1], "--help"], env=_env(),
                               capture_output=True, text=True).stdout
    assert "--insecure-no-api-key" in help_text and "--api-key-env" in help_text


@pytest.fixture(scope="module")
def ui(tmp_path_factory):
    """`kiln ui` with $KILN_API_KEY set, on a store holding registered model 'm' version 1."""
    from mlflow.tracking import MlflowClient

    work = tmp_path_factory.mktemp("ui-key")
    store = f"sqlite:///{work / 'mlflow.db'}"
    client = MlflowClient(store, store)
    client.create_registered_model("m")
    client.create_model_version("m", source=(work / "model").as_uri())
    port = _port()
    log = open(work / "ui.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, "-m", "kiln.pipeline", "ui", "--port", str(port), "--tracking-uri", store],
                            cwd=work, env=_env(KILN_API_KEY=KEY), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while _call(url + "/health")[0] != 200:
            assert proc.poll() is None and time.monotonic() < deadline, (work / "ui.log").read_text()[-3000:]
            time.sleep(1)
        yield {"url": url, "client": client, "pid": proc.pid}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
        log.close()


def _call(url: str, auth: str | None = None, data: dict | None = None) -> tuple[int, Any, bytes]:
    """Status, headers (looked up case-insensitively) and body; status 0 while nothing listens."""
    req = urllib.request.Request(url, data=json.dumps(data).encode() if data is not None else None,
                                 headers={"Content-Type": "application/json", **({"Authorization": auth} if auth else {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()
    except OSError:
        return 0, {}, b""


def _basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


ALIAS = "/api/2.0/mlflow/registered-models/alias"


def test_ui_with_a_key_refuses_every_request_without_it(ui):
    champion = {"name": "m", "alias": "champion", "version": "1"}
    for auth in (None, "Bearer wrong", _basic("anyone", "wrong"), f"Token {KEY}", f"Basic {KEY}"):
        status, headers, _ = _call(ui["url"] + ALIAS, auth, champion)
        assert status == 401, (auth, status)
        page, headers, _ = _call(ui["url"] + "/", auth)
        assert page == 401 and headers.get("WWW-Authenticate", "").startswith("Basic"), (auth, headers)
    with pytest.raises(Exception, match="alias"):
        ui["client"].get_model_version_by_alias("m", "champion")
    assert _call(ui["url"] + "/health")[0] == 200  # probes need none, as kiln serve's


def test_ui_with_a_key_works_with_it_from_a_client_and_a_browser(ui, monkeypatch):
    status, _, _ = _call(ui["url"] + ALIAS, f"Bearer {KEY}", {"name": "m", "alias": "champion", "version": "1"})
    assert status == 200 and str(ui["client"].get_model_version_by_alias("m", "champion").version) == "1"
    status, _, page = _call(ui["url"] + "/", _basic("me", KEY))  # the browser's login prompt, any user name
    assert status == 200 and b"mlflow.workflowType_v1" in page
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", KEY)
    assert [m.name for m in MlflowClient(ui["url"]).search_registered_models()] == ["m"]


def test_ui_key_never_on_a_command_line(ui):
    import psutil

    server = psutil.Process(ui["pid"])
    for p in [server, *server.children(recursive=True)]:
        assert KEY not in " ".join(p.cmdline()), p.cmdline()
