"""kubectl, as the Kubernetes target drives a cluster with it: what is missing, apply, follow a Rollout.

kiln talks to a cluster only through the `kubectl` on PATH and its current context (no client
library, no credentials of its own): what works in the user's shell works here. Before anything is
applied `missing()` lists every piece the rendered manifests need and the cluster lacks: kubectl
itself, a reachable API server, the CRDs (Argo Rollouts', KEDA's), the Secrets and ConfigMaps the pods
read. Then `apply` and `rollout` (the Rollout's status, polled by KubernetesTarget.walk), and `abort`,
what `kubectl argo rollouts abort` does (status.abort on the status subresource), without the plugin.

`outcome(rollout, generation)` reads Argo Rollouts' status (v1: status.observedGeneration, phase
Healthy | Degraded | Paused | Progressing, abort, pauseConditions) into how the walk ended, or None
while it goes on.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass
from typing import Any

from kiln.core.errors import ExitCode, KilnError

KEY_NAMES = "go-template={{range $k, $v := .data}}{{$k}} {{end}}"  # a Secret's or ConfigMap's keys, not their values


@dataclass(frozen=True)
class Required:
    """An object the pods read that the manifests do not create (it holds secrets or the user's keys)."""

    kind: str  # "secret" | "configmap"
    name: str
    keys: tuple[str, ...]
    why: str
    create: str  # the kubectl command that makes it

    def line(self) -> str:
        what = "Secret" if self.kind == "secret" else "ConfigMap"
        keys = ", ".join(self.keys)
        return f"{what} {self.name} (key{'s' if len(self.keys) > 1 else ''} {keys}) must exist before the Rollout: " \
               f"{self.why}: {self.create}"


class Kubectl:
    """`kubectl` (found on PATH) in its current context."""

    def __init__(self, binary: str = "kubectl", timeout_s: float = 60):
        self.binary, self.timeout_s = binary, timeout_s

    def run(self, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        path = shutil.which(self.binary)
        if path is None:
            raise KilnError(f"{self.binary} is not on PATH")
        try:
            return subprocess.run([path, *args], input=stdin, capture_output=True, text=True, timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            return subprocess.CompletedProcess([path, *args], 124, "", f"no answer within {self.timeout_s:g} s")

    def missing(self, namespace: str, resources: list[str], objects: list[Required]) -> list[str]:
        """What the manifests need and this kubectl cannot reach: each line names it and how to get it."""
        if shutil.which(self.binary) is None:
            return [f"kubectl on PATH (none found): install it (https://kubernetes.io/docs/tasks/tools/) and point "
                    "its current context at the cluster"]
        version = self.run("version", "-o", "json", "--request-timeout=15s")
        if version.returncode != 0 or "serverVersion" not in version.stdout:
            context = self.run("config", "current-context").stdout.strip() or "none set"
            said = (version.stderr.strip().splitlines() or ["no server version"])[-1]
            return [f"a cluster kubectl reaches: its current context ({context}) answers: {said}"]
        known = set(self.run("api-resources", "-o", "name").stdout.split())
        lines = [f"the custom resource {r} in the cluster: {_INSTALL.get(r.split('.', 1)[1], 'install its CRDs')}"
                 for r in resources if r not in known]
        for o in objects:  # the key names only: a Secret's values never leave the cluster
            got = self.run("-n", namespace, "get", o.kind, o.name, "-o", KEY_NAMES)
            if got.returncode == 0:
                lines += [f"key {key} in {o.kind} {o.name}: {o.why}: {o.create}"
                          for key in o.keys if key not in got.stdout.split()]
            elif "NotFound" in got.stderr:
                lines.append(f"{o.kind} {o.name} in namespace {namespace}: {o.why}: {o.create}")
            else:  # Forbidden, a timeout...: unread is not there, as far as the pods' walk can tell
                said = (got.stderr.strip().splitlines() or [f"exit {got.returncode}"])[-1]
                lines.append(f"{o.kind} {o.name} in namespace {namespace}, readable by this context: kubectl says "
                             f"{said}")
        return lines

    def apply(self, manifests: str) -> list[dict[str, Any]]:
        """kubectl apply the YAML stream; the objects as the API server stored them."""
        done = self.run("apply", "-f", "-", "-o", "json", stdin=manifests)
        if done.returncode != 0:
            raise KilnError(f"kubectl apply refused the manifests: {done.stderr.strip()[-2000:]}")
        applied = json.loads(done.stdout)
        return applied.get("items", [applied]) if applied.get("kind") == "List" else [applied]

    def rollout(self, namespace: str, name: str) -> dict[str, Any]:
        got = self.run("-n", namespace, "get", "rollout", name, "-o", "json")
        if got.returncode != 0:
            raise KilnError(f"kubectl get rollout {name}: {got.stderr.strip()[-1000:]}")
        return json.loads(got.stdout)

    def abort(self, namespace: str, name: str) -> None:
        """Argo moves all traffic back to stable and scales the canary down (`kubectl argo rollouts abort`)."""
        done = self.run("-n", namespace, "patch", "rollout", name, "--type", "merge", "--subresource", "status",
                        "-p", json.dumps({"status": {"abort": True}}))
        if done.returncode != 0:
            raise KilnError(f"kubectl could not abort rollout {name}: {done.stderr.strip()[-1000:]}")


_INSTALL = {  # API group -> how its CRDs get into a cluster
    "argoproj.io": "install Argo Rollouts (kubectl create namespace argo-rollouts; kubectl apply -n argo-rollouts -f "
                   "https://github.com/argoproj/argo-rollouts/releases/latest/download/install.yaml)",
    "keda.sh": "install KEDA (https://keda.sh/docs/deploy/), or set deploy.kubernetes.autoscaler: hpa or none",
}


def outcome(rollout: dict[str, Any], generation: int | str) -> tuple[str, ExitCode, str] | None:
    """How Argo's walk of `generation` (the applied Rollout's metadata.generation) ended, or None while it
    goes on: (status, exit code, reason), status one of promoted | rolled_back | held | degraded."""
    status = rollout.get("status") or {}
    if str(status.get("observedGeneration")) != str(generation):
        return None  # Argo has not yet seen this revision: what the status says is the previous one's
    message = status.get("message") or ""
    if status.get("abort"):
        return "rolled_back", ExitCode.GATE_FAILED, f"Argo Rollouts aborted the rollout: {message or 'no message'}"
    phase = status.get("phase")
    if phase == "Healthy" and status.get("stableRS") == status.get("currentPodHash"):
        return "promoted", ExitCode.PASSED, "every step's analysis passed; the canary is the stable ReplicaSet"
    if phase == "Degraded":
        return "degraded", ExitCode.INTERNAL_ERROR, f"Argo Rollouts reports the rollout Degraded: {message}"
    pauses = [c.get("reason") for c in status.get("pauseConditions") or []]
    if phase == "Paused" and "InconclusiveAnalysisRun" in pauses:
        return "held", ExitCode.GATE_INCONCLUSIVE, ("a step's analysis ended Inconclusive and Argo paused the rollout "
                                                    "(deploy.on_inconclusive: hold): kubectl argo rollouts promote or "
                                                    "abort it")
    return None
