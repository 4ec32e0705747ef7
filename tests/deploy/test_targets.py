"""Deploy targets by name (deploy/targets.py): `deploy.target` is checked against the registry when the
recipe loads (an unknown name is BadInput with "Did you mean"), and `kiln deploy canary`'s one path,
`kiln.deploy.run.deploy_canary`, reaches whatever target the recipe names: a toy one registered from one
file, the local one, or the Kubernetes one, which names what it is missing rather than walking anywhere else."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest
import yaml

from kiln.deploy.base import DeployRequest
from kiln.deploy.config import CanaryStep, DeployConfig
from kiln.deploy.kubernetes import KubernetesTarget
from kiln.deploy.local import LocalTarget
from kiln.deploy.run import deploy_canary
from kiln.deploy.targets import TARGETS
from kiln.core.errors import BadInput, ExitCode, KilnError
from kiln.core.gate.policy import GateSection
from kiln.pipeline.recipe.schema import load_recipe

POLICY = GateSection.model_validate({"checks": [{"kind": "error_rate", "max": 0.05}]})

# The whole of a new target: one file, registered when imported (in kiln, one import line in deploy/__init__.py).
TOY = '''
from pydantic import BaseModel

from kiln.deploy.base import ArmData, DeployTarget, Observations
from kiln.deploy.targets import TARGETS


class ToyConfig(BaseModel):
    pass


@TARGETS.register("toy", ToyConfig)
class ToyTarget(DeployTarget):
    """Two arms that answer every request well, 100 per look each."""

    opened = []  # the requests `kiln deploy canary` opened it for
    history = []

    @classmethod
    def open(cls, request):
        cls.opened.append(request)
        return cls()

    def __enter__(self):
        self.history.append(("enter", 0))
        return self

    def set_traffic(self, weight):
        self.history.append(("weight", weight))

    def observe(self, cursor=(0, 0)):
        arm = ArmData(ttft_ms=[50.0] * 100, tpot_ms=[10.0] * 100, errors=[0] * 100)
        return Observations(stable=arm, canary=ArmData(list(arm.ttft_ms), list(arm.tpot_ms), list(arm.errors)),
                            cursor=(cursor[0] + 1, 0))

    def promote(self):
        self.history.append(("promote", 100))

    def rollback(self):
        self.history.append(("rollback", 0))

    def close(self):
        self.history.append(("close", 0))
'''


@pytest.fixture
def toy(tmp_path, monkeypatch):
    """The toy target's file imported from tmp_path (registering it); unregistered afterwards."""
    (tmp_path / "toy_target.py").write_text(TOY)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("toy_target")
    yield module.ToyTarget
    for table in (TARGETS._plugins, TARGETS._configs):
        table.pop("toy", None)
    sys.modules.pop("toy_target", None)


def _recipe(tmp_path: Path, deploy: dict) -> Path:
    recipe = {"name": "smol", "model": {"path": "demo"}, "optimize": {"method": "none"},
              "gate": {"checks": [{"kind": "size", "max_ratio": 1.0}]}, "deploy": deploy}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def _request(tmp_path: Path, deploy: DeployConfig, **kw) -> DeployRequest:
    """What `kiln deploy canary` builds from a run (pipeline/cli/ops.py)."""
    return DeployRequest("smol", POLICY, deploy, tmp_path / "engine-baseline", tmp_path / "engine-candidate",
                         version=("smol", "2"), log=lambda _: None, **kw)


def test_a_toy_target_in_one_file_is_what_deploy_target_toy_reaches(toy, tmp_path):
    assert "toy" in TARGETS.names()
    assert DeployConfig.model_json_schema()["properties"]["target"]["enum"] == ["kubernetes", "local", "toy"]  # kiln schema
    recipe = load_recipe(_recipe(tmp_path, {"target": "toy", "poll_s": 0.01,
                                            "steps": [{"weight": 25, "min_requests": 50}, {"weight": 100}]}))
    assert recipe.deploy.target == "toy"
    result = deploy_canary(_request(tmp_path, recipe.deploy))
    assert result.status == "promoted" and result.exit_code == ExitCode.PASSED, result.reason
    [request] = toy.opened
    assert request.deploy.target == "toy" and request.candidate == tmp_path / "engine-candidate"
    # kiln's controller walked it: each step's weight, then promotion, inside its `with`
    assert toy.history == [("enter", 0), ("weight", 25), ("weight", 100), ("promote", 100), ("close", 0)]


def test_an_unknown_target_is_bad_input_with_did_you_mean(toy, tmp_path):
    with pytest.raises(BadInput) as e:
        load_recipe(_recipe(tmp_path, {"target": "kubernetse"}))
    assert "deploy.target" in str(e.value) and "Did you mean 'kubernetes'?" in str(e.value)
    assert "Available: kubernetes, local, toy." in str(e.value)
    with pytest.raises(BadInput, match="Did you mean 'toy'"):
        load_recipe(_recipe(tmp_path, {"target": "tyo"}))
    # and on the path itself, for a section that skipped validation
    unchecked = DeployConfig.model_construct(**{**DeployConfig().__dict__, "target": "locl"})
    with pytest.raises(BadInput, match="Unknown deploy target 'locl'. Did you mean 'local'?"):
        deploy_canary(_request(tmp_path, unchecked))


def test_the_default_stays_local_and_the_section_dumps_as_before():
    assert DeployConfig().target == "local" and TARGETS.get("local") is LocalTarget
    assert TARGETS.get("kubernetes") is KubernetesTarget
    assert DeployConfig().model_dump()["target"] == "local"
    assert DeployConfig(target="kubernetes").model_dump(mode="json")["target"] == "kubernetes"


def test_kubernetes_without_kubectl_names_what_is_missing_and_never_walks_locally(tmp_path, monkeypatch):
    """No kubectl on PATH: a KilnError (exit 4) saying so, and no local arm or router started."""
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))

    def local(*_: object) -> None:
        raise AssertionError("the local target was started for deploy.target kubernetes")
    monkeypatch.setattr(LocalTarget, "open", classmethod(local))
    deploy = DeployConfig(target="kubernetes", steps=[CanaryStep(weight=50), CanaryStep(weight=100)])
    with pytest.raises(KilnError) as e:
        deploy_canary(_request(tmp_path, deploy))
    message = str(e.value)
    assert e.value.exit_code == ExitCode.INTERNAL_ERROR
    assert "kubectl on PATH (none found)" in message and "kiln deploy render" in message, message


def test_kiln_deploy_canary_with_target_kubernetes_says_what_is_missing(mlflow_registry, tmp_path):
    """The command itself, on a registered run whose recipe says kubernetes, with no kubectl on PATH."""
    from tests.pipeline.conftest import kiln

    run = tmp_path / "run"
    (run / "stages").mkdir(parents=True)
    for role in ("baseline", "candidate"):
        engine, stage = tmp_path / f"engine-{role}", tmp_path / f"stage-{role}"
        engine.mkdir()
        stage.mkdir()
        (engine / "kiln-engine.json").write_text("{}")
        (stage / "result.json").write_text(json.dumps({"engine_dir": str(engine)}))
        (run / "stages" / f"engine-{role}.json").write_text(json.dumps({"path": str(stage)}))
    recipe = {"name": "smol", "model": {"path": "demo"}, "optimize": {"method": "none"},
              "tracking": {"uri": mlflow_registry.uri, "registered_model": "smol"},
              "evaluate": {"load": {"shape": {"kind": "constant", "rate": 1.0}}},
              "gate": {"checks": [{"kind": "error_rate", "max": 0.01}]}, "deploy": {"target": "kubernetes"}}
    (run / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    (run / "state.json").write_text(json.dumps({"status": "done", "mlflow_parent": None}))
    (run / "registry.json").write_text(json.dumps({"name": "smol", "version": "2"}))
    env = {"PATH": str(tmp_path / "empty")}  # no kubectl anywhere
    proc = kiln("deploy", "canary", str(run), "--force", "--reason", "no attestation in this folder",
                cwd=tmp_path, env=env, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == ExitCode.INTERNAL_ERROR, out
    assert "deploy.target kubernetes" in out and "kubectl on PATH" in out and "Traceback" not in out, out
    assert "router on" not in out and not (run / "deploy-state.json").exists()  # nothing walked here


def test_a_target_without_open_cannot_be_walked_and_says_so(tmp_path):
    from kiln.deploy.simulated import ArmModel, SimulatedTarget

    with pytest.raises(KilnError, match="cannot be started by `kiln deploy canary`"):
        SimulatedTarget.open(_request(tmp_path, DeployConfig()))
    assert SimulatedTarget(ArmModel(), ArmModel()).walk(lambda t: "walked by " + type(t).__name__) == \
        "walked by SimulatedTarget"
