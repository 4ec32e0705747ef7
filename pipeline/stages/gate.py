"""The gate stage: the run's verdict on its evidence, written and logged, with the data it was measured on."""

from __future__ import annotations

from typing import Any

from kiln.core.files import atomic_write_json
from kiln.core.gate.base import Evidence
from kiln.core.gate.policy import GateOutcome, judge
from kiln.pipeline.provenance.evidence import evidence_from_run
from kiln.pipeline.stages.outcomes import Ending, conclude
from kiln.pipeline.stages.inputs import prompts_path, read_prompts, text_path
from kiln.pipeline.stages.base import RunContext, run_tags


def gate(ctx: RunContext, policy: Any = None, results: list[Any] | None = None, ending: Any = None,
         subject: str = "the candidate", detail: str = "") -> tuple[GateOutcome, dict[str, Evidence]]:
    """The run's outcome: the recipe's gate (a search passes its family-corrected policy) on the
    run's evidence, or the `results` a search assembled for its subject, ended as `ending` says
    (kiln.pipeline.stages.outcomes, the one table of endings)."""
    evidence = evidence_from_run(ctx.run_dir)
    policy = policy or ctx.recipe.gate
    if results is None:
        results = judge(policy, evidence["candidate"], evidence["baseline"]).results
    outcome = conclude(results, policy.on_inconclusive, ending or Ending.JUDGED, subject, detail)
    run_id = ctx.tracker.start("gate", {"kiln.stage": "gate", "kiln.role": "candidate", **run_tags(ctx),
                                        "kiln.verdict": outcome.verdict.value}, parent=ctx.parent_run)
    atomic_write_json(ctx.run_dir / "verdict.json", outcome.to_dict())
    ctx.tracker.log(run_id, tags={f"kiln.check.{r.name}": r.verdict.value for r in outcome.results},
                    metrics={f"{r.name}.observed": r.observed for r in outcome.results if r.observed is not None})
    ctx.tracker.log_artifacts(run_id, ctx.run_dir / "verdict.json")
    ctx.tracker.end(run_id)
    log_evaluation_data(ctx)
    return outcome, evidence


def log_evaluation_data(ctx: RunContext) -> None:
    """The texts the verdict was measured on, as the parent run's inputs (MLflow's Dataset column)."""
    ev = ctx.recipe.evaluate
    text = text_path(ev.quality.perplexity.text)
    ctx.tracker.log_data(ctx.parent_run, "perplexity", text, "text", [t for t in text.read_text().splitlines() if t.strip()])
    prompts = prompts_path(ev.benchmark.prompts)
    ctx.tracker.log_data(ctx.parent_run, "benchmark", prompts, "prompt", read_prompts(str(prompts), ev.benchmark.num_prompts))
