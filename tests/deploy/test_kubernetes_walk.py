"""`kiln deploy canary` on `deploy.target: kubernetes` (KubernetesTarget through kiln.deploy.run.deploy_canary),
against a fake `kubectl` on PATH that answers as a cluster would and records every call: what a cluster
lacks is named before anything is applied; with everything there the rendered manifests are applied and
Argo's walk is followed to its end (promoted, aborted, stalled, paused undecided), the journal settled
accordingly. No real cluster is reached here (none exists on this machine): the fake answers with the
fields Argo Rollouts v1 writes (status.observedGeneration, phase, abort, pauseConditions, currentStepIndex)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from kiln.deploy.base import DeployRequest
from kiln.deploy.config import CanaryStep, DeployConfig, RouterOptions
from kiln.deploy.journal import CanaryJournal
from kiln.deploy.kubernetes import render
from kiln.deploy.run import deploy_canary
from kiln.core.errors import ExitCode, KilnError
from kiln.core.gate.policy import GateSection

POLICY = GateSection.model_validate({"checks": [
    {"kind": "error_rate", "max": 0.01},
    {"kind": "agreement", "metric": "served_prefix", "min": 0.6},
]})
DEPLOY = DeployConfig(target="kubernetes", poll_s=0.01, router=RouterOptions(mirror_fraction=0.1),
                      steps=[CanaryStep(weight=25), CanaryStep(weight=100)])
EVERYTHING = {"reachable": True,
              "resources": ["rollouts.argoproj.io", "analysistemplates.argoproj.io", "scaledobjects.keda.sh"],
              "objects": {"secret/smol-api-key": ["admin-key", "api-key", "upstream-key"], "secret/smol-tracking": ["uri"],
                          "configmap/smol-trusted-keys": ["kiln.pub"]}}

FAKE = r'''#!PYTHON
"""A kubectl that answers from scenario.json beside it and records each call in calls.jsonl."""
import json, sys
from pathlib import Path

import yaml

here = Path(__file__).parent
scenario = json.loads((here / "scenario.json").read_text())
args = sys.argv[1:]
with open(here / "calls.jsonl", "a") as f:
    f.write(json.dumps(args) + "\n")
if args[:1] == ["version"]:
    if not scenario["reachable"]:
        sys.exit("The connection to the server 127.0.0.1:6443 was refused - did you specify the right host or port?")
    print(json.dumps({"clientVersion": {"gitVersion": "v1.31.0"}, "serverVersion": {"gitVersion": "v1.31.0"}}))
elif args[:2] == ["config", "current-context"]:
    print("kind-kiln")
elif args[:1] == ["api-resources"]:
    print("\n".join(["pods", "services", "deployments.apps", *scenario["resources"]]))
elif args[:1] == ["apply"]:
    text = sys.stdin.read()
    (here / "applied.yaml").write_text(text)
    items = [{**d, "metadata": {**d["metadata"], "generation": 2}} for d in yaml.safe_load_all(text) if d]
    print(json.dumps({"kind": "List", "items": items}))
elif args[2:4] == ["get", "rollout"]:
    if scenario.get("lost"):
        sys.exit("Unable to connect to the server: dial tcp 127.0.0.1:6443: connect: connection refused")
    seen = here / "polls"
    n = int(seen.read_text()) if seen.exists() else 0
    seen.write_text(str(n + 1))
    statuses = scenario["statuses"]
    print(json.dumps({"kind": "Rollout", "status": statuses[min(n, len(statuses) - 1)]}))
elif args[2:3] == ["get"]:
    keys = scenario["objects"].get(f"{args[3]}/{args[4]}")
    if f"{args[3]}/{args[4]}" in scenario.get("forbidden", []):
        sys.exit(f'Error from server (Forbidden): {args[3]}s "{args[4]}" is forbidden: User "dev" cannot get it')
    if keys is None:
        sys.exit(f'Error from server (NotFound): {args[3]}s "{args[4]}" not found')
    print(" ".join(keys))
elif args[2:3] == ["patch"]:
    print(f"rollout.argoproj.io/{args[4]} patched")
else:
    sys.exit(f"fake kubectl: unexpected {args}")
'''


class Journal(CanaryJournal):
    def __init__(self) -> None:
        super().__init__("smol", "2")
        self.calls: list[tuple[str, object]] = []

    def start(self, deploy, policy):
        self.calls.append(("start", deploy.target))
        return "run-1"

    def settle(self, status):
        self.calls.append(("settle", status))

    def finish(self, result):
        self.calls.append(("finish", result.status))


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    """write(scenario) -> the fake kubectl's folder, first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    kubectl = bin_dir / "kubectl"
    kubectl.write_text(FAKE.replace("#!PYTHON", f"#!{sys.executable}", 1))
    kubectl.chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))

    def write(scenario: dict) -> Path:
        (bin_dir / "scenario.json").write_text(json.dumps(scenario))
        return bin_dir
    return write


def _walk(tmp_path: Path, journal: CanaryJournal | None = None, log: list[str] | None = None):
    request = DeployRequest("smol", POLICY, DEPLOY, tmp_path / "baseline", tmp_path / "candidate",
                            version=("smol", "2"), journal=journal, log=(log if log is not None else []).append)
    return deploy_canary(request)


def _calls(bin_dir: Path) -> list[list[str]]:
    path = bin_dir / "calls.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_an_unreachable_cluster_is_named_with_kubectls_context_and_answer(cluster, tmp_path):
    bin_dir = cluster({**EVERYTHING, "reachable": False})
    with pytest.raises(KilnError) as e:
        _walk(tmp_path)
    message = str(e.value)
    assert "a cluster kubectl reaches: its current context (kind-kiln)" in message, message
    assert "127.0.0.1:6443 was refused" in message and "kiln deploy render" in message
    assert not any(c[:1] == ["apply"] for c in _calls(bin_dir))


def test_an_object_this_context_may_not_read_is_named_not_taken_as_there(cluster, tmp_path):
    bin_dir = cluster({**EVERYTHING, "forbidden": ["secret/smol-api-key"]})
    with pytest.raises(KilnError) as e:
        _walk(tmp_path)
    assert "secret smol-api-key in namespace default, readable by this context" in str(e.value), str(e.value)
    assert "Forbidden" in str(e.value)
    assert not any(c[:1] == ["apply"] for c in _calls(bin_dir))


def test_every_missing_piece_is_named_before_anything_is_applied(cluster, tmp_path):
    bin_dir = cluster({**EVERYTHING, "resources": ["scaledobjects.keda.sh"],
                       "objects": {"secret/smol-api-key": ["api-key"], "configmap/smol-trusted-keys": ["kiln.pub"]}})
    with pytest.raises(KilnError) as e:
        _walk(tmp_path)
    lines = str(e.value).splitlines()
    assert any("rollouts.argoproj.io" in line and "install Argo Rollouts" in line for line in lines), lines
    assert any("analysistemplates.argoproj.io" in line for line in lines), lines
    # the router's keys: named, and the kubectl line that makes the Secret with all three
    assert any(line.startswith("  - key upstream-key in secret smol-api-key") and "--from-literal=admin-key=<key>"
               in line for line in lines), lines
    assert any(line.startswith("  - key admin-key in secret smol-api-key") for line in lines), lines
    assert any(line.startswith("  - secret smol-tracking in namespace default") for line in lines), lines
    assert not any("trusted-keys" in line for line in lines), lines
    assert not any(c[:1] == ["apply"] for c in _calls(bin_dir))
    # a Secret's values never pass through kiln: only its key names are asked for
    gets = [c for c in _calls(bin_dir) if c[2:3] == ["get"]]
    assert gets and all(c[-1].startswith("go-template=") for c in gets), gets


def test_the_rendered_manifests_are_applied_and_argos_walk_followed_to_promotion(cluster, tmp_path):
    statuses = [{"observedGeneration": "1", "phase": "Healthy", "stableRS": "a", "currentPodHash": "a"},  # before
                {"observedGeneration": "2", "phase": "Progressing", "currentStepIndex": 1, "currentPodHash": "b"},
                {"observedGeneration": "2", "phase": "Progressing", "currentStepIndex": 2, "currentPodHash": "b"},
                {"observedGeneration": "2", "phase": "Progressing", "currentStepIndex": 5, "currentPodHash": "b"},
                {"observedGeneration": "2", "phase": "Healthy", "stableRS": "b", "currentPodHash": "b"}]
    bin_dir = cluster({**EVERYTHING, "statuses": statuses})
    journal, log = Journal(), []
    result = _walk(tmp_path, journal, log)
    assert (result.status, result.exit_code) == ("promoted", ExitCode.PASSED), result.reason
    assert (result.model, result.version, result.run_id) == ("smol", "2", "run-1")
    assert journal.calls == [("start", "kubernetes"), ("settle", "promoted"), ("finish", "promoted")]
    # what was applied is what `kiln deploy render --model-version 2` writes: each pod verifies version 2
    applied = (bin_dir / "applied.yaml").read_text()
    assert applied == render("smol", POLICY, DEPLOY, ("smol", "2")).yaml()
    assert {d["kind"] for d in yaml.safe_load_all(applied)} >= {"Rollout", "Deployment", "AnalysisTemplate", "Service"}
    steps = [line for line in log if line.startswith("canary: rollout step")]
    assert steps == ["canary: rollout step 2/7: 25% of the pods on the canary",
                     "canary: rollout step 3/7: the router sends 25% to the canary",
                     "canary: rollout step 6/7: the router sends 100% to the canary"], log
    assert polls(bin_dir) == len(statuses)


def polls(bin_dir: Path) -> int:
    return int((bin_dir / "polls").read_text())


@pytest.mark.parametrize("end, expected", [
    ({"phase": "Degraded", "abort": True, "message": "RolloutAborted: Metric \"error-rate\" assessed Failed"},
     ("rolled_back", ExitCode.GATE_FAILED, "assessed Failed", False)),
    ({"phase": "Degraded", "message": "ProgressDeadlineExceeded: ReplicaSet \"smol-b\" has timed out progressing."},
     ("rolled_back", ExitCode.INTERNAL_ERROR, "kiln aborted it", True)),
    ({"phase": "Paused", "pauseConditions": [{"reason": "InconclusiveAnalysisRun"}]},
     ("held", ExitCode.GATE_INCONCLUSIVE, "Inconclusive", False)),
])
def test_argos_other_endings_roll_back_or_hold_and_a_stalled_rollout_is_aborted(cluster, tmp_path, end, expected):
    statuses = [{"observedGeneration": "2", "phase": "Progressing", "currentStepIndex": 0},
                {"observedGeneration": "2", "currentPodHash": "b", **end}]
    bin_dir = cluster({**EVERYTHING, "statuses": statuses})
    journal = Journal()
    result = _walk(tmp_path, journal)
    status, code, said, aborted = expected
    assert (result.status, result.exit_code) == (status, code) and said in result.reason, result.reason
    assert journal.calls[1] == ("settle", status)
    patches = [c for c in _calls(bin_dir) if c[2:3] == ["patch"]]
    assert bool(patches) == aborted
    if aborted:  # what `kubectl argo rollouts abort` does
        assert patches[0][:5] == ["-n", "default", "patch", "rollout", "smol"] and "--subresource" in patches[0]
        assert json.loads(patches[0][-1]) == {"status": {"abort": True}}


def test_losing_the_cluster_mid_walk_says_the_walk_goes_on_there(cluster, tmp_path):
    bin_dir = cluster({**EVERYTHING, "lost": True})
    journal = Journal()
    result = _walk(tmp_path, journal)
    assert (result.status, result.exit_code) == ("held", ExitCode.INTERNAL_ERROR), result.reason
    assert "lost track" in result.reason and "connection refused" in result.reason
    assert "kubectl argo rollouts get rollout smol -n default --watch" in result.reason
    assert journal.calls[-1] == ("finish", "held")  # the journal's run is closed, not left running
    assert len([c for c in _calls(bin_dir) if c[2:4] == ["get", "rollout"]]) == 5
