"""The evaluate stages in their phases: perplexity of each arm, token agreement between them, the
decode benchmark, then the lm-eval tasks, the served text, the lossless stage and the load stage.

The quality evals are plugins (kiln.evaluate.quality.base.QUALITY_EVALS) and this file names none of
them: each eval the recipe enables runs in its phase, in its own stage keyed on the engines' folders
and on what the eval says decides its results, reading the run's inputs through `StageInputs`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from kiln.core.files import hash_of
from kiln.evaluate.quality.base import QUALITY_EVALS, QualityEval, documents
from kiln.pipeline.demo.prepare import prepare_demo_data
from kiln.pipeline.stages.phases import PHASES
from kiln.pipeline.stages.benchmark import benchmark, load_stage, speculation_sweep
from kiln.pipeline.stages.inputs import LazyEngines, cached_prompts, text_path, token_ids
from kiln.pipeline.stages.lossless import checked as lossless_checked, lossless
from kiln.pipeline.stages.base import RunContext, run_stage

EVALUATE_PHASES = PHASES[1:]  # every phase but the build, which is the optimize and engine stages


def evaluate(ctx: RunContext, engines: dict[str, Path], phases: tuple[str, ...] = EVALUATE_PHASES,
             loaded: LazyEngines | None = None) -> None:
    """Perplexity of each arm (quality), token agreement between them (agreement), the interleaved
    decode benchmark (speed), then the evals of the last phase (lm-eval tasks, served text), the
    lossless stage and speculation sweep, and load over HTTP (rest): the cheap checks first, so a
    search stops a candidate that failed one before its expensive stages."""
    from kiln.engine.loader import load_engine

    own = loaded is None
    loaded = LazyEngines(engines, load_engine) if loaded is None else loaded
    given = StageInputs(ctx, engines, loaded)
    for phase in (p for p in EVALUATE_PHASES if p in phases):
        for plugin in enabled(ctx.recipe.evaluate.quality, phase):
            run_eval(ctx, plugin, given)
        if phase == "speed":
            benchmark(ctx, loaded, engines)
        if phase == "rest":
            if lossless_checked(ctx):  # speculative decoding's text against its plain twin's, after both answered
                lossless(ctx, loaded, engines)
            speculation_sweep(ctx, loaded, engines)  # a speculating candidate: where it stops beating its plain twin
            if ctx.recipe.evaluate.load:
                load_stage(ctx, loaded, engines)
    if own:
        loaded.close()


def enabled(quality: Any, phase: str) -> list[QualityEval]:
    """The evals of `phase` whose sections `quality` (the recipe's evaluate.quality) sets, in registration
    order, each built from its section's value."""
    plugins = [(QUALITY_EVALS.get(name), getattr(quality, name)) for name in QUALITY_EVALS.names()]
    return [cls(config) for cls, config in plugins if cls.phase == phase and config not in (None, False)]


def run_eval(ctx: RunContext, plugin: QualityEval, given: StageInputs) -> None:
    """`plugin`'s stage: once for the pair (role candidate), or once per arm with that arm's engine
    alone loaded from the stage's start (the next stage that needs both loads the other again)."""
    own = plugin.inputs(given)
    if plugin.pair:
        arms = {"baseline": given.dirs["baseline"].name, "candidate": given.dirs["candidate"].name}
        run_stage(ctx, plugin.stage, "candidate", {**arms, **own}, lambda out: plugin.run(given, "candidate", out))
        return
    for role in given.dirs:
        given.engines.keep_only(role)
        run_stage(ctx, plugin.stage, role, {"engine": given.dirs[role].name, **own},
                  lambda out, role=role: plugin.run(given, role, out))


class StageInputs:
    """What the quality evals read (kiln.evaluate.quality.base.EvalInputs), each read on first ask and
    kept for the evaluate call: token ids through the run's cache, keyed by the baseline's tokenizer."""

    def __init__(self, ctx: RunContext, dirs: dict[str, Path], engines: LazyEngines):
        self.ctx, self.dirs, self.engines = ctx, dirs, engines
        self._kept: dict[Any, Any] = {}

    def _once(self, key: Any, read: Callable[[], Any]) -> Any:
        if key not in self._kept:
            self._kept[key] = read()
        return self._kept[key]

    def documents(self) -> tuple[list[list[int]], dict[str, Any]]:
        return self._once("documents", self._documents)

    def _documents(self) -> tuple[list[list[int]], dict[str, Any]]:
        q = self.ctx.recipe.evaluate.quality.perplexity
        text = text_path(q.text).read_text()
        docs = token_ids(self.ctx, self.dirs["baseline"],
                         {"documents": hash_of(text), "seq_len": q.seq_len, "max_documents": q.max_documents},
                         lambda tok: documents(tok, text, q.seq_len, q.max_documents))
        return docs, {"text": q.text, "docs_hash": hash_of(docs)}

    def prompts(self, n: int, count_field: str) -> list[list[int]]:
        spec = self.ctx.recipe.evaluate.benchmark.prompts
        return self._once(("prompts", n), lambda: cached_prompts(self.ctx, self.dirs["baseline"], spec, n, count_field))

    def task_data(self) -> Any:
        return self._once("task data", prepare_demo_data)
