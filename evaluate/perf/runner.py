"""Run a load test against one server, or compare two servers with interleaved repeats.

Composition in three lines: the shape yields stages, the driver runs each stage through one
streaming client, metrics summarize it. `run_load` returns every request record (for JSONL) and
every stage summary; `compare_interleaved` runs baseline and candidate A, B, A, B, ... under the
same workload and reports candidate/baseline ratios with intervals across repeats.
"""

from __future__ import annotations

import json
import resource
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kiln.core import progress
from kiln.evaluate.perf.base import SHAPES
from kiln.evaluate.perf.client import StreamClient
from kiln.evaluate.perf.compare import RatioEstimate, format_ratios, ratio_estimates
from kiln.evaluate.perf.config import PerformanceConfig
from kiln.evaluate.perf.driver import StageResult, run_stage
from kiln.evaluate.perf.metrics import Knee, Summary, find_knee
from kiln.evaluate.perf.workload import Workload
from kiln.core.errors import BadInput
from kiln.core.files import atomic_write_text


def _cpu_seconds() -> float:
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


@dataclass(repr=False)
class LoadResult:
    url: str
    model: str
    config: PerformanceConfig
    stages: list[StageResult]
    knee: Knee | None = None
    client_cpu_s: float = 0.0  # CPU this process spent during the run (all stages)
    extra: dict[str, Any] = field(default_factory=dict)

    def __repr__(self) -> str:  # the default would print every record
        return (
            f"LoadResult({self.url!r}, {len(self.stages)} stages, {sum(len(s.records) for s in self.stages)} requests)"
        )

    @property
    def summaries(self) -> list[Summary]:
        return [s.summary for s in self.stages]

    @property
    def summary(self) -> Summary:
        """The headline stage: the only one, else the knee's, else the last."""
        if self.knee:
            return next(s for s in self.summaries if s.label == self.knee.label)
        return self.summaries[-1]

    @property
    def client_cpu_ms_per_request(self) -> float:
        n = sum(len(s.records) for s in self.stages)
        return 1000 * self.client_cpu_s / n if n else float("nan")

    def write_jsonl(self, path: Path) -> None:
        """One line per request: stage label plus the record's latencies (times from stage start)."""
        lines = [json.dumps({"stage": s.label, **r.to_json(s.t0)}) for s in self.stages for r in s.records]
        atomic_write_text(Path(path), "\n".join(lines) + "\n")

    def to_dict(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "model": self.model,
            "config": self.config.model_dump(mode="json"),
            "stages": [asdict(s) for s in self.summaries],
            "knee": asdict(self.knee) if self.knee else None,
            "client_cpu_ms_per_request": self.client_cpu_ms_per_request,
        }


async def run_load_async(
    url: str, config: PerformanceConfig, api_key: str | None = None, model: str | None = None, salt: str = ""
) -> LoadResult:
    """`run_load` for callers already inside an event loop (the canary controller)."""
    shape = SHAPES.create(config.shape, seed=config.seed)
    work = Workload(config)
    stages: list[StageResult] = []
    cpu0 = _cpu_seconds()
    progress.total(None, "requests")  # bounded by time as much as by count: a rate, no ETA
    async with StreamClient(
        url, api_key=api_key, model=model, endpoint=config.endpoint, timeout_s=config.request_timeout_s
    ) as client:
        gen = shape.stages()
        stage = next(gen)
        while True:
            stages.append(await run_stage(client, stage, work, config, f"{salt}s{len(stages)}"))
            try:
                stage = gen.send(stages[-1].summary)
            except StopIteration:
                break
    knee = find_knee([s.summary for s in stages])
    return LoadResult(url, client.model or "", config, stages, knee, _cpu_seconds() - cpu0)


def run_load(
    url: str, config: PerformanceConfig, api_key: str | None = None, model: str | None = None, salt: str = ""
) -> LoadResult:
    """Run every stage of `config.shape` against the server at `url` (uvloop, this process).

    `model` defaults to the first model the server lists. `salt` keeps prompts unique across
    calls that share a seed (a comparison passes the repeat number).
    """
    import uvloop

    return uvloop.run(run_load_async(url, config, api_key, model, salt))


@dataclass
class Comparison:
    baseline: list[LoadResult]
    candidate: list[LoadResult]
    ratios: list[RatioEstimate]

    def ratio(self, metric: str) -> RatioEstimate:
        return next(r for r in self.ratios if r.metric == metric)

    def table(self) -> str:
        return format_ratios(self.ratios)

    def to_dict(self) -> dict[str, Any]:
        return {
            "ratios": [asdict(r) for r in self.ratios],
            "baseline": [asdict(r.summary) for r in self.baseline],
            "candidate": [asdict(r.summary) for r in self.candidate],
        }


def _single_stage(config: PerformanceConfig) -> None:
    shape = config.shape
    multi = (
        shape.kind == "sweep"
        or isinstance(getattr(shape, "rate", None), list)
        or isinstance(getattr(shape, "concurrency", None), list)
    )
    if multi:
        raise BadInput(
            "evaluate.performance.shape: a comparison needs one fixed load (one rate or one concurrency); "
            "a sweep or a list picks different loads per arm. Use constant, poisson, concurrent or synchronous."
        )


def compare_interleaved(
    url_a: str,
    url_b: str,
    config: PerformanceConfig,
    repeats: int | None = None,
    *,
    api_key: str | None = None,
    api_key_b: str | None = None,
    model: str | None = None,
    model_b: str | None = None,
) -> Comparison:
    """Baseline (a) and candidate (b), run A, B, A, B, ... with the same requests in each pair."""
    _single_stage(config)
    base, cand = [], []
    for k in range(repeats or config.repeats):
        base.append(run_load(url_a, config, api_key, model, salt=f"r{k}"))
        cand.append(
            run_load(url_b, config, api_key_b if api_key_b is not None else api_key, model_b or model, salt=f"r{k}")
        )
    return Comparison(base, cand, ratio_estimates([r.summary for r in base], [r.summary for r in cand]))
