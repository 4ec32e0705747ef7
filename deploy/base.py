"""The deploy-target contract: `set_traffic(weight)`, `observe(cursor)`, `promote()`, `rollback()`.

One file per target beside this one (local.py, kubernetes.py), each registered by name in
targets.py. The canary controller only talks to this contract, so the walk, the statistics and the
MLflow records are the same wherever the two arms run. `kiln deploy canary` reaches a target
through two hooks: `open(request)` builds it for a `DeployRequest` (the run's two engines, the
policy, the deploy section, the journal), and `walk(controller)`, inside its `with`, walks it: by
default kiln's controller (canary.py) steps it; a target whose platform walks the canary itself
(Argo Rollouts in a cluster) follows that walk instead.

`observe(cursor)` returns what happened since the previous look: per-arm, per-request values
(TTFT, TPOT, failures) and mirrored comparisons, plus the cursor for the next look. Keeping
individual requests (not aggregates) is what lets the controller run a sequential test on them.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from kiln.deploy.config import DeployConfig
from kiln.deploy.observations import Comparison, is_failure
from kiln.core.errors import KilnError
from kiln.core.gate.base import Evidence
from kiln.core.gate.policy import GateSection

R = TypeVar("R")


@dataclass
class ArmData:
    """One arm's requests in a window. errors has one 0/1 per request (1 = the arm failed it);
    latencies only for requests that succeeded."""

    ttft_ms: list[float] = field(default_factory=list)
    tpot_ms: list[float] = field(default_factory=list)
    errors: list[int] = field(default_factory=list)

    @property
    def requests(self) -> int:
        return len(self.errors)

    def add(self, obs: dict[str, Any]) -> None:
        if obs["status"] == 499:
            return  # the client left: says nothing about the arm
        failed = is_failure(obs["status"], obs["error"])
        self.errors.append(int(failed))
        if obs["error"] is None:
            if obs["ttft_s"] is not None:
                self.ttft_ms.append(obs["ttft_s"] * 1000)
            if obs["tpot_s"] is not None:
                self.tpot_ms.append(obs["tpot_s"] * 1000)

    def extend(self, other: ArmData) -> None:
        self.ttft_ms += other.ttft_ms
        self.tpot_ms += other.tpot_ms
        self.errors += other.errors

    def summary(self) -> dict[str, float]:
        out: dict[str, float] = {"requests": self.requests, "errors": sum(self.errors)}
        if self.errors:
            out["error_rate"] = sum(self.errors) / len(self.errors)
        import numpy as np  # here, not at import: the deploy targets are imported with every recipe

        for name, values in (("ttft_ms", self.ttft_ms), ("tpot_ms", self.tpot_ms)):
            if values:
                arr = np.asarray(values)
                out.update({f"{name}_mean": float(arr.mean()), f"{name}_p50": float(np.percentile(arr, 50)),
                            f"{name}_p95": float(np.percentile(arr, 95))})
        return out


@dataclass
class Observations:
    stable: ArmData = field(default_factory=ArmData)
    canary: ArmData = field(default_factory=ArmData)
    mirrored: list[Comparison] = field(default_factory=list)  # mirrored greedy prompts, scored
    cursor: tuple[int, int] = (0, 0)  # pass back to observe() for the next window

    def arm(self, name: str) -> ArmData:
        return self.canary if name == "canary" else self.stable

    def extend(self, other: Observations) -> None:
        self.stable.extend(other.stable)
        self.canary.extend(other.canary)
        self.mirrored += other.mirrored
        self.cursor = other.cursor

    def evidence(self) -> tuple[Evidence, Evidence]:
        """(candidate, baseline) Evidence of the aggregate values, for reports and MLflow."""
        out = []
        for role, data in (("candidate", self.canary), ("baseline", self.stable)):
            s = data.summary()
            metrics = {"ttft_ms": s["ttft_ms_mean"]} if "ttft_ms_mean" in s else {}
            if "tpot_ms_mean" in s:
                metrics.update(tpot_ms=s["tpot_ms_mean"], decode_tok_s=1000 / s["tpot_ms_mean"])
            if "error_rate" in s:
                metrics["error_rate"] = s["error_rate"]
            if role == "candidate" and self.mirrored:
                import numpy as np

                metrics["served_prefix"] = float(np.mean([c.prefix for c in self.mirrored]))
                metrics["served_match"] = float(np.mean([c.match for c in self.mirrored]))
            out.append(Evidence(role, metrics=metrics, counts={"error_rate": (int(s["errors"]), int(s["requests"]))}))
        return out[0], out[1]


@dataclass
class DeployRequest:
    """What `kiln deploy canary` hands the recipe's target: one registered version to walk against the
    stable one. A target reads what applies to it (a cluster has no local port, a local walk no image)."""

    name: str  # the app: the recipe's name (the Kubernetes objects are named after it)
    policy: GateSection
    deploy: DeployConfig
    stable: Path  # the stable arm's engine folder (the run's baseline)
    candidate: Path  # the canary's engine folder (the run's candidate)
    version: tuple[str, str] | None = None  # the registered (model, version) walking, when it is registered
    journal: Any = None  # a journal.CanaryJournal recording the walk (None: nothing is recorded)
    log: Callable[[str], None] = print
    port: int = 8080  # where clients reach a walk on this machine
    api_key: str | None = None  # the key those clients send
    keep_serving: bool = False  # after the walk, serve the winner until SIGTERM (a walk on this machine)
    state_path: Path | None = None  # the walk's state, for recovering one whose controller died
    log_path: str | None = None


class DeployTarget(abc.ABC):
    """Where the stable and canary arms run. Implementations are context managers."""

    name: ClassVar[str]

    @classmethod
    def open(cls, request: DeployRequest) -> DeployTarget:
        """This target for `request`, not yet entered (`with` starts it): what `kiln deploy canary` walks."""
        raise KilnError(f"deploy target '{getattr(cls, 'name', cls.__name__)}' cannot be started by "
                        "`kiln deploy canary` (it defines no `open`)")

    def walk(self, controller: Callable[[DeployTarget], R]) -> R:
        """Walk the canary on this started target: by default `controller` (kiln's, canary.run_canary with
        the request's policy and journal) steps it through set_traffic/observe/promote/rollback."""
        return controller(self)

    @abc.abstractmethod
    def set_traffic(self, weight: float) -> None:
        """Send `weight` percent of traffic to the canary (0 = none, 100 = all)."""

    @abc.abstractmethod
    def observe(self, cursor: tuple[int, int] = (0, 0)) -> Observations:
        """Requests finished since `cursor` (from the previous Observations), per arm."""

    @abc.abstractmethod
    def promote(self) -> None:
        """Make the canary the new stable and give it all traffic."""

    @abc.abstractmethod
    def rollback(self) -> None:
        """Give stable all traffic and retire the canary."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release what the target started."""

    def __enter__(self) -> DeployTarget:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def observations_from(payload: dict[str, Any]) -> Observations:
    """Build Observations from the router's GET /admin/observations answer."""
    obs = Observations(cursor=(int(payload["next"]), int(payload["next_mirror"])))
    for item in payload["observations"]:
        obs.arm(item["arm"]).add(item)
    obs.mirrored = [Comparison(**c) for c in payload["comparisons"]]
    return obs
