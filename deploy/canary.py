"""The canary controller behind `kiln deploy`: walk the recipe's traffic steps, judge canary vs
stable on live data with the gate policy at every look, then promote or roll back by itself.

Per step (weight w, min_requests, max_duration_s): set the canary to w percent, then every
`poll_s` read the new observations, feed the live gate (live_gate.py: one always-valid sequential
test per check, for the whole walk) and act:
- any check Failed            -> weight 0, roll back (exit 1) - at any look, without waiting;
- all Successful and the step saw min_requests canary requests -> next step;
- max_duration_s passed first -> Inconclusive: `deploy.on_inconclusive` holds (stop walking,
  traffic stays where it is, exit 3) or rolls back (exit 3); if the gate policy itself says
  `on_inconclusive: pass`, the step advances instead.
Successful at the last step -> promote: the target makes the canary the stable arm and the MLflow
registry alias `champion` moves to the candidate's version. Rollback leaves `champion` where it
was and tags the version `kiln.deploy=rolled_back`.

A target that fails mid-walk (the local router died and was restarted with stable only, an
unreachable router) ends the walk rolled back (exit 4), never with stable torn down. The walk's
state (step, weight, the target's urls and process ids) is written atomically to `state_path` at
every change, so a controller that crashed can be cleaned up after (`recover_crashed_walk`).

Every step is a child MLflow run (tags kiln.stage=canary-step, kiln.weight, kiln.verdict) with
its evidence: per-arm summaries and every check's estimate and confidence sequence.
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kiln.deploy.base import DeployTarget, Observations
from kiln.deploy.config import CanaryStep, DeployConfig
from kiln.deploy.live_gate import LiveGate
from kiln.core.stats import Verdict, jsonable
from kiln.core.errors import ExitCode, KilnError
from kiln.core.files import atomic_write_json, read_json
from kiln.core.gate.policy import GateOutcome, GateSection
from kiln.pipeline.model_registry import CHALLENGER



@dataclass
class StepRecord:
    index: int
    weight: float
    verdict: str
    action: str  # advance | promote | rollback | hold
    reason: str
    seconds: float
    stable: dict[str, float]
    canary: dict[str, float]
    checks: list[dict[str, Any]]
    run_id: str | None = None


@dataclass
class CanaryResult:
    status: str  # promoted | rolled_back | held
    exit_code: ExitCode
    reason: str
    steps: list[StepRecord] = field(default_factory=list)
    skipped_checks: list[dict[str, str]] = field(default_factory=list)
    model: str | None = None
    version: str | None = None
    run_id: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return jsonable({**asdict(self), "exit_code": int(self.exit_code)})


class Controller:
    """Walks one canary. `tracker` (kiln.pipeline.tracking.Tracker) and `model` (registered model
    name; `version` defaults to the one holding alias 'challenger') are optional."""

    def __init__(self, target: DeployTarget, policy: GateSection, deploy: DeployConfig, tracker: Any = None,
                 model: str | None = None, version: str | None = None, parent_run_id: str | None = None,
                 log: Callable[[str], None] = print, sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.monotonic, state_path: Path | None = None):
        self.target, self.policy, self.deploy = target, policy, deploy
        self.tracker, self.model, self.parent_run_id = tracker, model, parent_run_id
        self.version = version
        self.log, self.sleep, self.clock = log, sleep, clock
        self.gate = LiveGate(policy, min_per_arm=deploy.min_per_arm, effect_scale=deploy.effect_scale,
                             mirroring=deploy.router.mirror_fraction > 0)
        self.cursor: tuple[int, int] = (0, 0)
        self.state_path = state_path

    def _save(self, status: str, **extra: Any) -> None:
        if self.state_path is None:
            return
        describe = getattr(self.target, "describe", dict)
        atomic_write_json(self.state_path, jsonable({"status": status, "controller_pid": os.getpid(),
                                                     "target": describe(), "time": time.time(), **extra}))

    def run(self) -> CanaryResult:
        if self.model and self.tracker and self.version is None:
            self.version = str(self.tracker.client.get_model_version_by_alias(self.model, CHALLENGER).version)
        run_id = self._start_run()
        result = CanaryResult("rolled_back", ExitCode.INTERNAL_ERROR, "interrupted", skipped_checks=self.gate.skipped,
                              model=self.model, version=self.version, run_id=run_id)
        for s in self.gate.skipped:
            self.log(f"canary: check {s['check']} not judged live: {s['reason']}")
        try:
            self.cursor = self.target.observe((0, 0)).cursor  # what came before the walk does not count
            for i, step in enumerate(self.deploy.steps):
                self._save("walking", step=i, weight=step.weight)
                record = self._step(i, step, last=i == len(self.deploy.steps) - 1, parent=run_id)
                result.steps.append(record)
                if record.action != "advance":
                    break
            last = result.steps[-1]
            result.reason = last.reason
            result.status, result.exit_code = {
                "promote": ("promoted", ExitCode.PASSED),
                "hold": ("held", ExitCode.GATE_INCONCLUSIVE),
            }.get(last.action, ("rolled_back", _rollback_code(last.verdict)))
        except KilnError as e:  # the target failed mid-walk: roll back, keep stable serving
            result.reason = f"the walk stopped at step {len(result.steps) + 1}: {e}"
            self.log(f"canary: {result.reason}; rolling back")
        finally:
            self._finish(result, run_id)
        return result

    def _step(self, index: int, step: CanaryStep, last: bool, parent: str | None) -> StepRecord:
        self.target.set_traffic(step.weight)
        self.log(f"canary: step {index + 1}/{len(self.deploy.steps)}: {step.weight:g}% to the canary")
        window, start = Observations(), self.clock()
        while True:
            self.sleep(self.deploy.poll_s)
            obs = self.target.observe(self.cursor)
            self.cursor = obs.cursor
            window.extend(obs)
            self.gate.update(obs)
            outcome = self.gate.judge()
            elapsed = self.clock() - start
            action, reason = self._decide(outcome, window.canary.requests, step, elapsed, last)
            if action is not None:
                break
        record = StepRecord(index, step.weight, outcome.verdict.value, action, reason, elapsed,
                            window.stable.summary(), window.canary.summary(), [r.to_dict() for r in outcome.results])
        record.run_id = self._log_step(record, parent, window)
        self.log(f"canary: step {index + 1}: {outcome.verdict.value} -> {action}: {reason}")
        return record

    def _decide(self, outcome: GateOutcome, n_canary: int, step: CanaryStep, elapsed: float,
                last: bool) -> tuple[str | None, str]:
        """What to do after this look; (None, _) means keep looking."""
        verdict = outcome.verdict
        failing = [f"{r.name}: {r.reason}" for r in outcome.results if r.verdict in (Verdict.FAILED, Verdict.ERROR)]
        if verdict in (Verdict.FAILED, Verdict.ERROR):
            return "rollback", "; ".join(failing)
        passed = verdict == Verdict.SUCCESSFUL and n_canary >= step.min_requests
        if not passed and elapsed < step.max_duration_s:
            return None, ""
        if not passed and self.policy.on_inconclusive != "pass":
            undecided = [r.name for r in outcome.results if r.verdict != Verdict.SUCCESSFUL]
            why = (f"after {elapsed:.0f} s: {n_canary}/{step.min_requests} canary requests; "
                   f"undecided: {', '.join(undecided) or 'none'}")
            return self.deploy.on_inconclusive, why
        return ("promote" if last else "advance"), f"{n_canary} canary requests, every live check {verdict.value}"

    # --- effects: target, MLflow ---------------------------------------------------------------
    def _finish(self, result: CanaryResult, run_id: str | None) -> None:
        try:
            if result.status == "promoted":
                self.target.promote()
            elif result.status == "rolled_back":
                self.target.set_traffic(0)
                self.target.rollback()
        except Exception as e:  # noqa: BLE001 - a failed rollback must still be recorded
            verb = "promote" if result.status == "promoted" else "roll back"
            result.status, result.exit_code = f"{result.status}_incomplete", ExitCode.INTERNAL_ERROR
            result.reason += f"; the target failed to {verb}: {type(e).__name__}: {e}"
        self._save(result.status, reason=result.reason)
        self._registry(result.status)
        if self.tracker and run_id:
            self.tracker.log(run_id, metrics={"steps_completed": len(result.steps)},
                             tags={"kiln.verdict": result.status, "kiln.reason": result.reason[:5000]})
            self.tracker.end(run_id, "FINISHED" if result.exit_code != ExitCode.INTERNAL_ERROR else "FAILED")
        self.log(f"canary: {result.status}: {result.reason}")

    def _registry(self, status: str) -> None:
        """Move 'champion' to the candidate on promotion; tag the version with the outcome either way."""
        if not (self.tracker and self.model and self.version):
            return
        from kiln.pipeline.model_registry import promote

        client = self.tracker.client
        if status == "promoted":  # remembers the champion it replaces, so `kiln rollback` can restore it
            promote(client, self.model, self.version)
        client.set_model_version_tag(self.model, self.version, "kiln.deploy", status)

    def _start_run(self) -> str | None:
        if not self.tracker:
            return None
        tags = {"kiln.stage": "canary", "kiln.model": self.model or "", "kiln.version": self.version or ""}
        run_id = self.tracker.start("canary", tags, parent=self.parent_run_id)
        self.tracker.log(run_id, params={"steps": json.dumps([s.model_dump() for s in self.deploy.steps]),
                                         "on_inconclusive": self.deploy.on_inconclusive,
                                         "gate": json.dumps(self.policy.model_dump(mode="json"))})
        return run_id

    def _log_step(self, record: StepRecord, parent: str | None, window: Observations) -> str | None:
        if not (self.tracker and parent):
            return None
        t = self.tracker
        tags = {"kiln.stage": "canary-step", "kiln.weight": f"{record.weight:g}", "kiln.verdict": record.verdict,
                "kiln.action": record.action}
        run_id = t.start(f"canary-step-{record.index + 1}-{record.weight:g}pct", tags, parent=parent)
        metrics = {f"stable.{k}": v for k, v in record.stable.items()} | {f"canary.{k}": v for k, v in record.canary.items()}
        for c in record.checks:
            if c["observed"] is not None:
                metrics[f"check.{c['name']}.estimate"] = c["observed"]
            if c["ci"]:
                metrics[f"check.{c['name']}.cs_low"], metrics[f"check.{c['name']}.cs_high"] = c["ci"]
        t.log(run_id, metrics=metrics | {"seconds": record.seconds},
              params={"weight": record.weight, "reason": record.reason[:5000]})
        candidate, baseline = window.evidence()
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "evidence.json"
            atomic_write_json(path, jsonable({"step": asdict(record) | {"run_id": None},
                                              "candidate": asdict(candidate), "baseline": asdict(baseline)}))
            t.log_artifacts(run_id, path)
        t.end(run_id)
        return run_id


def _rollback_code(verdict: str) -> ExitCode:
    return {Verdict.FAILED.value: ExitCode.GATE_FAILED, Verdict.ERROR.value: ExitCode.INTERNAL_ERROR}.get(
        verdict, ExitCode.GATE_INCONCLUSIVE)


def run_canary(target: DeployTarget, policy: GateSection, deploy: DeployConfig, tracking_uri: str | None = None,
               experiment: str = "kiln", model: str | None = None, version: str | None = None,
               parent_run_id: str | None = None, log: Callable[[str], None] = print,
               state_path: Path | None = None) -> CanaryResult:
    """Walk a canary on `target` (already started) and return the outcome; see Controller."""
    tracker = None
    if tracking_uri is not None or model is not None:
        from kiln.pipeline.tracking import Tracker

        tracker = Tracker(tracking_uri, experiment)
    return Controller(target, policy, deploy, tracker, model, version, parent_run_id, log,
                      state_path=state_path).run()


def _alive_kiln(pid: int | None) -> bool:
    """A live process that is still ours (a kiln router or arm), not a reused pid."""
    try:
        return bool(pid) and b"kiln" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _running(pid: int) -> bool:
    """Not yet exited. An exiting process empties its cmdline before it becomes a zombie (or is
    reaped), so _alive_kiln turns False while it may still be tearing down: wait on its state."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def recover_crashed_walk(state_path: Path, api_key: str | None = None, log: Callable[[str], None] = print,
                         timeout_s: float = 60) -> bool:
    """Roll back a walk whose controller died mid-walk: all traffic to stable, then stop the
    processes it left (canary first, router and stable last, so stable serves until the end).
    True if there was one. A walk whose controller is still alive is refused."""
    if not state_path.exists():
        return False
    state = read_json(state_path)
    if state.get("status") != "walking":
        return False
    if _alive_kiln(state.get("controller_pid")) and state["controller_pid"] != os.getpid():
        raise KilnError(f"{state_path}: a canary walk is still running (controller pid {state['controller_pid']})")
    target, arms = state.get("target", {}), state.get("target", {}).get("arms", {})
    log(f"canary: the previous walk's controller died at step {state.get('step', 0) + 1} "
        f"({state.get('weight', 0):g}%); rolling it back")
    if target.get("router_url") and _alive_kiln(target.get("router_pid")):
        from kiln.deploy.config import RouterConfig
        from kiln.deploy.router_process import RouterProcess

        router = RouterProcess(RouterConfig(stable_url=arms["stable"]["url"]), api_key)
        router.url = target["router_url"]
        try:
            router.set_weight(0)
            router.set_backends(arms["stable"]["url"], None)
        except KilnError as e:
            log(f"canary: the old router did not take the rollback ({e}); stopping it")
    for name in ("canary", "router", "stable"):
        pid = target.get("router_pid") if name == "router" else arms.get(name, {}).get("pid")
        if _alive_kiln(pid):
            os.kill(pid, signal.SIGTERM)  # each drains what it is serving
            deadline = time.monotonic() + timeout_s
            while _running(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            if _running(pid):
                log(f"canary: the old {name} (pid {pid}) did not stop within {timeout_s:g} s; killing it")
                os.kill(pid, signal.SIGKILL)
    atomic_write_json(state_path, {**state, "status": "rolled_back", "reason": "controller died mid-walk; recovered"})
    return True
