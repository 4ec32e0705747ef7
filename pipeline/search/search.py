"""The search: every candidate serving configuration judged against one baseline, one winner.

Picking the best of N candidates, each tested at level alpha, lets a bad one through far more
often than alpha: with five candidates all sitting exactly at a quality margin, each passes
about alpha of the time, and the search promotes one whenever any passes. The search therefore
judges every candidate at the family's confidence (Bonferroni: each check's error rate divided
by the number of candidates judged), so the chance that it promotes any candidate that is really
worse than a margin stays at most the single-candidate rate. The winner's speed is the maximum
of N noisy measurements, biased upward; it is measured again, fresh, before the verdict.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from kiln.core.errors import BadInput, ExitCode, KilnError
from kiln.core.files import atomic_write_json, read_json, sha256_tree
from kiln.core.gate.base import CheckResult, Evidence, Verdict
from kiln.core.gate.performance import t_interval
from kiln.core.gate.policy import GateOutcome, GateSection, judge
from kiln.core.metrics import METRICS
from kiln.core.units import ratio
from kiln.optimize.base import QUANTIZERS, ModelArtifact
from kiln.pipeline.search import plan as search_plan
from kiln.pipeline.stages import benchmark as stage_benchmark
from kiln.pipeline.stages import evaluate as stage_evaluate
from kiln.pipeline.stages import inputs as stage_inputs
from kiln.pipeline.stages import optimize as stage_optimize
from kiln.pipeline.provenance.evidence import evidence_from_run
from kiln.pipeline.search.executor import CONFIRM, Executor, LocalExecutor
from kiln.pipeline.stages.phases import PHASES, for_family, objective_phase, up_to
from kiln.pipeline.stages.base import RunContext, run_stage, run_tags
from kiln.pipeline.tracking.runs import CANDIDATE_TAG


class NothingBuilt(KilnError):
    """Every candidate's build was refused (it does not fit, its engine failed the parity check):
    the gate fails (exit 1), with each candidate's reason."""

    exit_code = ExitCode.GATE_FAILED


class NotJudged(KilnError):
    """The search budget ran out before any candidate could be built: nothing was judged (exit 3)."""

    exit_code = ExitCode.GATE_INCONCLUSIVE


@dataclass
class Arm:
    """One candidate in the search: its own run folder (stages/ as a single-candidate run lays it
    out), its MLflow child run, and where it stands."""

    name: str
    ctx: RunContext
    mlflow_run: str
    artifact: ModelArtifact | None = None
    engines: dict[str, Path] = field(default_factory=dict)
    nodes: dict[str, str | None] = field(default_factory=dict)  # timed stage -> the node its figures came from (ray)
    outcome: GateOutcome | None = None
    eliminated: str | None = None  # why it stopped, in the report's words
    budget: bool = False  # the search budget stopped it before it was judged
    reached: str = ""  # the last phase it ran
    screened: dict[str, float] | None = None  # objective speed-up before the confirmation
    confirmed: dict[str, float] | None = None
    runoff: dict[str, Any] | None = None  # its speed-up over the leader it met, paired at one moment (`_runoff`)
    champion: Champion | None = None  # served from the registry's champion version
    versus_champion: CheckResult | None = None  # the winner against the champion, paired (`_duel`)


@dataclass(frozen=True)
class Champion:
    """The registry's champion version: how it is served, and where its artifact is."""

    name: str
    version: str
    sha256: str
    source: str
    serving: dict[str, Any]
    verified: Any = None  # its signed verdict (kiln.core.signing.Verified), checked against the store's bytes


def find_champion(ctx: RunContext) -> Champion | None:
    """The champion of the recipe's registered model, if the recipe lists it and one is recorded.
    A version registered before kiln recorded serving configurations cannot be served as judged:
    it is left out, and the run says so."""
    if not any(c.champion for c in ctx.recipe.candidates or []):
        return None
    from kiln.pipeline.tracking.registry import ARTIFACT_SHA, CHAMPION, SERVING, registered_name

    client, name = ctx.tracker.client, registered_name(ctx.recipe)
    try:
        mv = client.get_model_version_by_alias(name, CHAMPION)
    except Exception:  # noqa: BLE001 - MLflow raises its own types for "no such model" and "no such alias"
        mv = None
    if mv is None or SERVING not in mv.tags or ARTIFACT_SHA not in mv.tags:
        why = "it has no champion yet" if mv is None else f"v{mv.version} has no recorded serving configuration"
        ctx.console.print(f"[yellow]search[/yellow]: the champion candidate is left out: registered model "
                          f"'{name}': {why}", markup=True)
        return None
    from kiln.pipeline.tracking.registry import verify_version

    # The bar the winner must beat is the version as it was judged: a champion whose verdict does not verify
    # (or whose bytes changed in the store) ends the run (exit 5), rather than leave the bar to whoever set it.
    verified = verify_version(client, name, str(mv.version), pinned_only=False)
    return Champion(name, str(mv.version), mv.tags[ARTIFACT_SHA], client.get_model_version_download_uri(name, mv.version),
                    json.loads(mv.tags[SERVING]), verified)


def speedup(evidence: dict[str, Evidence], objective: str, confidence: float) -> dict[str, float] | None:
    """The candidate's speed-up over the baseline on `objective`: the geometric mean of the paired
    per-repeat ratios with its t-interval at `confidence`, the one the verdict is taken at
    (ttft_ms inverted, so higher is always better)."""
    cand = np.asarray(evidence["candidate"].repeats.get(objective, []), dtype=float)
    base = np.asarray(evidence["baseline"].repeats.get(objective, []), dtype=float)
    n = min(len(cand), len(base))
    if n < 2:
        return None
    if (cand[:n] <= 0).any() or (base[:n] <= 0).any():  # e.g. no request met the SLO in a repeat: no ratio
        return None
    log_ratio = np.log(cand[:n] / base[:n]) * (1 if METRICS[objective].higher_is_better else -1)
    mean, lo, hi = (math.exp(v) for v in t_interval(log_ratio, confidence))
    return {"ratio": mean, "low": lo, "high": hi, "pairs": n, "confidence": confidence}


# What each phase is called on the console, as a user reads it.
SAID = {"build": "its build", "quality": "perplexity", "agreement": "token agreement", "speed": "the decode benchmark",
        "rest": "the served text, lm-eval tasks and load stage"}


def run_search(ctx: RunContext, model: Any) -> tuple[Arm | None, list[Arm], GateSection]:
    """Every candidate through the phases, breadth first (all builds, then all cheap checks, …),
    each judged at the family's confidence; the winner's speed measured again, fresh."""
    started = time.monotonic()
    shared = stage_inputs.LazyEngines({}, _load)
    # Where each candidate's phase runs (search.executor); an unreachable cluster fails here, before any work.
    executor = _executor(ctx, lambda arm, phase: _run_phase(arm, phase, model, shared))
    try:
        recipe, arms, policy = _arms(ctx)
        search_plan.show(ctx, [(a.name, a.ctx.recipe) for a in arms])  # what will run, what is reused, how long
        for phase in PHASES:
            jobs = []
            for arm in (a for a in arms if a.eliminated is None):
                if recipe.search.budget_s is not None and time.monotonic() - started > recipe.search.budget_s:
                    arm.eliminated = f"the search budget ({recipe.search.budget_s:g} s) ran out before its {phase} stages"
                    arm.budget = True
                    continue
                jobs.append((arm, executor.start(arm, phase)))  # local: it runs now; ray: side by side
            for arm, job in jobs:
                executor.finish(arm, job)
                _screen(arm, phase, policy, recipe.search.objective)
                ctx.console.print(f"  {arm.name}: {arm.eliminated or f'passes every check up to {SAID[phase]}'}",
                                  markup=False)
        winner = _final(arms, shared, executor, policy)
        executor.bring_back(shown(arms, winner))  # the report registers its artifact
    finally:
        shared.close()
        executor.close()
    for arm in arms:
        _close_arm(ctx, arm, winner)
    return winner, arms, policy


def _executor(ctx: RunContext, run_here: Any) -> Executor:
    """The recipe's executor (kiln.pipeline.search.executor): this process, or a Ray cluster whose tasks call
    `run_on_node` (a module-level function: Ray sends it by name)."""
    if ctx.recipe.search.executor == "local":
        return LocalExecutor(run_here)
    from kiln.pipeline.search.ray_executor import RayExecutor

    return RayExecutor(ctx, run_on_node)


def _arms(ctx: RunContext) -> tuple[Any, list[Arm], GateSection]:
    """The recipe with the registry's champion in it (if it lists one), an arm per candidate, and
    the family's policy each is judged at."""
    champion = find_champion(ctx)
    recipe = ctx.recipe.with_champion(champion.serving if champion else None)
    views = recipe.arms()
    policy = for_family(recipe.gate, len(views))
    arms = [_arm(ctx, name, view, policy) for name, view in views]
    for arm in arms:
        if champion and any(c.champion and c.name == arm.name for c in ctx.recipe.candidates):
            arm.champion = champion
    ctx.console.print(f"[bold]search[/bold]: {len(arms)} candidates against the baseline, each judged at "
                      f"{policy.confidence:.2%} confidence (the family's {recipe.gate.confidence:.0%} shared by "
                      f"{len(arms)}), best {recipe.search.objective} among those that pass every check")
    return recipe, arms, policy


def _screen(arm: Arm, phase: str, policy: GateSection, objective: str) -> None:
    """The checks decided so far, once a candidate's phase ran: a candidate that does not pass
    them stops here (`arm.eliminated` says why)."""
    arm.reached = phase
    evidence = evidence_from_run(arm.ctx.run_dir) if arm.eliminated is None else None
    if phase == objective_phase(objective) and evidence:  # for every candidate that ran it
        arm.screened = speedup(evidence, objective, policy.confidence)
    if evidence and (partial := up_to(policy, phase)) is not None:
        arm.outcome = judge(partial, evidence["candidate"], evidence["baseline"])
        # Inconclusive stops a candidate unless the policy accepts it, as in a single run.
        # The champion is never stopped: it is the bar the winner must beat.
        if arm.outcome.exit_code is not ExitCode.PASSED and arm.champion is None:
            failed = [r.name for r in arm.outcome.results if r.verdict is not Verdict.SUCCESSFUL]
            arm.eliminated = f"{arm.outcome.verdict.value} after its {phase} stages: {', '.join(failed)}"
            bench = arm.ctx.outcomes.get("benchmark:pair")
            if phase == "speed" and bench and (cut := bench.result.get("stopped")):
                arm.eliminated += f" (benchmark stopped after round {cut['after_round']} of {cut['of']})"


def _final(arms: list[Arm], shared: Any, executor: Executor, policy: GateSection) -> Arm | None:
    """The fastest candidate that passed every check, measured again and, when the registry has a
    champion, set against it; None when none passed."""
    passing = [a for a in arms if a.eliminated is None and a.screened is not None and a.champion is None]
    winner = _runoff(passing, shared, policy) if passing else None
    if winner is not None and len(arms) > 1:
        _confirm(winner, executor, policy)
    held = next((a for a in arms if a.champion), None)
    if winner is not None and winner.eliminated is None and held is not None:
        _duel(winner, held, shared, policy)
    return winner


def _runoff(passing: list[Arm], shared: Any, policy: GateSection) -> Arm:
    """Which of the candidates that passed is fastest, from measurements taken at one moment.

    Each screening ratio is over the baseline as it ran at that candidate's own benchmark, minutes or
    reruns apart (a reused stage is from an earlier run), and this machine's speed, and each engine's
    share of it, moves between moments: at 135M llama.cpp ran 2x faster one evening than the torch
    baseline's stage had seen it, while OpenVINO's ratio was fresh (docs/engines.md). So the leader at
    screening meets every other candidate not shown slower there (its interval reaches the leader's),
    both engines interleaved in one fresh stage, and the rival leads on only where the paired ratio
    shows it faster (its interval above 1): where the interval holds 1 the two are not told apart and
    the leader stays, so noise does not move the pick from one run to the next. A
    candidate shown slower at screening is left out only where both screenings ran in this run, minutes
    apart, each over the baseline of its moment; one reused from an earlier run is from another hour.
    This only picks which candidate the verdict is taken on: the winner's confirmation against the
    baseline and every check are unchanged."""
    order = sorted(passing, key=lambda a: a.screened["ratio"], reverse=True)
    leader = order[0]
    for rival in order[1:]:
        if rival.screened["high"] < leader.screened["low"] and not (_reused(rival) or _reused(leader)):
            continue  # shown slower, both measured this run: nothing for a paired stage to decide
        engines = {"baseline": leader.engines["candidate"], "candidate": rival.engines["candidate"]}
        if not all(p.exists() for p in engines.values()):  # built on different Ray nodes: no process holds both
            leader.ctx.console.print(f"[yellow]runoff[/yellow]: {rival.name} against {leader.name} not run: their "
                                     "engines are not both on this machine; picked by screening")
            continue
        paired = _paired(rival, f"runoff-{leader.name}", engines, shared, policy,
                         f"[bold]runoff[/bold]: {rival.name} against {leader.name}", held_out=False)
        fig = speedup(paired, rival.ctx.recipe.search.objective, policy.confidence)
        rival.runoff = None if fig is None else {"against": leader.name, **fig}
        if fig is not None and fig["low"] > 1:  # shown faster; an interval holding 1 is a tie
            leader = rival
    return leader


def _reused(arm: Arm) -> bool:
    """Whether the stage `arm.screened` came from (its decode benchmark, or load stage) was reused from
    an earlier run rather than measured by this one."""
    stage = "load" if objective_phase(arm.ctx.recipe.search.objective) == "rest" else "benchmark"
    pointer = arm.ctx.run_dir / "stages" / f"{stage}-pair.json"
    return not pointer.is_file() or bool(read_json(pointer).get("reused"))


def _paired(arm: Arm, folder: str, engines: dict[str, Path], shared: Any, policy: GateSection, say: str,
            held_out: bool) -> dict[str, Evidence]:
    """`engines` (roles "baseline" and "candidate") side by side in a stage under `arm`'s run folder
    that this run measures afresh: the objective's decode benchmark, or load stage, interleaved, on
    the confirmation's held-out prompts or (`held_out` False) the screening's; its evidence. The
    engines the search shares (the baseline) are released first: this stage holds these two alone."""
    objective = arm.ctx.recipe.search.objective
    run_dir = arm.ctx.run_dir / folder
    (run_dir / "stages").mkdir(parents=True, exist_ok=True)
    no_stops = policy.model_copy(update={"checks": []})  # the speed bounds are against the checkpoint, not here
    ctx = replace(arm.ctx, run_dir=run_dir, outcomes={}, gate=no_stops)
    load = objective_phase(objective) == "rest"
    ctx.console.print(f"{say}, {'load stage' if load else 'decode benchmark'} interleaved")
    for role in list(shared):
        shared.release(role)
    loaded = stage_inputs.LazyEngines(engines, _load)
    try:
        (stage_benchmark.load_stage if load else stage_benchmark.benchmark)(ctx, loaded, engines,
                                                                            confirmation=held_out, fresh=True)
    finally:
        for role in list(loaded):
            loaded.pop(role).close()
    return evidence_from_run(run_dir)


def _arm(ctx: RunContext, name: str, view: Any, policy: GateSection) -> Arm:
    tags = {"kiln.stage": "candidate", CANDIDATE_TAG: name, **run_tags(ctx)}
    run_id = ctx.tracker.start(f"candidate {name}", tags, parent=ctx.parent_run)
    folder = ctx.run_dir / "candidates" / name
    (folder / "stages").mkdir(parents=True)
    sub = replace(ctx, recipe=view, run_dir=folder, parent_run=run_id, outcomes={}, arm=name, gate=policy)
    return Arm(name, sub, run_id)


def _load(engine_dir: Path) -> Any:
    from kiln.engine.loader import load_engine

    return load_engine(engine_dir)


def _run_phase(arm: Arm, phase: str, model: Any, shared: Any) -> None:
    """One phase of one candidate; a build the candidate cannot get (it does not fit, its engine
    refuses the parity check) eliminates it, not the search."""

    ctx = arm.ctx
    if phase == "build":
        try:
            arts = stage_optimize.optimize_both(ctx, model) if arm.champion is None else {
                "baseline": stage_optimize.quantize(ctx, "baseline", QUANTIZERS.config("none")(), model),
                "candidate": champion_artifact(ctx, arm.champion)}
            arm.engines = {role: stage_optimize.engine(ctx, role, art) for role, art in arts.items()}
            arm.artifact = arts["candidate"]
        except BadInput:
            raise
        except KilnError as e:
            arm.eliminated = f"its build was refused: {e}"
        return
    with _engines(arm, shared) as loaded:
        if phase == CONFIRM:  # the winner's fresh, held-out measurement (`_confirm`)
            load = objective_phase(ctx.recipe.search.objective) == "rest"
            (stage_benchmark.load_stage if load else stage_benchmark.benchmark)(ctx, loaded, arm.engines, confirmation=True)
        else:
            stage_evaluate.evaluate(ctx, arm.engines, phases=(phase,), loaded=loaded)


def run_on_node(arm: Arm, phases: tuple[str, ...], model: Any) -> None:
    """A candidate's `phases` where a Ray task runs them (kiln.pipeline.search.ray_executor): the build
    first (reused where the node has it), each later phase only while the candidate stands."""
    shared = stage_inputs.LazyEngines({}, _load)
    try:
        for phase in phases:
            if arm.eliminated is None:
                _run_phase(arm, phase, model, shared)
    finally:
        shared.close()


def champion_artifact(ctx: RunContext, champion: Champion) -> ModelArtifact:
    """The champion's artifact, downloaded from the tracking server's store once (a stage keyed by
    its hash) and checked against the hash the registry recorded."""
    import mlflow.artifacts


    def compute(out: Path) -> dict[str, Any]:
        local = Path(mlflow.artifacts.download_artifacts(artifact_uri=champion.source, dst_path=str(out),
                                                         tracking_uri=ctx.tracker.uri))
        if local != out / "model":
            local.rename(out / "model")
        if champion.verified is not None:  # the bytes downloaded now are the ones its verdict judged
            from kiln.pipeline.provenance.attestation import MODEL, check_files

            check_files(champion.verified, out / "model", MODEL, f"{champion.name} v{champion.version}")
        manifest = read_json(out / "model" / "kiln-artifact.json")
        (out / "model" / "kiln-artifact.json").unlink()
        got = sha256_tree(out / "model")
        if got != champion.sha256:
            raise KilnError(f"{champion.name} v{champion.version}: the artifact downloaded from {champion.source} "
                            f"hashes to {got[:12]}, not the {champion.sha256[:12]} the registry recorded")
        atomic_write_json(out / "model" / "kiln-artifact.json", manifest)
        return {"metrics": {"size_bytes": manifest["size_bytes"]}, "manifest": manifest}

    o = run_stage(ctx, "optimize", "candidate", {"champion": {"name": champion.name, "version": champion.version,
                                                              "sha256": champion.sha256}},
                  compute, artifacts=("model/kiln-artifact.json",), portable=False)
    return ModelArtifact(path=o.path / "model", manifest=o.result["manifest"])


@contextlib.contextmanager
def _engines(arm: Arm, shared: Any) -> Iterator[Any]:
    """The arm's engines for the stages: the one baseline engine all arms share, and its own,
    closed on the way out (one candidate in memory at a time; the baseline stays loaded until a
    stage that measures one arm alone releases it)."""

    shared.dirs["baseline"] = arm.engines["baseline"]
    loaded = _ArmEngines(arm.engines, shared)
    try:
        yield loaded
    finally:
        if "candidate" in loaded:
            loaded.release("candidate")


class _ArmEngines(stage_inputs.LazyEngines):
    """One arm's engines: its own, loaded here, and the baseline from `shared`, so releasing the
    baseline here releases it for every arm."""

    def __init__(self, engines: dict[str, Path], shared: Any):
        super().__init__(engines, _load)
        self.shared = shared

    def __missing__(self, role: str) -> Any:
        if role != "baseline":
            return super().__missing__(role)
        self[role] = self.shared[role]
        return self[role]

    def release(self, role: str) -> None:
        if role != "baseline":
            return super().release(role)
        self.pop(role)
        self.shared.release(role)


def _confirm(winner: Arm, executor: Executor, policy: GateSection) -> None:
    """The winner's decode benchmark again, as a new stage: the maximum of N screening measurements
    is biased upward; this one was not picked for being high. The verdict reads it."""

    load = objective_phase(winner.ctx.recipe.search.objective) == "rest"
    winner.ctx.console.print(f"[bold]confirm[/bold] {winner.name}: a fresh {'load stage' if load else 'decode benchmark'}"
                             ", the screening one was the best of several")
    executor.finish(winner, executor.start(winner, CONFIRM))
    evidence = evidence_from_run(winner.ctx.run_dir)
    winner.confirmed = speedup(evidence, winner.ctx.recipe.search.objective, policy.confidence)
    winner.outcome = judge(policy, evidence["candidate"], evidence["baseline"])
    if winner.outcome.exit_code is not ExitCode.PASSED:
        failed = [r.name for r in winner.outcome.results if r.verdict is not Verdict.SUCCESSFUL]
        winner.eliminated = f"{winner.outcome.verdict.value} on its confirmation benchmark: {', '.join(failed)}"


def _duel(winner: Arm, held: Arm, shared: Any, policy: GateSection) -> None:
    """The champion is the bar: the winner's objective against the champion's as it is served,
    paired and interleaved in a fresh stage of this run, at the family's confidence, and every
    quality check against the champion's records by that check's margin. Unless the winner is
    shown faster and no worse, the champion stays (`winner.eliminated` says why)."""

    champ = held.champion
    objective = winner.ctx.recipe.search.objective
    name = f"beats champion v{champ.version}"
    result = CheckResult(name=name, kind="champion", metric=objective, verdict=Verdict.ERROR, observed=None,
                         baseline=1.0, threshold="> 1, paired")
    if not held.engines:
        result.reason = f"the champion could not be served, so nothing shows the winner beats it: {held.eliminated}"
    else:
        engines = {"baseline": held.engines["candidate"], "candidate": winner.engines["candidate"]}
        paired = _paired(winner, "versus-champion", engines, shared, policy,
                         f"[bold]champion[/bold]: {winner.name} against {champ.name} v{champ.version}", held_out=True)
        result = _versus(paired, winner, held, policy, result)
    winner.versus_champion = result
    if result.verdict is not Verdict.SUCCESSFUL:
        winner.eliminated = f"the champion v{champ.version} stays: {result.reason}"


def _versus(paired: dict[str, Evidence], winner: Arm, held: Arm, policy: GateSection,
            result: CheckResult) -> CheckResult:
    """The verdict of the winner against the champion from the paired stage and both arms' quality records."""

    objective = winner.ctx.recipe.search.objective
    fig = speedup(paired, objective, policy.confidence)
    if fig is None:
        result.reason = "fewer than two paired measurements against the champion"
        return result
    result.observed, result.ci = fig["ratio"], (fig["low"], fig["high"])
    quality = [c for c in policy.checks if c.kind == "quality"]
    worse: list[str] = []
    if quality:
        mine, theirs = evidence_from_run(winner.ctx.run_dir), evidence_from_run(held.ctx.run_dir)
        judged = judge(policy.model_copy(update={"checks": quality}), mine["candidate"], theirs["candidate"])
        worse = [f"{r.name} ({r.verdict.value}: {r.reason})" for r in judged.results if r.verdict is not Verdict.SUCCESSFUL]
    at = f"{fig['ratio']:.3g}x [{fig['low']:.3g}, {fig['high']:.3g}] at {policy.confidence:.2%}"
    if fig["low"] <= 1:
        result.verdict = Verdict.FAILED
        result.reason = f"{objective} against the champion {at}: not shown faster"
    elif worse:
        result.verdict = Verdict.FAILED
        result.reason = f"{objective} {at}, but not shown no worse than the champion on " + "; ".join(worse)
    else:
        result.verdict = Verdict.SUCCESSFUL
        result.reason = f"{objective} against the champion {at}; quality no worse than the champion's by each margin"
    return result


def _close_arm(ctx: RunContext, arm: Arm, winner: Arm | None) -> None:
    status = "winner" if arm is winner and arm.eliminated is None else (
        "champion" if arm.champion else "eliminated" if arm.eliminated else "passed")
    tags = {"kiln.search": status, **({"kiln.eliminated": arm.eliminated[:4000]} if arm.eliminated else {}),
            **({"kiln.verdict": arm.outcome.verdict.value} if arm.outcome else {}),
            **{f"kiln.node.{stage}": node for stage, node in arm.nodes.items() if node}}
    figures = (("screening_speedup", arm.screened), ("confirmed_speedup", arm.confirmed), ("runoff_speedup", arm.runoff))
    metrics = {f"{k}.{part}": v for k, fig in figures if fig for part, v in fig.items() if isinstance(v, (int, float))}
    # The metrics keep full precision for sorting and charts; the tag beside each is what a person reads.
    tags |= {f"kiln.{k}": f"{ratio(fig['ratio'])} [{fig['low']:.3g}, {fig['high']:.3g}]" for k, fig in figures if fig}
    ctx.tracker.log(arm.mlflow_run, metrics=metrics, tags=tags)
    ctx.tracker.end(arm.mlflow_run)


def shown(arms: list[Arm], winner: Arm | None) -> Arm:
    """The arm the run's report is about: the winner, else the one that got furthest (ties: the
    faster at screening, then the recipe's order)."""
    if winner is not None:
        return winner
    built = [a for a in arms if a.engines]
    if not built:
        return arms[0]
    return max(built, key=lambda a: (PHASES.index(a.reached) if a.reached else -1,
                                     a.screened["ratio"] if a.screened else 0.0, -arms.index(a)))
