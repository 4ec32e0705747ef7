"""The local canary survives its router and its controller: kill -9 of the router under steady load
fails only what it had in flight, stable keeps serving, the walk rolls back; a controller killed
mid-walk leaves a state file from which the next `kiln deploy canary` rolls it back."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kiln.deploy.canary import Controller, recover_crashed_walk
from kiln.deploy.config import CanaryStep, DeployConfig, RouterOptions
from kiln.deploy.loadgen import SteadyLoad
from kiln.deploy.local import BackendSpec, LocalTarget
from kiln.deploy.run import kiln_serve
from kiln.core.errors import ExitCode
from kiln.core.files import read_json
from kiln.core.gate.policy import GateSection
from tests.deploy.fakes import fake

REPO = Path(__file__).parents[2]
POLICY = GateSection.model_validate({"checks": [{"kind": "error_rate", "max": 0.05}]})
CLIENTS = 8
# One long step that cannot pass (min_requests out of reach): the walk is mid-step when we strike.
CONFIG = DeployConfig(steps=[CanaryStep(weight=50, min_requests=10**6, max_duration_s=120)], poll_s=0.2,
                      router=RouterOptions(affinity="random"))


def in_flight(load: SteadyLoad) -> int:
    s = load.stats
    return s.sent - s.ok - len(s.failures)


@pytest.mark.timeout(120)
def test_router_killed_mid_walk_fails_only_its_in_flight_requests_and_the_walk_rolls_back(tmp_path):
    state, logs, out = tmp_path / "deploy-state.json", [], {}
    with LocalTarget(BackendSpec(fake=fake()), BackendSpec(fake=fake()), CONFIG.router) as target:
        stable_url = target.arms["stable"].url
        with SteadyLoad(target.url, concurrency=CLIENTS) as load:
            walk = threading.Thread(target=lambda: out.update(r=Controller(
                target, POLICY, CONFIG, log=logs.append, state_path=state).run()))
            walk.start()
            time.sleep(2.0)
            assert read_json(state)["status"] == "walking" and load.stats.ok > 20 and not load.stats.failures
            before, flying = len(load.stats.failures), in_flight(load)
            os.kill(target.router.proc.pid, signal.SIGKILL)
            walk.join(timeout=60)
            assert not walk.is_alive()
            ok_after_walk = load.stats.ok
            time.sleep(1.5)  # stable keeps serving through the restarted router
        final = target.router.state()
    result, failed = out["r"], len(load.stats.failures) - before
    print(f"router SIGKILLed with {flying} of {CLIENTS} client requests in flight: {failed} failed; "
          f"{load.stats.ok} ok of {load.stats.sent}; {load.stats.failures[:3]}")
    assert failed <= CLIENTS  # a closed loop of CLIENTS: never more in flight than that
    assert load.stats.ok - ok_after_walk > 10
    assert target.restarts == [-signal.SIGKILL]
    assert result.status == "rolled_back" and result.exit_code == ExitCode.INTERNAL_ERROR, result.reason
    assert "the router died" in result.reason
    assert final["weight"] == 0 and final["canary_url"] is None and final["stable_url"] == stable_url
    assert read_json(state)["status"] == "rolled_back"


CONTROLLER = """
import sys
from kiln.deploy.canary import Controller
from kiln.deploy.local import LocalTarget
from tests.deploy.test_router_crash import CONFIG, POLICY, command_arm
with LocalTarget(command_arm('old'), command_arm('new'), CONFIG.router) as target:
    print(target.url, flush=True)
    Controller(target, POLICY, CONFIG, log=lambda _: None, state_path=sys.argv[1]).run()
"""
SERVE = ("from kiln.engine.serve.fake import serve_fake, FakeEngineConfig; "
         "serve_fake(FakeEngineConfig(ttft_ms=5, tpot_ms=2, model='{name}'), port={{port}})")


def command_arm(name: str) -> BackendSpec:
    return BackendSpec(command=[sys.executable, "-c", SERVE.format(name=name)], health_timeout_s=60)


def _alive(pid: int) -> bool:
    """Running (a zombie, dead but not yet reaped, is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.timeout(120)
def test_a_walk_whose_controller_died_is_rolled_back_from_its_state_file(tmp_path):
    state = tmp_path / "deploy-state.json"
    proc = subprocess.Popen([sys.executable, "-c", CONTROLLER, str(state)], stdout=subprocess.PIPE, text=True,
                            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    pids: list[int] = []
    try:
        url = ""
        while not url.startswith("http://"):  # the arms print their own ready lines first
            url = proc.stdout.readline().strip()
        deadline = time.monotonic() + 30
        while not (state.exists() and read_json(state)["status"] == "walking") and time.monotonic() < deadline:
            time.sleep(0.1)
        saved = read_json(state)
        pids += [saved["target"]["router_pid"], saved["target"]["arms"]["stable"]["pid"],
                saved["target"]["arms"]["canary"]["pid"]]
        proc.kill()  # the controller dies; its router and arms live on, orphaned
        proc.wait()
        assert all(_alive(p) for p in pids) and saved["target"]["router_url"] == url
        logs: list[str] = []
        assert recover_crashed_walk(state, log=logs.append, timeout_s=30)
        assert not any(_alive(p) for p in pids), logs
        assert read_json(state)["status"] == "rolled_back" and "died at step 1 (50%)" in logs[0]
        assert not recover_crashed_walk(state)  # nothing left to recover
    finally:
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_arms_run_under_the_interpreter_kiln_runs_under():
    command = kiln_serve("/engines/candidate").command
    assert command[:4] == [sys.executable, "-m", "kiln.pipeline", "serve"]


@pytest.mark.timeout(60)
def test_a_failed_router_restart_is_retried_until_the_router_serves_again():
    import urllib.request

    with LocalTarget(BackendSpec(fake=fake()), BackendSpec(fake=fake()), CONFIG.router) as target:
        router, real, calls = target.router, target.router.restart, []

        def flaky(config):  # the first two restarts fail (a port race, a crash at start-up...)
            calls.append(time.monotonic())
            if len(calls) <= 2:
                raise RuntimeError("router did not start")
            real(config)

        router.restart = flaky
        os.kill(router.proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while not target.restarts and time.monotonic() < deadline:
            time.sleep(0.05)
        with urllib.request.urlopen(target.url + "/health", timeout=10) as r:
            healthy = r.status
    assert target.restart_failures == ["RuntimeError: router did not start"] * 2
    assert len(target.restarts) == 1 and len(calls) == 3 and healthy == 200
    assert calls[2] - calls[1] > calls[1] - calls[0] > 0.05  # backing off between tries
