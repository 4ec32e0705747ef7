"""Gate policy -> Argo Rollouts AnalysisTemplates: each check becomes a PromQL query and conditions.

Check -> PromQL over the metrics kiln serve exports (kiln.engine.serve.metric_names; the pods of an arm are
picked by their pod-template hash, passed in by the Rollout as args canary-hash / stable-hash):
- ttft_ms, tpot_ms, ratio: latency(canary) / latency(stable); SLO: 1000 * latency(canary) (ms);
- decode_tok_s, ratio: latency_tpot(stable) / latency_tpot(canary); SLO: 1 / latency_tpot(canary);
- error_rate: rate(outcome="server_error") / rate(all requests), canary pods;
- agreement on served_prefix / served_match (greedy_match) with a min, when
  deploy.router.mirror_fraction > 0: the rendered router's mirrored scores (its pods labelled
  app=<name>-router, scraped with their namespace and app labels), 1 - (mean stable-vs-stable - mean
  canary-vs-stable) >= min: the live gate's statistic (live_gate.py) on the query window, empty until
  min-requests prompts were mirrored. The router's series carry no pod-template hash, so a step gate
  waits one query window (initialDelay) before it first reads them: until then the window still
  holds prompts mirrored before the canary's pods served (to the stable pods behind the canary Service);
- quality, size, other metrics: no Prometheus signal: skipped, with a warning.
latency is sum(rate(_sum)) / sum(rate(_count)) (the mean, exact from a histogram) or
histogram_quantile(q, ...) (kubernetes.latency_statistic). Every query is empty until the canary
served the step's min-requests within the query window, and an empty result decides nothing.

Three templates: `<name>-guard` (background, failureCondition only, failureLimit tolerated: a
regression aborts at any step; an empty result counts as no failure), `<name>-step` (per step:
successCondition, consecutiveSuccessLimit in a row pass, at most count = max_duration / interval
measurements; when they run out, on_inconclusive=rollback renders failureLimit -1 so Argo fails
the metric and aborts; hold also renders the failureCondition with the guard's failureLimit and
inconclusiveLimit = count, so an empty result is an Inconclusive measurement that ends nothing,
more than failureLimit measured violations fail the step, and running out ends the metric
Inconclusive, which pauses the rollout),
and `<name>-step-full` for a 100% step (absolute checks only: no stable traffic to compare with).
With the router, `<name>-router-weight` is a step of its own: it POSTs the step's weight to the
router's /admin/weight (Argo's web provider, the admin key from the Secret), since the router, not the
pod counts, splits the traffic.
Argo judges point values at each measurement, not a sequential test: in-cluster false-rollback
control rests on failureLimit, consecutive successes and the window.

Metric names are `<kind>-<metric>-<bound>` (e.g. performance-ttft-ms-max-ratio beside
performance-ttft-ms-max), or the check's own `name`: Argo refuses two metrics of one name.
`recipe_problems` says which recipe field causes what Argo's rules (argo_rules.py) reject.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from kiln.deploy.config import DeployConfig, KubernetesConfig
from kiln.engine.serve import metric_names as names
from kiln.core.errors import KilnError
from kiln.core.gate.base import CheckConfig
from kiln.core.gate.policy import GateSection

ARGO = "argoproj.io/v1alpha1"
METRICS = {"ttft": names.TTFT, "tpot": names.TPOT, "requests": names.total(names.REQUESTS), "waiting": names.WAITING}
QUANTILES = {"p50": 0.5, "p90": 0.9, "p95": 0.95, "p99": 0.99}
ARGS = [{"name": "canary-hash"}, {"name": "stable-hash"}]
# Agreement metrics -> the router's histogram of per-prompt scores (label PAIR).
MIRRORED = {"served_prefix": names.ROUTER_MIRROR_PREFIX, "served_match": names.ROUTER_MIRROR_MATCH,
            "greedy_match": names.ROUTER_MIRROR_MATCH}
# The keys of the API-key Secret: the clients' key(s); with the router, the one it sends the engines and its admin key.
API_KEY, UPSTREAM_KEY, ADMIN_KEY = "api-key", "upstream-key", "admin-key"
ROUTER_PORT = 8080  # the router's container port (its Service listens on 80)


def routed(deploy: DeployConfig) -> bool:
    """The router is rendered in front of both arms: it mirrors prompts, so it splits the traffic too."""
    return deploy.router.mirror_fraction > 0


def router_app(name: str) -> str:
    """The router's Deployment, Service and pod label `app` (not `name`: the arms' Services select that)."""
    return f"{name}-router"


def secret_name(name: str, k: KubernetesConfig) -> str:
    return k.api_key_secret or f"{name}-api-key"


@dataclass
class Query:
    name: str
    promql: str
    op: str  # "<=" or ">="
    bound: float
    ratio: bool  # canary / stable: cannot be measured once stable gets no traffic
    delay: str | None = None  # a step gate's first measurement waits this long (Argo initialDelay)

    def passes(self) -> str:
        return f"len(result) > 0 && result[0] {self.op} {self.bound:g}"

    def fails(self) -> str:
        return f"len(result) > 0 && result[0] {'>' if self.op == '<=' else '<'} {self.bound:g}"


class PromQL:
    """Builds the queries for one app: label selectors, window, latency statistic."""

    def __init__(self, name: str, k: KubernetesConfig, mirroring: bool = False):
        self.k, self.base, self.mirroring = k, f'namespace="{k.namespace}",app="{name}"', mirroring
        self.router = f'namespace="{k.namespace}",app="{router_app(name)}"'

    def sel(self, arm: str, extra: str = "") -> str:
        return "{" + f'{self.base},{self.k.hash_label}="{{{{args.{arm}-hash}}}}"{extra}' + "}"

    def latency(self, kind: str, arm: str) -> str:
        m, w = METRICS[kind], self.k.query_window
        if self.k.latency_statistic == "mean":
            return f"(sum(rate({m}_sum{self.sel(arm)}[{w}])) / sum(rate({m}_count{self.sel(arm)}[{w}])))"
        q = QUANTILES[self.k.latency_statistic]
        return f"histogram_quantile({q}, sum(rate({m}_bucket{self.sel(arm)}[{w}])) by (le))"

    def guarded(self, expr: str, count: str | None = None) -> str:
        """Empty (not a number) while the canary has served fewer than min-requests in the window
        (or `count`, another counter expression, is under it)."""
        count = count or f"sum(increase({METRICS['requests']}{self.sel('canary')}[{self.k.query_window}]))"
        return f"({expr}) and on() ({count} >= {{{{args.min-requests}}}})"

    def mirrored(self, metric: str, pair: str, part: str = "sum", over: str = "rate") -> str:
        """The router's series of one pair (its pod carries no pod-template hash: it fronts both arms)."""
        sel = "{" + f'{self.router},{names.PAIR}="{pair}"' + "}"
        return f"sum({over}({metric}_{part}{sel}[{self.k.query_window}]))"

    def agreement(self, cfg: CheckConfig) -> tuple[str, str, float, str] | str:
        """The router's mirrored scores: 1 - (floor - canary) >= min, and the mirrored-prompt count."""
        metric = MIRRORED.get(cfg.metric)
        if metric is None or getattr(cfg, "min", None) is None:
            return f"only {', '.join(MIRRORED)} with a min have a live signal (the router's mirrored prompts)"
        if not self.mirroring:
            return "needs the router's mirrored prompts: set deploy.router.mirror_fraction > 0"

        def mean(pair: str) -> str:
            return f"({self.mirrored(metric, pair)} / {self.mirrored(metric, pair, 'count')})"
        count = self.mirrored(metric, names.MIRROR_CANARY, "count", "increase")
        return f"1 - ({mean(names.MIRROR_FLOOR)} - {mean(names.MIRROR_CANARY)})", ">=", cfg.min, count  # type: ignore[attr-defined]

    def check(self, cfg: CheckConfig) -> tuple[str, str, float] | str:
        """(expression, operator, bound) for a check, or the reason it cannot be expressed.
        Ratios need traffic on both arms; absolute bounds (SLOs, error rate) only on the canary."""
        if cfg.kind == "error_rate":
            failed = self.sel("canary", f',{names.OUTCOME}="{names.SERVER_ERROR}"')
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


def _queries(name: str, policy: GateSection, deploy: DeployConfig, warnings: list[str]) -> list[Query]:
    pq, out = PromQL(name, deploy.kubernetes, deploy.router.mirror_fraction > 0), []
    for cfg in policy.checks:
        mapped = pq.agreement(cfg) if cfg.kind == "agreement" else pq.check(cfg)
        if isinstance(mapped, str):
            warnings.append(f"check {cfg.label} skipped in the AnalysisTemplates: {mapped}")
            continue
        if cfg.kind == "agreement":  # mirrors need both arms, like a ratio
            expr, op, bound, count = mapped
            out.append(Query(metric_name(cfg), pq.guarded(expr, count), op, bound, True, deploy.kubernetes.query_window))
            continue
        expr, op, bound = mapped
        out.append(Query(metric_name(cfg), pq.guarded(expr), op, bound, "_ratio" in _bound(cfg)))
    return out


def _bound(cfg: CheckConfig) -> str:
    """The field holding the check's bound: a check has exactly one."""
    return next((b for b in ("min_ratio", "max_ratio", "min", "max") if getattr(cfg, b, None) is not None), "")


def metric_name(cfg: CheckConfig) -> str:
    """The Argo metric name of a check. A performance check names its bound, so a ratio check and
    an SLO check on one metric (ttft_ms max_ratio and ttft_ms max) get two names."""
    label = cfg.name or "-".join(dict.fromkeys([cfg.kind, cfg.metric] + ([_bound(cfg)] if cfg.kind == "performance" else [])))
    return re.sub(r"[^a-z0-9-]+", "-", label.lower()).strip("-")


def step_count(deploy: DeployConfig) -> int:
    """Measurements a step gate may take: the longest step's max_duration_s over the interval."""
    return max(1, math.ceil(max(s.max_duration_s for s in deploy.steps) / duration_s(deploy.kubernetes.analysis_interval)))


# The recipe field behind each Argo metric field the renderer sets.
RECIPE_FIELDS = {"consecutiveSuccessLimit": "deploy.kubernetes.consecutive_successes",
                 "failureLimit": "deploy.kubernetes.failure_limit",
                 "interval": "deploy.kubernetes.analysis_interval"}


def recipe_problems(violations: list, policy: GateSection, deploy: DeployConfig) -> list[str]:
    """One line per Argo rule broken (argo_rules.Violation), naming the recipe fields that set it
    and the metrics that break it."""
    lines: dict[str, list[str]] = {}
    for v in violations:
        fields: list[str] = []
        for f in v.fields:
            if f == "count":
                fields.append(f"deploy.steps[].max_duration_s (longest {max(s.max_duration_s for s in deploy.steps):g} s) / "
                              f"deploy.kubernetes.analysis_interval ({deploy.kubernetes.analysis_interval}) = count "
                              f"{step_count(deploy)}")
            elif f == "name":
                fields += [f"gate.checks[{i}].name" for i, c in enumerate(policy.checks) if metric_name(c) == v.metric]
            elif f in RECIPE_FIELDS:
                value = getattr(deploy.kubernetes, RECIPE_FIELDS[f].rsplit(".", 1)[1])
                fields.append(f"{RECIPE_FIELDS[f]} ({value})")
        if "failureLimit" in v.fields and deploy.on_inconclusive == "hold":
            fields.append("deploy.on_inconclusive (hold)")
        rule = re.sub(r"^metrics\[\d+\]: ", "", v.message)
        lines.setdefault(f"{', '.join(fields) or 'the renderer (a kiln bug)'}: {rule}", []).append(
            f"{v.template}/{v.metric}" if v.metric else v.template)
    return [f"{line} (Argo: {', '.join(dict.fromkeys(where))})" for line, where in lines.items()]


def duration_s(duration: str) -> int:
    return int(duration[:-1]) * {"s": 1, "m": 60, "h": 3600}[duration[-1]]


def analysis_templates(name: str, policy: GateSection, deploy: DeployConfig, warnings: list[str]) -> list[dict]:
    """The guard (background, fail-fast), the step gate, and the step gate for a 100% step (no
    stable traffic left to compare with, so only the absolute checks)."""
    k = deploy.kubernetes
    queries = _queries(name, policy, deploy, warnings)
    if not queries:
        raise KilnError("gate.checks: no check can be expressed as a Prometheus query, so the rollout would "
                        "have no analysis. Add an error_rate check or a ttft_ms / tpot_ms performance check.")
    count = step_count(deploy)
    args = [*ARGS, {"name": "min-requests"}]

    def provider(q: Query) -> dict:
        return {"prometheus": {"address": k.prometheus_url, "query": q.promql}}

    def template(suffix: str, metrics: list[dict]) -> dict:
        return {"apiVersion": ARGO, "kind": "AnalysisTemplate",
                "metadata": {"name": f"{name}-{suffix}", "namespace": k.namespace, "labels": {"app": name}},
                "spec": {"args": args, "metrics": metrics}}

    guard = [{"name": q.name, "interval": k.analysis_interval, "failureCondition": q.fails(),
              "failureLimit": k.failure_limit, "provider": provider(q)} for q in queries]

    def gate(q: Query) -> dict:
        metric = {"name": q.name, "interval": k.analysis_interval, **({"initialDelay": q.delay} if q.delay else {}),
                  "count": count, "successCondition": q.passes(),
                  "consecutiveSuccessLimit": k.consecutive_successes, "failureLimit": -1}
        if deploy.on_inconclusive == "hold":  # Argo ends a metric Inconclusive only with failureLimit >= 0
            metric |= {"failureCondition": q.fails(), "failureLimit": k.failure_limit, "inconclusiveLimit": count}
        return metric | {"provider": provider(q)}

    docs = [template("guard", guard), template("step", [gate(q) for q in queries])]
    absolute = [gate(q) for q in queries if not q.ratio]
    if absolute:
        docs.append(template("step-full", absolute))
    if deploy.on_inconclusive == "hold":
        warnings.append("on_inconclusive=hold: an undecided step ends Inconclusive and Argo pauses the rollout "
                        "until `kubectl argo rollouts promote` or `abort`")
    return docs


def router_weight_template(name: str, deploy: DeployConfig) -> dict:
    """`<name>-router-weight`: one POST of the step's weight to the router's /admin/weight, with the admin key
    from the Secret (an Argo arg read from it, never a literal), passing when the router answers that weight.
    A refused or unreachable router is an Error measurement; past Argo's consecutiveErrorLimit the rollout aborts."""
    k = deploy.kubernetes
    url = f"http://{name}.{k.namespace}.svc/admin/weight"  # the Service in front of the router (router_manifests.py)
    metric = {"name": "router-weight", "count": 1, "successCondition": "result == {{args.weight}}",
              "provider": {"web": {"method": "POST", "url": url, "timeoutSeconds": 10, "jsonPath": "{$.weight}",
                                   "headers": [{"key": "Authorization", "value": "Bearer {{args.admin-key}}"},
                                               {"key": "Content-Type", "value": "application/json"}],
                                   "body": '{"weight": {{args.weight}}}'}}}
    args = [{"name": "weight"},
            {"name": "admin-key", "valueFrom": {"secretKeyRef": {"name": secret_name(name, k), "key": ADMIN_KEY}}}]
    return {"apiVersion": ARGO, "kind": "AnalysisTemplate",
            "metadata": {"name": f"{name}-router-weight", "namespace": k.namespace, "labels": {"app": name}},
            "spec": {"args": args, "metrics": [metric]}}
