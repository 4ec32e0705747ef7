"""The canary controller behind `kiln deploy`: walk the recipe's traffic steps, judge canary vs
stable on live data with the gate policy at every look, then promote or roll back by itself.

Per step (weight w, min_requests, max_duration_s): set the canary to w percent, then every
`poll_s` read the new observations, feed the live gate (live_gate.py: one always-valid sequential
test per check, for the whole walk) and act:
- any check Failed            -> weight 0, roll back (exit 1) - at any look, without waiting;
- all Successful and the step saw min_requests canary requests -> next step;
- max_duration_s passed first -> Inconclusive: `deploy.on_inconclusive` holds (stop walking,
  traffic stays where it is, exit 3) or rolls back (exit 3); if the gate policy itself says
  `on_inconclusive: pass`, the step advances instead, but only on enough data: a step that saw
  fewer than min_requests canary requests, or a live check still short of its observations
  (`CheckResult.insufficient`), holds or rolls back whatever the policy says.
Successful at the last step -> promote: the target makes the canary the stable arm and the
journal settles the version (with MLflow: the registry alias `champion` moves to the candidate's
version). Rollback leaves `champion` where it was and tags the version `kiln.deploy=rolled_back`.

A target that fails mid-walk (the local router died and was restarted with stable only, an
unreachable router) ends the walk rolled back (exit 4), never with stable torn down. The walk's
state (step, weight, the target's urls and process ids) is written atomically to `state_path` at
every change, so a controller that crashed can be cleaned up after (`recover_crashed_walk`).

Every step is reported to the walk's journal (journal.py) with its evidence: per-arm summaries
and every check's estimate and confidence sequence. The orchestrator's MLflow journal makes it a
child run (tags kiln.stage=canary-step, kiln.weight, kiln.verdict); with no journal nothing is
recorded.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kiln.deploy.base import DeployTarget, Observations
from kiln.deploy.config import CanaryStep, DeployConfig, RouterConfig
from kiln.deploy.journal import CanaryJournal, CanaryResult, StepRecord
from kiln.deploy.live_gate import LiveGate
from kiln.deploy.router_process import RouterProcess
from kiln.core.stats import Verdict, jsonable
from kiln.core.errors import ExitCode, KilnError
from kiln.core.files import atomic_write_json, read_json
from kiln.core.gate.policy import GateOutcome, GateSection, combine

__all__ = ["CanaryResult", "Controller", "StepRecord", "recover_crashed_walk", "run_canary"]


class Controller:
    """Walks one canary. `journal` records the walk and settles the version's outcome (records
    nothing by default; kiln.pipeline.tracking.canary_journal.MlflowJournal records to MLflow)."""

    def __init__(self, target: DeployTarget, policy: GateSection, deploy: DeployConfig,
                 journal: CanaryJournal | None = None, log: Callable[[str], None] = print,
                 sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic,
                 state_path: Path | None = None):
        self.target, self.policy, self.deploy = target, policy, deploy
        self.journal = journal or CanaryJournal()
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
        self.journal.resolve()
        run_id = self.journal.start(self.deploy, self.policy)
        result = CanaryResult("rolled_back", ExitCode.INTERNAL_ERROR, "interrupted", skipped_checks=self.gate.skipped,
                              model=self.journal.model, version=self.journal.version, run_id=run_id)
        for s in self.gate.skipped:
            self.log(f"canary: check {s['check']} not judged live: {s['reason']}")
        try:
            self.cursor = self.target.observe((0, 0)).cursor  # what came before the walk does not count
            for i, step in enumerate(self.deploy.steps):
                self._save("walking", step=i, weight=step.weight)
                record = self._step(i, step, last=i == len(self.deploy.steps) - 1)
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
            self._finish(result)
        return result

    def _step(self, index: int, step: CanaryStep, last: bool) -> StepRecord:
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
        record.run_id = self.journal.step(record, window)
        self.log(f"canary: step {index + 1}: {outcome.verdict.value} -> {action}: {reason}")
        return record

    def _decide(self, outcome: GateOutcome, n_canary: int, step: CanaryStep, elapsed: float,
                last: bool) -> tuple[str | None, str]:
        """What to do after this look; (None, _) means keep looking."""
        verdict = outcome.verdict
        failing = [f"{r.name}: {r.reason}" for r in outcome.results if r.verdict in (Verdict.FAILED, Verdict.ERROR)]
        if verdict in (Verdict.FAILED, Verdict.ERROR):
            return "rollback", "; ".join(failing)
        enough = n_canary >= step.min_requests  # below it a step never passes, whatever the policy says
        passed = verdict == Verdict.SUCCESSFUL and enough
        if not passed and elapsed < step.max_duration_s:
            return None, ""
        waived = enough and combine(outcome.results, self.policy.on_inconclusive)[1] is ExitCode.PASSED
        if not passed and not waived:
            undecided = [r.name for r in outcome.results if r.verdict != Verdict.SUCCESSFUL]
            why = (f"after {elapsed:.0f} s: {n_canary}/{step.min_requests} canary requests; "
                   f"undecided: {', '.join(undecided) or 'none'}")
            if self.policy.on_inconclusive == "pass":
                why += " (too little data, which the gate's `on_inconclusive: pass` does not accept)"
            return self.deploy.on_inconclusive, why
        return ("promote" if last else "advance"), f"{n_canary} canary requests, every live check {verdict.value}"

    # --- effects: the target, the journal --------------------------------------------------------
    def _finish(self, result: CanaryResult) -> None:
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
        self.journal.settle(result.status)
        self.journal.finish(result)
        self.log(f"canary: {result.status}: {result.reason}")


def _rollback_code(verdict: str) -> ExitCode:
    return {Verdict.FAILED.value: ExitCode.GATE_FAILED, Verdict.ERROR.value: ExitCode.INTERNAL_ERROR}.get(
        verdict, ExitCode.GATE_INCONCLUSIVE)


def run_canary(target: DeployTarget, policy: GateSection, deploy: DeployConfig, journal: CanaryJournal | None = None,
               log: Callable[[str], None] = print, state_path: Path | None = None) -> CanaryResult:
    """Walk a canary on `target` (already started) and return the outcome; see Controller."""
    return Controller(target, policy, deploy, journal, log, state_path=state_path).run()


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
