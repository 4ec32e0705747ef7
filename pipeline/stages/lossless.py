"""The lossless stage: a candidate whose engine claims lossless output (speculative decoding) against
its plain twin, on every benchmark and served-text prompt (kiln.evaluate.quality.lossless).

It runs where the policy has a `lossless` check, in the last phase, after the served text. The twin
is not another candidate: this stage opens it from the candidate's own engine folder, with the
config `EngineConfig.plain_twin()` gives, once the candidate's engine is closed. A candidate without
a twin records that it has none, and the check shows it as not applicable.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kiln.core.files import hash_of
from kiln.core.gate.lossless import APPLIES, DIVERGENCE, MATCH
from kiln.pipeline.stages.inputs import LazyEngines, cached_prompts
from kiln.pipeline.stages.base import RunContext, run_stage


def checked(ctx: RunContext) -> bool:
    """Whether the policy this run is judged at has a lossless check."""
    return any(c.kind == "lossless" for c in (ctx.gate or ctx.recipe.gate).checks)


def lossless(ctx: RunContext, loaded: LazyEngines, engines: dict[str, Path]) -> None:
    """The candidate's answers against its plain twin's, or the record that it has no twin."""
    engine_dir = engines["candidate"]
    manifest, twin = plain_twin(engine_dir)
    inputs: dict[str, Any] = {"candidate": engine_dir.name,
                              "twin": None if twin is None else twin.model_dump(mode="json")}
    if twin is None:
        run_stage(ctx, "lossless", "candidate", inputs, lambda out: {"metrics": {APPLIES: 0.0}})
        return
    sets = prompt_sets(ctx, engines["baseline"])
    inputs["sets"] = [{"name": s.name, "prompts": hash_of(s.prompts), "new_tokens": s.new_tokens,
                       "concurrency": s.concurrency} for s in sets]

    def compute(out: Path) -> dict[str, Any]:
        from kiln.engine.loader import load_engine
        from kiln.evaluate.quality.lossless import candidate_answers, exactness

        loaded.keep_only("candidate")
        got = candidate_answers(loaded["candidate"], lambda: load_engine(engine_dir), manifest["source"]["path"],
                                sets, lambda: loaded.release("candidate"))
        plain = open_twin(engine_dir, manifest, twin)
        try:
            res = exactness(plain, sets, got)
        finally:
            plain.close()
        res.write(out)
        return {"metrics": res.metrics, "samples": {"file": "lossless.jsonl", "columns": [MATCH, DIVERGENCE]}}

    run_stage(ctx, "lossless", "candidate", inputs, compute)


def prompt_sets(ctx: RunContext, baseline_dir: Path) -> list[Any]:
    """The prompts the candidate answers in this run: the decode benchmark's (one at a time) and,
    where the recipe serves text, the served check's with its shortest prompts (under load)."""
    from kiln.evaluate.parity import with_shortest
    from kiln.evaluate.quality.lossless import PromptSet
    from kiln.pipeline.stages.inputs import tokenizer_of

    ev = ctx.recipe.evaluate
    b, served = ev.benchmark, ev.quality.served
    sets = [PromptSet("benchmark", cached_prompts(ctx, baseline_dir, b.prompts, b.num_prompts), b.max_new_tokens)]
    if served:
        prompts = cached_prompts(ctx, baseline_dir, b.prompts, served.num_prompts,
                                 "evaluate.quality.served.num_prompts")
        sets.append(PromptSet("served", with_shortest(prompts, tokenizer_of(baseline_dir)), served.max_new_tokens,
                              served.concurrency))
    return sets


def plain_twin(engine_dir: Path) -> tuple[dict[str, Any], Any]:
    """The engine folder's manifest and its plain twin's config (`EngineConfig.plain_twin`), None
    where the built config has no lever claiming lossless output."""
    from kiln.engine.loader import engine_config, read_manifest

    manifest = read_manifest(engine_dir)
    return manifest, engine_config(manifest).plain_twin()


def open_twin(engine_dir: Path, manifest: dict[str, Any], twin: Any) -> Any:
    """The engine in `engine_dir` loaded as its plain twin: the lever named off."""
    from kiln.engine.loader import load_engine

    return load_engine(engine_dir, **twin_options(twin, manifest["config"]))


def twin_options(twin: Any, built: dict[str, Any]) -> dict[str, Any]:
    """The load options that turn the built config `built` into `twin`: its whole dump, and the fields
    the dump leaves out at their defaults (`exclude_if`: speculative None) named too, or the
    manifest's value of them (the lever itself) would stay."""
    dumped = twin.model_dump(mode="json")
    return {**{k: getattr(twin, k) for k in built if k not in dumped}, **dumped}
