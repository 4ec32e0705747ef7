"""The local target: arms started from a command, promotion and rollback swap backends cleanly."""

from __future__ import annotations

import sys

import pytest
from pydantic import ValidationError

from kiln.deploy.config import CanaryStep, DeployConfig, RouterOptions
from kiln.deploy.local import BackendSpec, LocalTarget

SERVE = ("from kiln.engine.serve.fake import serve_fake, FakeEngineConfig; "
         "serve_fake(FakeEngineConfig(ttft_ms=5, tpot_ms=2, model='{name}'), port={{port}})")


def command(name: str) -> BackendSpec:
    return BackendSpec(command=[sys.executable, "-c", SERVE.format(name=name)], health_timeout_s=60)


def test_command_arms_promote_and_the_old_stable_is_stopped():
    with LocalTarget(command("old"), command("new"), RouterOptions(affinity="random")) as target:
        old = target.arms["stable"].handle
        target.set_traffic(50)
        target.promote()
        state = target.router.state()
        assert state["canary_url"] is None and state["stable_url"] == target.arms["stable"].url
        assert old.poll() is not None  # the old stable process was stopped once idle
        obs = target.observe()
        assert obs.cursor[0] >= 0


def test_rollback_stops_the_canary_and_keeps_stable():
    with LocalTarget(command("old"), command("new")) as target:
        canary = target.arms["canary"].handle
        target.set_traffic(25)
        target.rollback()
        state = target.router.state()
        assert state["weight"] == 0 and state["canary_url"] is None
        assert canary.poll() is not None and "canary" not in target.arms


def test_backend_spec_needs_exactly_one_source_and_a_port_placeholder():
    with pytest.raises(ValidationError, match="exactly one of url, command, fake"):
        BackendSpec()
    with pytest.raises(ValidationError, match=r"\{port\}"):
        BackendSpec(command=["kiln", "serve", "engine"])


def test_steps_must_increase():
    with pytest.raises(ValidationError, match="weights must increase"):
        DeployConfig(steps=[CanaryStep(weight=50), CanaryStep(weight=25)])
