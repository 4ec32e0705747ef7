"""The memory plan of a recipe's arms: one line for the baseline and one per candidate, each with
every step a `kiln run` takes (quantize, serve, the parity reference, the engine, evaluate), as
`kiln plan-memory` prints it and as `kiln run` checks it before it loads anything."""

from __future__ import annotations

from typing import Any

from kiln.evaluate import parity
from kiln.optimize.memory import (
    SCORE_BATCH_TOKENS,
    MemoryPlan,
    check_arms,
    plan_memory,
    source_dtype,
    with_pipeline_steps,
)

Plans = dict[str, tuple[str, MemoryPlan]]


def arm_plans(recipe: Any, config: dict[str, Any], *, context: int, batch: int = 1, kv_dtype: str | None = None,
              available: int | None = None) -> tuple[Plans, dict[str, str]]:
    """(arm -> (what it is, its plan), arm -> where the recipe sets it) for `recipe` on the checkpoint
    whose config.json is `config`. A champion candidate is served as it was judged: not planned."""
    arms = recipe.arms()
    base_engine = _baseline_engine(recipe)

    def plan(method: Any, engine: Any, baseline: MemoryPlan | None = None) -> MemoryPlan:
        dtype = _torch_dtype(engine, config)
        compressed = {"int8": "int8", "fp32": "float32"}.get(getattr(engine, "weights", "")) \
            if engine.backend == "openvino" else None  # OpenVINO compresses the checkpoint as it builds
        p = plan_memory(config, method, context=context, batch=batch, kv_dtype=kv_dtype, available_bytes=available,
                        engine_dtype=dtype or compressed)
        return with_pipeline_steps(p, config, baseline, reference=_reference(method, engine, config),
                                   export_fp32=engine.backend == "openvino", torch_dtype=dtype,
                                   score_tokens=engine.model_dump().get("score_batch_tokens", SCORE_BATCH_TOKENS))

    base = plan(None, base_engine)
    plans = {"baseline": (f"none → {base_engine.backend}", base)}
    plans |= {name: (f"{arm.optimize.method} → {arm.engine.backend}", plan(arm.optimize, arm.engine, base))
              for name, arm in arms}
    fields = ({c.name: f"candidates.{i}" for i, c in enumerate(recipe.candidates)} if recipe.candidates is not None
              else {"candidate": "optimize"})
    return plans, fields


def run_context(recipe: Any) -> tuple[int, int]:
    """(context tokens, batch) a run's engines serve: the longest perplexity document or benchmark
    request, at the benchmark's largest batch."""
    ev = recipe.evaluate
    return max(ev.quality.perplexity.seq_len, 512 + ev.benchmark.max_new_tokens), max(ev.benchmark.batch_sizes)


def check_run(recipe: Any, config: dict[str, Any]) -> None:
    """Refuse a run, before it loads anything, when one of its arms does not fit in the memory free
    here (DoesNotFit: exit 2, every arm's numbers and the change that fits). A search whose candidates
    run on a Ray cluster is planned where they run, not here."""
    if recipe.candidates is not None and recipe.search.executor != "local":
        return
    context, batch = run_context(recipe)
    plans, fields = arm_plans(recipe, config, context=context, batch=batch)
    # An arm whose method needs a GPU this machine lacks is refused by its quantizer, which says so.
    plans = {name: arm for name, arm in plans.items() if arm[1].device == "cpu" or arm[1].available_bytes > 0}
    check_arms(plans, fields, first=first_change(recipe, config))


def first_change(recipe: Any, config: dict[str, Any]) -> str:
    """The change to make before any other when an arm does not fit: a torch baseline in float32 on a
    16-bit checkpoint holds it twice as large as it is published (and beside every candidate)."""
    base = _baseline_engine(recipe)
    stored = source_dtype(config)
    if _torch_dtype(base, config) != "float32" or stored == "float32":
        return ""
    where = "baseline.engine.dtype" if recipe.candidates is not None or recipe.baseline.engine else "engine.dtype"
    return (f"First: the baseline holds the checkpoint in float32, twice what it stores; {where}: {stored} "
            "serves it as it is published (then plan again). ")


def _baseline_engine(recipe: Any) -> Any:
    """The engine the baseline is served on (a search's default: torch, see Recipe.arms)."""
    arms = recipe.arms()
    return (arms[0][1] if arms else recipe).engine_for("baseline")


def _torch_dtype(engine: Any, config: dict[str, Any]) -> str | None:
    """What a torch engine loads the checkpoint in (auto: as stored); None for another backend."""
    dtype = getattr(engine, "dtype", None) if engine.backend == "torch" else None
    return source_dtype(config) if dtype == "auto" else dtype


def _reference(method: Any, engine: Any, config: dict[str, Any]) -> str | None:
    """The dtype the engine stage's parity reference loads the checkpoint in (kiln.evaluate.parity),
    or None where the engine is torch at that dtype, its own reference."""
    exact = parity.unquantized({"backend": engine.backend, "config": engine.model_dump(mode="json")},
                               getattr(method, "method", "none") != "none")
    dtype = parity.reference_dtype(exact, source_dtype(config))
    return None if _torch_dtype(engine, config) == dtype else dtype
