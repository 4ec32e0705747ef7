"""Gate policy -> Argo Rollouts AnalysisTemplates: each check becomes a PromQL query and conditions.

Check -> PromQL over the metrics kiln serve exports (vLLM-style names; the pods of an arm are
picked by their pod-template hash, passed in by the Rollout as args canary-hash / stable-hash):
- ttft_ms, tpot_ms, ratio: latency(canary) / latency(stable); SLO: 1000 * latency(canary) (ms);
- decode_tok_s, ratio: latency_tpot(stable) / latency_tpot(canary); SLO: 1 / latency_tpot(canary);
- error_rate: rate(finished_reason="error") / rate(all requests), canary pods;
- quality, agreement, size, other metrics: no Prometheus signal: skipped, with a warning.
latency is sum(rate(_sum)) / sum(rate(_count)) (the mean, exact from a histogram) or
histogram_quantile(q, ...) (kubernetes.latency_statistic). Every query is empty until the canary
served the step's min-requests within the query window, and an empty result decides nothing.

Three templates: `<name>-guard` (background, failureCondition only, failureLimit tolerated: a
regression aborts at any step; an empty result counts as no failure), `<name>-step` (per step:
successCondition, consecutiveSuccessLimit in a row pass, at most count = max_duration / interval
measurements; when they run out, on_inconclusive=rollback renders failureLimit -1 so Argo fails
the metric and aborts, hold renders failureLimit = count so Argo ends Inconclusive and pauses),
and `<name>-step-full` for a 100% step (absolute checks only: no stable traffic to compare with).
Argo judges point values at each measurement, not a sequential test: in-cluster false-rollback
control rests on failureLimit, consecutive successes and the window.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from kiln.deploy.config import DeployConfig, KubernetesConfig
from kiln.pipeline.errors import KilnError
from kiln.pipeline.gate.base import CheckConfig
from kiln.pipeline.gate.policy import GateSection

ARGO = "argoproj.io/v1alpha1"
METRICS = {"ttft": "kiln:time_to_first_token_seconds", "tpot": "kiln:time_per_output_token_seconds",
           "requests": "kiln:request_success_total", "waiting": "kiln:num_requests_waiting"}
QUANTILES = {"p50": 0.5, "p90": 0.9, "p95": 0.95, "p99": 0.99}
ARGS = [{"name": "canary-hash"}, {"name": "stable-hash"}]


@dataclass
class Query:
    name: str
    promql: str
    op: str  # "<=" or ">="
    bound: float
    ratio: bool  # canary / stable: cannot be measured once stable gets no traffic

    def passes(self) -> str:
        return f"len(result) > 0 && result[0] {self.op} {self.bound:g}"

    def fails(self) -> str:
        return f"len(result) > 0 && result[0] {'>' if self.op == '<=' else '<'} {self.bound:g}"


class PromQL:
    """Builds the queries for one app: label selectors, window, latency statistic."""

    def __init__(self, name: str, k: KubernetesConfig):
        self.k, self.base = k, f'namespace="{k.namespace}",app="{name}"'

    def sel(self, arm: str, extra: str = "") -> str:
        return "{" + f'{self.base},{self.k.hash_label}="{{{{args.{arm}-hash}}}}"{extra}' + "}"

    def latency(self, kind: str, arm: str) -> str:
        m, w = METRICS[kind], self.k.query_window
        if self.k.latency_statistic == "mean":
            return f"(sum(rate({m}_sum{self.sel(arm)}[{w}])) / sum(rate({m}_count{self.sel(arm)}[{w}])))"
        q = QUANTILES[self.k.latency_statistic]
        return f"histogram_quantile({q}, sum(rate({m}_bucket{self.sel(arm)}[{w}])) by (le))"

    def guarded(self, expr: str) -> str:
        """Empty (not a number) while the canary has served fewer than min-requests in the window."""
        count = f"sum(increase({METRICS['requests']}{self.sel('canary')}[{self.k.query_window}]))"
        return f"({expr}) and on() ({count} >= {{{{args.min-requests}}}})"

    def check(self, cfg: CheckConfig) -> tuple[str, str, float] | str:
        """(expression, operator, bound) for a check, or the reason it cannot be expressed.
        Ratios need traffic on both arms; absolute bounds (SLOs, error rate) only on the canary."""
        if cfg.kind == "error_rate":
            failed = self.sel("canary", ',finished_reason="error"')
            errors = f"(sum(rate({METRICS['requests']}{failed}[{self.k.query_window}])) or on() vector(0))"
            total = f"sum(rate({METRICS['requests']}{self.sel('canary')}[{self.k.query_window}]))"
            return f"{errors} / {total}", "<=", cfg.max  # type: ignore[attr-defined]
        if cfg.kind != "performance":
            return f"a {cfg.kind} check has no Prometheus signal (it is judged offline by `kiln run`)"
        c: Any = cfg
        kind = {"ttft_ms": "ttft", "tpot_ms": "tpot", "decode_tok_s": "tpot"}.get(c.metric)
        if kind is None:
            return f"metric '{c.metric}' is not exported by kiln serve as a per-request histogram"
        canary, stable = self.latency(kind, "canary"), self.latency(kind, "stable")
        inverse = c.metric == "decode_tok_s"  # tokens/s = 1 / TPOT
        if c.min_ratio is not None or c.max_ratio is not None:
            expr = f"{stable} / {canary}" if inverse else f"{canary} / {stable}"
            return (expr, ">=", c.min_ratio) if c.min_ratio is not None else (expr, "<=", c.max_ratio)
        expr = f"1 / {canary}" if inverse else f"1000 * {canary}"
        return (expr, ">=", c.min) if c.min is not None else (expr, "<=", c.max)


def _queries(name: str, policy: GateSection, k: KubernetesConfig, warnings: list[str]) -> list[Query]:
    pq, out = PromQL(name, k), []
    for cfg in policy.checks:
        mapped = pq.check(cfg)
        if isinstance(mapped, str):
            warnings.append(f"check {cfg.label} skipped in the AnalysisTemplates: {mapped}")
            continue
        expr, op, bound = mapped
        label = cfg.name or (cfg.kind if cfg.metric == cfg.kind else f"{cfg.kind}-{cfg.metric}")
        metric_name = re.sub(r"[^a-z0-9-]+", "-", label.lower()).strip("-")
        out.append(Query(metric_name, pq.guarded(expr), op, bound, "_ratio" in _bound_kind(cfg)))
    return out


def _bound_kind(cfg: CheckConfig) -> str:
    return next((b for b in ("min_ratio", "max_ratio") if getattr(cfg, b, None) is not None), "absolute")


def _seconds(duration: str) -> int:
    return int(duration[:-1]) * {"s": 1, "m": 60, "h": 3600}[duration[-1]]


def analysis_templates(name: str, policy: GateSection, deploy: DeployConfig, warnings: list[str]) -> list[dict]:
    """The guard (background, fail-fast), the step gate, and the step gate for a 100% step (no
    stable traffic left to compare with, so only the absolute checks)."""
    k = deploy.kubernetes
    queries = _queries(name, policy, k, warnings)
    if not queries:
        raise KilnError("gate.checks: no check can be expressed as a Prometheus query, so the rollout would "
                        "have no analysis. Add an error_rate check or a ttft_ms / tpot_ms performance check.")
    count = max(1, math.ceil(max(s.max_duration_s for s in deploy.steps) / _seconds(k.analysis_interval)))
    args = [*ARGS, {"name": "min-requests"}]

    def provider(q: Query) -> dict:
        return {"prometheus": {"address": k.prometheus_url, "query": q.promql}}

    def template(suffix: str, metrics: list[dict]) -> dict:
        return {"apiVersion": ARGO, "kind": "AnalysisTemplate",
                "metadata": {"name": f"{name}-{suffix}", "namespace": k.namespace, "labels": {"app": name}},
                "spec": {"args": args, "metrics": metrics}}

    guard = [{"name": q.name, "interval": k.analysis_interval, "failureCondition": q.fails(),
              "failureLimit": k.failure_limit, "provider": provider(q)} for q in queries]
    limit = -1 if deploy.on_inconclusive == "rollback" else count

    def gate(q: Query) -> dict:
        return {"name": q.name, "interval": k.analysis_interval, "count": count, "successCondition": q.passes(),
                "consecutiveSuccessLimit": k.consecutive_successes, "failureLimit": limit, "provider": provider(q)}

    docs = [template("guard", guard), template("step", [gate(q) for q in queries])]
    absolute = [gate(q) for q in queries if not q.ratio]
    if absolute:
        docs.append(template("step-full", absolute))
    if deploy.on_inconclusive == "hold":
        warnings.append("on_inconclusive=hold: an undecided step ends Inconclusive and Argo pauses the rollout "
                        "until `kubectl argo rollouts promote` or `abort`")
    return docs


