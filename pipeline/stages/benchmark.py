"""The speed stages: the interleaved decode benchmark (which stops once a speed check has Failed) and the
load stage over HTTP, each also as a search's fresh confirmation of its winner."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kiln.core.files import atomic_write_json, hash_of
from kiln.core.gate.base import Evidence, Verdict
from kiln.core.gate.policy import judge
from kiln.pipeline.stages.load import measure
from kiln.pipeline.stages.phases import for_family, phase_of
from kiln.pipeline.stages.inputs import CONFIRMATION_PROMPTS, LazyEngines, cached_prompts
from kiln.pipeline.stages.base import RunContext, run_stage


def benchmark(ctx: RunContext, loaded: LazyEngines, engines: dict[str, Path], confirmation: bool = False,
              fresh: bool = False) -> None:
    """The interleaved decode benchmark. `confirmation`: a second, fresh measurement of a search's
    winner (its own stage key), which then stands as the run's benchmark. `fresh`: measured afresh
    by this run on the screening's prompts (a search's runoff between candidates). It stops after a round
    once a speed check has already Failed (see `futility_policy`): a candidate slower than the
    gate allows stops consuming time."""
    from kiln.engine.cache import hardware_fingerprint

    b = ctx.recipe.evaluate.benchmark
    # A confirmation is held out: the next num_prompts prompts of the set, which the screening never ran.
    prompts = cached_prompts(ctx, engines["baseline"], b.prompts, b.num_prompts * (2 if confirmation else 1),
                             CONFIRMATION_PROMPTS if confirmation else "evaluate.benchmark.num_prompts")
    prompts = prompts[-b.num_prompts:]
    futility = futility_policy(ctx, b.repeats) if set(engines) == {"baseline", "candidate"} else None
    run_stage(ctx, "benchmark", "pair",
              {"engines": {r: p.name for r, p in engines.items()}, "config": b.model_dump(mode="json"),
               "hardware": hardware_fingerprint(), "prompts": hash_of(prompts), "pairing": "per-prompt",
               "records": "contention by signal, steal; per pair half", "prefill": "uncached", **_confirmation(ctx, confirmation, fresh, b.num_prompts),
               **({"stops_when_failed": futility.model_dump(mode="json")} if futility else {})},
              lambda out: _decode_bench(ctx, {role: loaded[role] for role in engines}, prompts, futility, out))


def _decode_bench(ctx: RunContext, arms: dict[str, Any], prompts: list[list[int]], futility: Any,
                  out: Path) -> dict[str, Any]:
    """The benchmark stage's work: the arms interleaved per prompt while the machine's contention is
    watched, over the whole benchmark (the report's figures) and over each arm's half of every pair
    (the gate's: a pair whose halves differ is dropped), each round judged on the speed checks when
    `futility` is set."""
    from kiln.evaluate import contention
    from kiln.evaluate.decode_bench import interleaved, speculation

    b = ctx.recipe.evaluate.benchmark
    watch = contention.Watch()  # how busy the machine is meanwhile
    stopped: dict[str, Any] = {}
    with watch:
        stop = _stop_when_failed(ctx, futility, watch, len(prompts), stopped) if futility else None
        per_arm = interleaved(arms, prompts, b.max_new_tokens, b.batch_sizes, b.repeats, stop=stop, watch=watch)
        machine = watch.figures()
    atomic_write_json(out / "repeats.json", per_arm)
    per_role = {role: {"repeats": samples, "metrics": {
        **{k: statistics.median(v) for k, v in samples.items()},
        **speculation(samples),  # drafting as totals over the requests, not a median of ratios
        **contention.as_metrics(machine)}}
        for role, samples in per_arm.items()}
    metrics = {f"{role}.{k}": v for role, part in per_role.items() for k, v in part["metrics"].items()}
    return {"metrics": metrics, "per_role": per_role, "machine": machine, **({"stopped": stopped} if stopped else {})}


def _stop_when_failed(ctx: RunContext, futility: Any, watch: Any, prompts: int,
                      stopped: dict[str, Any]) -> Callable[[dict[str, dict[str, list[float]]]], bool]:
    """The benchmark's look after each round: True (stop) once a speed check of `futility` is
    Failed on the pairs so far; `stopped` records when and why."""
    from kiln.evaluate import contention

    repeats = ctx.recipe.evaluate.benchmark.repeats

    def stop(samples: dict[str, dict[str, list[float]]]) -> bool:
        verdict = judge(futility, Evidence("candidate", metrics=contention.as_metrics(watch.figures()),
                                           repeats=samples["candidate"]),
                        Evidence("baseline", repeats=samples["baseline"]))
        failed = [r for r in verdict.results if r.verdict is Verdict.FAILED]
        if failed:
            rounds = len(samples["candidate"]["decode_tok_s"]) // prompts
            stopped.update(after_round=rounds, of=repeats, checks=[f"{r.name}: {r.reason}" for r in failed])
            ctx.console.print(f"  benchmark stopped after round {rounds} of {repeats}: "
                              + "; ".join(stopped["checks"]) + " (already Failed at "
                              f"{futility.confidence:.2%}, the check's confidence shared by the rounds)",
                              markup=False)
        return bool(failed)

    return stop


def _confirmation(ctx: RunContext, confirmation: bool, fresh: bool = False, held_out: int = 0) -> dict[str, Any]:
    """What makes a confirmation's stage key its own: this run (it is measured afresh by every run,
    never reused from a cache or a tracking server) and, for the decode benchmark, its prompts
    (the set's prompts num_prompts to 2 x num_prompts - 1). A `fresh` stage's: this run alone."""
    if not confirmation:
        return {"fresh": {"run": ctx.parent_run}} if fresh else {}
    split = {"prompts_held_out": [held_out, 2 * held_out]} if held_out else {}
    return {"confirmation": {"run": ctx.parent_run, **split}}


def futility_policy(ctx: RunContext, rounds: int) -> Any:
    """The checks the decode benchmark decides, as the benchmark may judge them after each round:
    the policy this run is judged at (a search's family policy), those checks only, each at its
    confidence shared by the rounds (Bonferroni over the looks). A look that finds one Failed stops
    the benchmark: its interval at the stricter look confidence lies wholly past the bound, so the
    final verdict on the same pairs is Failed too, and a candidate that truly meets the bound is
    stopped at most the check's own error rate. Only Failed stops it (a pass is measured in full).
    None: nothing to decide early."""
    policy = ctx.gate or ctx.recipe.gate
    checks = [c for c in policy.checks if phase_of(c) == "speed"]
    if not checks or rounds < 2:
        return None
    return for_family(policy.model_copy(update={"checks": checks}), rounds)


def load_stage(ctx: RunContext, loaded: LazyEngines, engines: dict[str, Path], confirmation: bool = False,
               fresh: bool = False) -> None:
    """Both arms served over HTTP under the recipe's load shape (see kiln.pipeline.stages.load).
    `confirmation`: a search's winner measured again, fresh (its own stage key), as `benchmark`;
    `fresh`: measured afresh by this run (a search's runoff)."""
    from kiln.engine.cache import hardware_fingerprint

    cfg = ctx.recipe.evaluate.load
    run_stage(ctx, "load", "pair",
              {"engines": {r: p.name for r, p in engines.items()}, "config": cfg.model_dump(mode="json"),
               "hardware": hardware_fingerprint(), **_confirmation(ctx, confirmation, fresh)},
              lambda out: measure({role: loaded[role] for role in engines}, engines, cfg, out))


def speculation_sweep(ctx: RunContext, loaded: LazyEngines, engines: dict[str, Path]) -> None:
    """A speculating candidate against its plain twin (`EngineConfig.plain_twin`: the same engine folder,
    opened without speculation) at rising concurrency, on the benchmark's prompts: the concurrency at
    which speculation stops paying, as figures (kiln.evaluate.decode_bench.stops_paying), not a check.
    Nothing runs for a candidate without a twin."""
    from kiln.engine.cache import hardware_fingerprint
    from kiln.pipeline.stages.lossless import open_twin, plain_twin

    engine_dir = engines.get("candidate")
    manifest, twin = plain_twin(engine_dir) if engine_dir else (None, None)
    if twin is None:
        return
    b = ctx.recipe.evaluate.benchmark
    prompts = cached_prompts(ctx, engines["baseline"], b.prompts, b.num_prompts)
    confidence = (ctx.gate or ctx.recipe.gate).confidence

    def compute(out: Path) -> dict[str, Any]:
        from kiln.evaluate.decode_bench import concurrency_sweep, stops_paying

        loaded.keep_only("candidate")
        plain = open_twin(engine_dir, manifest, twin)
        try:
            samples = concurrency_sweep({"speculative": loaded["candidate"], "plain": plain}, prompts,
                                        b.max_new_tokens, b.repeats)
        finally:
            plain.close()
        atomic_write_json(out / "sweep.json", samples)
        return {"metrics": stops_paying(samples["speculative"], samples["plain"], confidence), "sweep": samples}

    run_stage(ctx, "speculation", "candidate",
              {"engine": engine_dir.name, "twin": twin.model_dump(mode="json"), "prompts": hash_of(prompts),
               "config": b.model_dump(mode="json"), "confidence": confidence, "hardware": hardware_fingerprint()},
              compute)
