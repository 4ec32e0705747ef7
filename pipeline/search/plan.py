"""A search's plan, printed before its first stage: each candidate, the stages it will run and those
it will reuse from the cache, and about how long it will take.

The time comes from what this machine measured: each stage's `wall_s` on the MLflow runs of this
recipe's earlier attempts (a finished run, or one that was interrupted), the same candidate's where
there is one, else the same stage's for another candidate. A stage this recipe never ran here is
"unknown", said so, never guessed. A stage is expected to be reused when an earlier attempt of the
same candidate configuration (its recipe digest) finished it and its folder is still in the cache.
The figure is a ceiling: a candidate that fails a cheap check skips its later stages.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from kiln.core.progress import duration
from kiln.pipeline.stages.phases import PHASES
from kiln.pipeline.provenance.evidence import ROLES
from kiln.pipeline.stages.base import RESULT, RunContext
from kiln.pipeline.stages.evaluate import enabled
from kiln.pipeline.tracking.runs import CANDIDATE_TAG, STAGE_KEY

SHARED = "baseline"  # the row of the stages every candidate shares: the checkpoint's own build and scores


@dataclass
class Planned:
    """One stage of one candidate (or of the shared baseline): reused, or to run in about `seconds`."""

    stage: str
    role: str
    reused: bool = False
    seconds: float | None = None  # None: never measured here


@dataclass
class ArmPlan:
    name: str
    stages: list[Planned] = field(default_factory=list)

    def to_run(self) -> list[Planned]:
        return [s for s in self.stages if not s.reused]


def stages_of(recipe: Any) -> list[tuple[str, str]]:
    """(stage, role) a candidate of `recipe` runs through the phases, in order, its own and the
    baseline's (which the first candidate computes and the others reuse): the build, then each phase's
    quality evals as the evaluate stage runs them (`enabled`: the registry's order), the decode
    benchmark with the speed phase and the load stage last."""
    by_phase = {"build": [("optimize", "baseline"), ("optimize", "candidate"), ("engine", "baseline"),
                          ("engine", "candidate")]}
    for phase in PHASES[1:]:
        evals = enabled(recipe.evaluate.quality, phase)
        by_phase[phase] = [(e.stage, role) for e in evals for role in (("candidate",) if e.pair else ROLES)]
    by_phase["speed"].append(("benchmark", "pair"))
    by_phase["rest"] += [("load", "pair")] if recipe.evaluate.load else []
    return [s for phase in PHASES for s in by_phase[phase]]


def history(ctx: RunContext) -> list[Any]:
    """The finished stage runs of this recipe's earlier attempts on the tracking store, newest first."""
    return ctx.tracker.client.search_runs(
        [ctx.tracker.experiment_id],
        f"tags.`kiln.recipe` = '{ctx.recipe.name}' and attributes.status = 'FINISHED'",
        max_results=5000, order_by=["attributes.start_time DESC"])


def plan(ctx: RunContext, arms: list[tuple[str, Any]], runs: list[Any]) -> list[ArmPlan]:
    """The plan of a search over `arms` ((name, candidate's recipe)), from the stage runs `runs`."""
    done: dict[tuple[str, str, str, str], list[str]] = {}  # (digest, arm, stage, role) -> stage keys
    walls: dict[tuple[str, str, str], list[float]] = {}  # (arm, stage, role) -> seconds, newest first
    for r in runs:
        tags, wall = r.data.tags, r.data.metrics.get("wall_s")
        where = (tags.get(CANDIDATE_TAG, ""), tags.get("kiln.stage", ""), tags.get("kiln.role", ""))
        if tags.get(STAGE_KEY):
            done.setdefault((tags.get("kiln.recipe_hash", ""), *where), []).append(tags[STAGE_KEY])
        if wall is not None:
            walls.setdefault(where, []).append(wall)
    shared, plans = ArmPlan(SHARED), []
    for name, recipe in arms:
        mine = ArmPlan(name)
        for stage, role in stages_of(recipe):
            if role == "baseline" and any(s.stage == stage for s in shared.stages):
                continue  # the first candidate computes the baseline's; the others reuse it
            keys = done.get((recipe.digest(), name, stage, role), [])
            reused = not _fresh(ctx, stage) and any((ctx.cache / "stages" / stage / k / RESULT).exists() for k in keys)
            (shared if role == "baseline" else mine).stages.append(
                Planned(stage, role, reused, _seconds(walls, name, stage, role)))
        plans.append(mine)
    return [shared, *plans]


def _fresh(ctx: RunContext, stage: str) -> bool:
    return stage in ctx.fresh or "all" in ctx.fresh


def _seconds(walls: dict[tuple[str, str, str], list[float]], arm: str, stage: str, role: str) -> float | None:
    """The candidate's own last time for the stage, else the median of the others' last times."""
    if walls.get((arm, stage, role)):
        return walls[(arm, stage, role)][0]
    others = [w[0] for (a, s, r), w in walls.items() if (s, r) == (stage, role) and w]
    return statistics.median(others) if others else None


def lines(plans: list[ArmPlan], confirm: Planned | None) -> list[str]:
    """The plan as the console prints it: a line per row, then the total."""
    out = []
    for p in plans:
        run = ", ".join(f"{s.stage}[{s.role}] {_time(s.seconds)}" for s in p.to_run()) or "nothing"
        reused = [f"{s.stage}[{s.role}]" for s in p.stages if s.reused]
        out.append(f"  {p.name}: to run: {run}" + (f"; reused from the cache: {', '.join(reused)}" if reused else ""))
    if confirm is not None:
        out.append(f"  then the winner's confirmation {confirm.stage} {_time(confirm.seconds)}")
    todo = [s for p in plans for s in p.to_run()] + ([confirm] if confirm else [])
    known = sum(s.seconds for s in todo if s.seconds is not None)
    unknown = sum(s.seconds is None for s in todo)
    reused = sum(s.reused for p in plans for s in p.stages)
    if not todo:
        estimate = "nothing to compute"
    elif unknown == len(todo):
        estimate = "time unknown: this recipe has not run here before"
    else:
        estimate = f"about {duration(known)}" + (f" plus {_count(unknown, 'stage')} never timed here" if unknown else "") \
            + " if every candidate reaches every stage"
    out.append(f"  {_count(len(todo), 'stage')} to run, {reused} reused; {estimate}")
    return out


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def _time(seconds: float | None) -> str:
    return "(~?)" if seconds is None else f"(~{duration(seconds)})"


def show(ctx: RunContext, arms: list[tuple[str, Any]]) -> list[ArmPlan]:
    """Print the search's plan on the run's console (and its log); returns it."""
    import logging

    plans = plan(ctx, arms, history(ctx))
    bench = [s for p in plans for s in p.stages if (s.stage, s.role) == ("benchmark", "pair") and s.seconds is not None]
    confirm = Planned("benchmark", "pair", seconds=max(s.seconds for s in bench) if bench else None) \
        if len(arms) > 1 else None
    ctx.console.print("[bold]plan[/bold]: each candidate's stages (times measured here on this recipe's earlier runs)")
    for line in lines(plans, confirm):
        ctx.console.print(line, markup=False, soft_wrap=True)
        logging.getLogger("kiln").info("plan %s", line.strip())
    return plans
