"""Engine tuning: search a backend's knobs for the config that serves the most goodput within the SLO.

The recipe's `tune` section (beside `engine`, which it tunes) names a search space over fields of
the backend's own config
(`space: {threads: [1, 2], max_batch_size: [1, 4, 8]}`) and the load each trial serves. A trial
builds its engine through the content-addressed cache (a config seen before costs nothing),
serves it in-process over the OpenAI API (`ServerThread`) and drives it with the benchmark
harness over real HTTP, so it measures what a client sees, queueing and streaming included.
It lives in evaluate/, not engine/: an engine is measured from outside.

Objective: goodput (requests/s that met both the TTFT and the TPOT SLO of `load.slo`), ties
broken by output-token throughput. Goodput rather than throughput, because batching until every
request misses its TPOT target raises throughput and serves nobody well. The Pareto front is
output tokens/s (higher is better) against TPOT p95 (lower is better): the trade-off batching
and threading knobs move; TTFT is held by the SLO inside the objective.
"""

from __future__ import annotations

import itertools
import math
import random
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from kiln.evaluate.perf.concurrent import ConcurrentConfig
from kiln.evaluate.perf.config import LengthDistribution, PerformanceConfig, Trim, WorkloadConfig
from kiln.core.errors import KilnError
from kiln.core.files import atomic_write_text
from kiln.core.registry import did_you_mean

# What a trial records from the load's headline stage (names as `Summary.flat()` spells them).
METRICS = ("goodput", "output_token_throughput", "request_throughput", "slo_attainment",
           "ttft_p95_ms", "tpot_p95_ms", "e2e_p95_ms", "completed", "errors")


def _short_load() -> PerformanceConfig:
    """15 s a trial, sized for the 2-core CPU demo: 4 closed-loop users, 64-token prompts, 16 tokens
    out, so every user's loop turns several times inside the window even at max_batch_size 1. A
    setting that cannot finish its requests within 30 s of the stage's end is cut off, not waited for."""
    return PerformanceConfig(shape=ConcurrentConfig(concurrency=4), duration_s=15.0, warmup=Trim(seconds=3.0),
                             cooldown=Trim(seconds=2.0), workload=WorkloadConfig(input_tokens=LengthDistribution(mean=64)),
                             output_tokens=16, drain_timeout_s=30.0)


class TuneConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    space: dict[str, list[Any]] = Field(description="knob -> values to try; each knob is a field of this backend's config")
    load: PerformanceConfig = Field(default_factory=_short_load,
                                    description="the load every trial serves; its `slo` is the objective's SLO")
    max_trials: int = Field(12, ge=1, description="the whole grid when it fits, else a seeded random subset of it")
    seed: int = 0

    @field_validator("space")
    @classmethod
    def _values(cls, v: dict[str, list[Any]]) -> dict[str, list[Any]]:
        if not v or any(not values for values in v.values()):
            raise ValueError("space needs at least one knob, each with at least one value")
        return v


def check_space(config: BaseModel, tune: TuneConfig) -> None:
    """Every knob a field of this backend's config, every value one that config accepts.

    Called by the recipe's validator, so a bad space fails `kiln validate`, not trial 5.
    """
    cls = type(config)
    knobs = sorted(set(cls.model_fields) - {"backend"})
    base = config.model_dump()
    for knob, values in tune.space.items():
        if knob not in knobs:
            raise ValueError(f"tune.space.{knob}: not a knob of the {config.backend} backend."  # type: ignore[attr-defined]
                             f"{did_you_mean(knob, knobs)}")
        for value in values:
            try:
                cls.model_validate({**base, knob: value})
            except ValidationError as e:
                raise ValueError(f"tune.space.{knob}: {value!r} is not a valid value "
                                 f"({e.errors()[0]['msg']})") from None


def settings(tune: TuneConfig) -> list[dict[str, Any]]:
    """The knob settings to try: the whole grid, or `max_trials` of it drawn with `seed`, in grid order."""
    space = tune.space
    grid = [dict(zip(space, combo)) for combo in itertools.product(*space.values())]
    if len(grid) > tune.max_trials:
        grid = [grid[i] for i in sorted(random.Random(tune.seed).sample(range(len(grid)), tune.max_trials))]
    return grid


def with_knobs(config: Any, knobs: dict[str, Any]) -> Any:
    """The backend config with `knobs` set: what a trial, or the winner, builds. It hashes like a
    hand-written config, so the winner's engine is the one its trial already built."""
    return type(config).model_validate({**config.model_dump(), **knobs})


def tune_inputs(config: Any, tune: TuneConfig, checkpoint_hash: str) -> dict[str, Any]:
    """What a tuning result depends on (its cache key): the search, the model, the libraries, the hardware."""
    from kiln.engine.base import BACKENDS
    from kiln.engine.cache import hardware_fingerprint, library_versions

    return {"engine": {**config.model_dump(mode="json"), "tune": tune.model_dump(mode="json")},
            "artifact": checkpoint_hash, "hardware": hardware_fingerprint(),
            "versions": library_versions(getattr(BACKENDS.get(config.backend), "libraries", ()))}


@dataclass
class Trial:
    knobs: dict[str, Any]
    engine: str = ""  # the engine cache key (folder name under <cache>/engines)
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None  # the trial could not run (build, load or server failure)
    request_errors: str | None = None  # it ran, and some requests failed: the most common error
    pareto: bool = False
    winner: bool = False


def run_trial(config: Any, load: PerformanceConfig, knobs: dict[str, Any], checkpoint: Path, checkpoint_hash: str,
              cache: Path) -> Trial:
    """Build (or reuse) the engine with `knobs`, serve it, run the tuning load against it over HTTP."""
    from kiln.engine.cache import build_engine
    from kiln.engine.serve.server_thread import ServerThread
    from kiln.evaluate.perf.runner import run_load

    trial, start = Trial(knobs), time.perf_counter()
    try:
        engine_dir = build_engine(with_knobs(config, knobs), checkpoint, checkpoint_hash, cache)
        trial.engine = engine_dir.name
        key = secrets.token_urlsafe(16)
        server = ServerThread(engine_dir, api_key=key)
        try:
            server.start(wait_ready=600)
            summary = run_load(server.url, load, api_key=key).summary
        finally:
            server.stop()
        flat = summary.flat()
        trial.metrics = {k: flat[k] for k in METRICS}
        trial.request_errors = summary.error_summary
    except Exception as e:  # noqa: BLE001 - a setting the backend refuses fails its trial, not the search
        trial.error = f"{type(e).__name__}: {e}"
    trial.metrics["wall_s"] = time.perf_counter() - start
    return trial


def pareto_front(points: Sequence[tuple[float, float]]) -> list[bool]:
    """For (throughput, latency) points: which no other point matches or beats on both and beats
    on one. Higher throughput and lower latency are better; a point with a NaN is never on it."""
    ok = [not (math.isnan(t) or math.isnan(lat)) for t, lat in points]

    def dominated(i: int) -> bool:
        t, lat = points[i]
        return any(ok[j] and points[j][0] >= t and points[j][1] <= lat and points[j] != points[i]
                   for j in range(len(points)))

    return [ok[i] and not dominated(i) for i in range(len(points))]


def mark(trials: list[Trial]) -> Trial:
    """Set each trial's Pareto and winner flags; return the winner (most goodput, then throughput)."""
    done = [t for t in trials if t.error is None]
    if not done:
        raise KilnError("tune: every trial failed:\n" + "\n".join(f"  {label(t.knobs)}: {t.error}" for t in trials))
    front = pareto_front([(t.metrics["output_token_throughput"], t.metrics["tpot_p95_ms"]) for t in done])
    for t, on in zip(done, front):
        t.pareto = on
    winner = max(done, key=lambda t: (t.metrics["goodput"], t.metrics["output_token_throughput"]))
    winner.winner = True
    return winner


def label(knobs: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in knobs.items())


def tune(config: Any, space: TuneConfig, checkpoint: Path, checkpoint_hash: str, cache: Path, out: Path,
         log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run every trial of `space` on the backend `config`, write the trials table and the Pareto plot
    into `out`, and return the result: every trial, the winner's knobs, the winner's numbers as metrics."""
    todo = settings(space)
    trials = []
    for i, knobs in enumerate(todo, 1):
        trial = run_trial(config, space.load, knobs, checkpoint, checkpoint_hash, cache)
        log(f"  trial {i}/{len(todo)} {label(knobs)}: " + (trial.error or _brief(trial)))
        trials.append(trial)
    winner = mark(trials)
    headline = ("goodput", "output_token_throughput", "ttft_p95_ms", "tpot_p95_ms")
    result = {"metrics": {"tune.trials": len(trials), "tune.failed": sum(t.error is not None for t in trials),
                          **{f"tune.{k}": winner.metrics[k] for k in headline}},
              "winner": winner.knobs, "slo": space.load.slo.model_dump(),
              "trials": [asdict(t) for t in trials]}
    atomic_write_text(Path(out) / "trials.md", trials_table(result) + "\n")
    pareto_plot(trials, Path(out) / "pareto.png")
    return result


def _brief(trial: Trial) -> str:
    m = trial.metrics
    return (f"goodput {m['goodput']:.2f} req/s, {m['output_token_throughput']:.1f} tok/s, "
            f"TTFT p95 {m['ttft_p95_ms']:.0f} ms, TPOT p95 {m['tpot_p95_ms']:.0f} ms, {m['completed']:.0f} completed"
            + (f"; request errors: {trial.request_errors}" if trial.request_errors else ""))


def trials_table(result: dict[str, Any]) -> str:
    """Every trial as a Markdown table, Pareto-front members and the winner marked."""
    knobs = list(result["trials"][0]["knobs"])
    head = ["#", *knobs, "goodput req/s", "output tok/s", "TTFT p95 ms", "TPOT p95 ms", "SLO met", "Pareto", "winner"]
    rows = []
    for i, t in enumerate(result["trials"], 1):
        m = t["metrics"]
        numbers = ([f"{m['goodput']:.2f}", f"{m['output_token_throughput']:.1f}", _ms(m["ttft_p95_ms"]),
                    _ms(m["tpot_p95_ms"]), f"{m['slo_attainment']:.0%}"] if t["error"] is None
                   else [f"failed: {t['error'][:60]}", "", "", "", ""])
        rows.append([str(i), *(str(t["knobs"][k]) for k in knobs), *numbers,
                     "✓" if t["pareto"] else "", "★" if t["winner"] else ""])
    slo = result["slo"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head), *("| " + " | ".join(r) + " |" for r in rows)]
    return "\n".join([*lines, "", f"SLO: TTFT p95 ≤ {slo['ttft_p95_ms']:g} ms, TPOT p95 ≤ {slo['tpot_p95_ms']:g} ms; "
                      "Pareto: output tok/s vs TPOT p95; winner: most goodput, then throughput."])


def _ms(value: float) -> str:
    return "–" if math.isnan(value) else f"{value:.0f}"  # NaN: no request completed in the window


def pareto_plot(trials: Sequence[Trial], path: Path) -> None:
    """Output tokens/s against TPOT p95 for every trial; the front joined, the winner starred."""
    from matplotlib.figure import Figure

    done = [t for t in trials if t.error is None]
    fig = Figure(figsize=(6, 4.5))
    ax = fig.subplots()
    ax.plot([t.metrics["tpot_p95_ms"] for t in done], [t.metrics["output_token_throughput"] for t in done],
            "o", color="grey", label="trial")
    front = sorted((t for t in done if t.pareto), key=lambda t: t.metrics["tpot_p95_ms"])
    ax.plot([t.metrics["tpot_p95_ms"] for t in front], [t.metrics["output_token_throughput"] for t in front],
            "o-", label="Pareto front")
    for t in done:
        xy = (t.metrics["tpot_p95_ms"], t.metrics["output_token_throughput"])
        ax.annotate(label(t.knobs), xy, fontsize=7, xytext=(3, 3), textcoords="offset points")
        if t.winner:
            ax.plot(*xy, "r*", markersize=16, label=f"winner (goodput {t.metrics['goodput']:.2f} req/s)")
    ax.set_xlabel("TPOT p95 (ms)")
    ax.set_ylabel("throughput (output tokens/s)")
    ax.set_title("Engine tuning: every trial")
    ax.grid(alpha=0.3)
    ax.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")


def log_trials(tracker: Any, parent_run: str, result: dict[str, Any], reused: bool) -> None:
    """One MLflow child run per trial under the tuning run: knobs as params, numbers as metrics,
    `pareto` and `winner` tags (a reused result is logged again, tagged reused, so every run's
    tree shows the trials its engines came from)."""
    for i, t in enumerate(result["trials"], 1):
        run = tracker.start(f"trial {i}: {label(t['knobs'])}",
                            {"kiln.stage": "tune.trial", "kiln.trial": str(i), "kiln.reused": str(reused).lower(),
                             "pareto": str(t["pareto"]).lower(), "winner": str(t["winner"]).lower(),
                             **{k: t[k][:5000] for k in ("error", "request_errors") if t[k]}}, parent=parent_run)
        tracker.log(run, metrics=t["metrics"], params={**t["knobs"], "engine": t["engine"]})
        tracker.end(run, "FAILED" if t["error"] else "FINISHED")
