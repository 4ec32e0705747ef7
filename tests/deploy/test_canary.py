"""The canary controller: step logic on a simulated target (virtual time), then whole walks on
real processes (fake engines behind the router, steady client load, a sqlite MLflow registry)."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from kiln.pipeline.tracking.canary_journal import TrackedController as Controller
from kiln.deploy.config import CanaryStep, DeployConfig, RouterOptions
from kiln.deploy.loadgen import SteadyLoad
from kiln.deploy.local import BackendSpec, LocalTarget
from kiln.deploy.simulated import ArmModel, SimulatedTarget
from kiln.core.errors import ExitCode
from kiln.core.gate.policy import GateSection
from tests.deploy.fakes import fake

POLICY = GateSection.model_validate({"checks": [
    {"kind": "performance", "metric": "ttft_ms", "max_ratio": 1.15},
    {"kind": "performance", "metric": "tpot_ms", "max_ratio": 1.15},
    {"kind": "error_rate", "max": 0.05},
    {"kind": "size", "max_ratio": 0.6},  # offline only: skipped live, with the reason
]})


def deploy(on_inconclusive: str = "rollback", max_s: float = 30, **kw) -> DeployConfig:
    steps = [CanaryStep(weight=w, min_requests=40, max_duration_s=max_s) for w in (25, 50, 100)]
    return DeployConfig(steps=steps, on_inconclusive=on_inconclusive, poll_s=0.5, **kw)


def simulate(canary: ArmModel, config: DeployConfig, **kw) -> tuple[SimulatedTarget, object]:
    target = SimulatedTarget(ArmModel(), canary, rate=60, **kw)
    result = Controller(target, POLICY, config, log=lambda _: None, sleep=target.sleep, clock=target.clock).run()
    return target, result


def test_simulated_good_candidate_walks_every_step_and_is_promoted():
    target, result = simulate(ArmModel(), deploy())
    assert result.status == "promoted" and result.exit_code == ExitCode.PASSED
    assert [s.weight for s in result.steps] == [25, 50, 100]
    assert [s.action for s in result.steps] == ["advance", "advance", "promote"]
    assert all(s.canary["requests"] >= 40 for s in result.steps)
    assert target.history == [("weight", 25), ("weight", 50), ("weight", 100), ("promote", 100)]
    assert [s["check"] for s in result.skipped_checks] == ["size:size_bytes"]


def test_simulated_regression_is_rolled_back_at_the_first_step():
    target, result = simulate(ArmModel(ttft_ms=65, tpot_ms=26), deploy())
    assert result.status == "rolled_back" and result.exit_code == ExitCode.GATE_FAILED
    assert len(result.steps) == 1 and result.steps[0].verdict == "Failed"
    assert target.history[-2:] == [("weight", 0), ("rollback", 0)]
    assert result.steps[0].seconds < 30  # stopped early, not at the step's limit


def test_undecided_step_holds_or_rolls_back_as_configured():
    # A canary 12% slower against a 15% bound, at 2 requests/s: no verdict within 20 s.
    slowish = ArmModel(ttft_ms=56, tpot_ms=22.4, sigma=0.6)
    held_target = SimulatedTarget(ArmModel(sigma=0.6), slowish, rate=2)
    held = Controller(held_target, POLICY, deploy("hold", max_s=20), log=lambda _: None,
                      sleep=held_target.sleep, clock=held_target.clock).run()
    assert held.status == "held" and held.exit_code == ExitCode.GATE_INCONCLUSIVE
    assert held_target.history == [("weight", 25)]  # traffic left where it was for a human
    rolled_target = SimulatedTarget(ArmModel(sigma=0.6), slowish, rate=2)
    rolled = Controller(rolled_target, POLICY, deploy("rollback", max_s=20), log=lambda _: None,
                        sleep=rolled_target.sleep, clock=rolled_target.clock).run()
    assert rolled.status == "rolled_back" and rolled.exit_code == ExitCode.GATE_INCONCLUSIVE
    assert rolled_target.history[-1] == ("rollback", 0)
    assert "undecided" in rolled.reason


def test_mlflow_records_steps_and_moves_the_champion_alias(mlflow_registry):
    target = SimulatedTarget(ArmModel(), ArmModel(), rate=60)
    result = Controller(target, POLICY, deploy(), tracker=mlflow_registry, model="smol", log=lambda _: None,
                        sleep=target.sleep, clock=target.clock).run()
    client = mlflow_registry.client
    assert result.status == "promoted" and result.version == "2"  # resolved from alias 'challenger'
    assert str(client.get_model_version_by_alias("smol", "champion").version) == "2"
    assert client.get_model_version("smol", "2").tags["kiln.deploy"] == "promoted"
    steps = client.search_runs([mlflow_registry.experiment_id], "tags.`kiln.stage` = 'canary-step'")
    assert sorted(r.data.tags["kiln.weight"] for r in steps) == ["100", "25", "50"]
    assert {r.data.tags["kiln.verdict"] for r in steps} == {"Successful"}
    assert all(r.data.tags["mlflow.parentRunId"] == result.run_id for r in steps)
    assert all("check.performance:ttft_ms.cs_high" in r.data.metrics for r in steps)
    assert [a.path for a in client.list_artifacts(steps[0].info.run_id)] == ["evidence.json"]


def test_rollback_leaves_the_champion_and_tags_the_version(mlflow_registry):
    target = SimulatedTarget(ArmModel(), ArmModel(error_rate=0.4), rate=60)
    result = Controller(target, POLICY, deploy(), tracker=mlflow_registry, model="smol", log=lambda _: None,
                        sleep=target.sleep, clock=target.clock).run()
    client = mlflow_registry.client
    assert result.status == "rolled_back"
    assert str(client.get_model_version_by_alias("smol", "champion").version) == "1"
    assert client.get_model_version("smol", "2").tags["kiln.deploy"] == "rolled_back"
    parent = client.get_run(result.run_id)
    assert parent.data.tags["kiln.verdict"] == "rolled_back" and "error_rate" in parent.data.tags["kiln.reason"]


PASS_POLICY = POLICY.model_copy(update={"on_inconclusive": "pass"})


@pytest.mark.parametrize(("on_inconclusive", "status"), [("hold", "held"), ("rollback", "rolled_back")])
def test_a_step_without_traffic_never_promotes_even_when_the_gate_passes_inconclusive(on_inconclusive, status):
    """The issue's reproduction: with no client traffic, `on_inconclusive: pass` in the gate walked
    every step ("step 1: Inconclusive -> promote: 0 canary requests") and moved `champion`."""
    target = SimulatedTarget(ArmModel(), ArmModel(), rate=0)
    result = Controller(target, PASS_POLICY, deploy(on_inconclusive, max_s=5), log=lambda _: None,
                        sleep=target.sleep, clock=target.clock).run()
    assert result.status == status and result.exit_code == ExitCode.GATE_INCONCLUSIVE, result.reason
    assert [s.action for s in result.steps] == [on_inconclusive]
    assert "0/40 canary requests" in result.reason and "does not accept" in result.reason
    assert not any(event == "promote" for event, _ in target.history)


def test_a_step_below_min_requests_never_advances_on_a_waived_inconclusive():
    """Enough observations for the live checks (min_per_arm 5) but fewer canary requests than the
    step's min_requests (40): the step holds, whatever the gate's on_inconclusive says."""
    config = DeployConfig(steps=[CanaryStep(weight=25, min_requests=40, max_duration_s=20)], on_inconclusive="hold",
                          poll_s=0.5, min_per_arm=5)
    target = SimulatedTarget(ArmModel(sigma=0.6), ArmModel(sigma=0.6), rate=2)
    result = Controller(target, PASS_POLICY, config, log=lambda _: None, sleep=target.sleep, clock=target.clock).run()
    step = result.steps[0]
    assert result.status == "held" and result.exit_code == ExitCode.GATE_INCONCLUSIVE, result.reason
    assert step.canary["requests"] < 40 and not any(c["insufficient"] for c in step.checks), step.checks


def test_an_undecided_step_on_enough_traffic_still_advances_under_pass():
    """What `on_inconclusive: pass` is for: a step that saw its min_requests and every live check's
    observations, still undecided at max_duration_s (a canary 12% slower against a 15% bound)."""
    slowish = ArmModel(ttft_ms=56, tpot_ms=22.4, sigma=0.6)
    target = SimulatedTarget(ArmModel(sigma=0.6), slowish, rate=20)
    result = Controller(target, PASS_POLICY, deploy("hold", max_s=20), log=lambda _: None, sleep=target.sleep,
                        clock=target.clock).run()
    first = result.steps[0]
    assert first.verdict == "Inconclusive" and first.action == "advance", first.reason
    assert first.canary["requests"] >= 40 and not any(c["insufficient"] for c in first.checks)


@pytest.mark.timeout(120)
def test_no_client_traffic_on_real_processes_holds_the_canary():
    """Fake engines as both arms behind the real router, nobody sending requests, the gate saying
    `on_inconclusive: pass`: the first step holds (exit 3) and nothing is promoted."""
    config = DeployConfig(steps=[CanaryStep(weight=w, min_requests=40, max_duration_s=2) for w in (25, 100)],
                          on_inconclusive="hold", poll_s=0.5, router=RouterOptions(affinity="random"))
    with LocalTarget(BackendSpec(fake=fake()), BackendSpec(fake=fake()), config.router) as target:
        result = Controller(target, PASS_POLICY, config, log=lambda _: None).run()
        state = target.router.state()
    assert result.status == "held" and result.exit_code == ExitCode.GATE_INCONCLUSIVE, result.reason
    assert [(s.weight, s.action) for s in result.steps] == [(25, "hold")]
    assert result.steps[0].canary["requests"] == 0 and "0/40 canary requests" in result.reason
    assert state["canary_url"] is not None and state["weight"] == 25  # left where it was for a person


# --- whole walks on real processes ------------------------------------------------------------

def walk(canary_fake, tracker=None, kill_canary_after: float | None = None, **steps):
    config = deploy(max_s=60, router=RouterOptions(affinity="random"))
    with LocalTarget(BackendSpec(fake=fake()), BackendSpec(fake=canary_fake), config.router) as target:
        with SteadyLoad(target.url, concurrency=12) as load:
            if kill_canary_after is not None:
                pid = target.arms["canary"].pid
                threading.Timer(kill_canary_after, os.kill, (pid, signal.SIGKILL)).start()
            start = time.monotonic()
            result = Controller(target, POLICY, config, tracker=tracker, model="smol" if tracker else None,
                                log=lambda _: None).run()
            seconds = time.monotonic() - start
            time.sleep(1)  # keep the load on across promotion / rollback
        final = target.router.state()
    return result, load.stats, final, seconds


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_good_candidate_promoted_through_every_step_with_no_client_failure(mlflow_registry):
    result, load, final, seconds = walk(fake(), tracker=mlflow_registry)
    assert result.status == "promoted", result.reason
    assert [s.action for s in result.steps] == ["advance", "advance", "promote"]
    assert load.failures == [] and load.ok > 100
    assert final["canary_url"] is None and final["weight"] == 0  # the candidate now serves as stable
    assert str(mlflow_registry.client.get_model_version_by_alias("smol", "champion").version) == "2"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_regressed_candidate_rolled_back_early_with_no_client_failure():
    result, load, final, seconds = walk(fake(slowdown=1.3))
    assert result.status == "rolled_back" and result.exit_code == ExitCode.GATE_FAILED, result.reason
    assert len(result.steps) == 1 and result.steps[0].weight == 25  # caught at the first step
    assert load.failures == [] and load.ok > 50
    assert final["weight"] == 0 and final["canary_url"] is None


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_canary_killed_mid_step_is_rolled_back_and_clients_never_notice():
    result, load, final, seconds = walk(fake(), kill_canary_after=2.0)
    assert result.status == "rolled_back", result.reason
    assert "error_rate" in result.reason
    assert load.failures == [] and load.ok > 50


def test_simulated_walks_judge_agreement_against_the_noise_floor():
    """A stable that agrees with itself 0.8 (two replicas batching differently): a canary as good
    as stable is promoted under served_prefix min 0.9 in every walk; one 0.2 below it is rolled
    back on that check alone, in the first step (bench/canary_sim.py measures how often and how fast)."""
    policy = GateSection.model_validate({"checks": [*POLICY.model_dump()["checks"][:3],
                                                    {"kind": "agreement", "metric": "served_prefix", "min": 0.9}]})
    config = DeployConfig(router=RouterOptions(mirror_fraction=0.1))
    outcomes = []
    for seed in range(5):
        for canary in (0.8, 0.6):
            target = SimulatedTarget(ArmModel(served_prefix=0.8), ArmModel(served_prefix=canary), rate=50,
                                     mirror_fraction=0.1, seed=seed)
            result = Controller(target, policy, config, log=lambda _: None, sleep=target.sleep,
                                clock=target.clock).run()
            failed = [c["name"] for c in result.steps[-1].checks if c["verdict"] == "Failed"]
            outcomes.append((canary, result.status, len(result.steps), tuple(failed)))
    assert {o for o in outcomes if o[0] == 0.8} == {(0.8, "promoted", 4, ())}
    assert {o for o in outcomes if o[0] == 0.6} == {
        (0.6, "rolled_back", 1, ("agreement:served_prefix",))}
