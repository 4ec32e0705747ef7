"""Argo Rollouts' own rules for an AnalysisRun, checked before a manifest reaches a cluster.

Argo validates every AnalysisRun it creates from a Rollout's analysis reference; an invalid spec
puts the run in Error, which aborts the rollout. The schema check (tests/deploy/k8s_schema) cannot
see these rules: they are Go code. Each one here says where it lives in argoproj/argo-rollouts:

- utils/analysis/factory.go `ValidateMetrics`: at least one metric; metric names unique;
  `ValidateMetric` per metric: consecutiveSuccessLimit >= 0, failureLimit >= -1, not both
  disabled (0 and -1), inconclusiveLimit >= 0, consecutiveErrorLimit >= 0; when count > 0:
  count >= failureLimit + consecutiveSuccessLimit if both >= 0, count >= consecutiveSuccessLimit
  if failureLimit < 0, count >= inconclusiveLimit; interval required when count > 1; interval and
  initialDelay parse as Go durations; exactly one provider.
- utils/analysis/helpers.go `NewAnalysisRunFromTemplates`: templates referenced together have no
  metric name in common (`flattenMetrics`); every template arg without a value is supplied by the
  Rollout's reference (`MergeArgs` / `ResolveArgs`: "args.X was not resolved").
- utils/analysis/factory.go `ResolveMetricArgs` (utils/template `resolve`): every `{{...}}` in a
  metric names a known arg ("failed to resolve {{X}}"); Argo validates the resolved metric.
- pkg/apis/rollouts/validation/validation_references.go `ValidateAnalysisTemplateWithType`: a
  step (not background) analysis metric must end: an interval with no count runs indefinitely.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

# Go's time.ParseDuration: a sequence of decimal numbers with units, optionally signed, or "0".
_GO_DURATION = re.compile(r"[-+]?(0|((\d+(\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h))+)")
_TAG = re.compile(r"\{\{(.*?)\}\}")
PROVIDERS = ("prometheus", "job", "web", "wavefront", "kayenta", "datadog", "newRelic", "cloudWatch",
             "graphite", "influxdb", "skywalking")


@dataclass(frozen=True)
class Violation:
    template: str
    metric: str | None
    fields: tuple[str, ...]  # the Argo fields at fault, e.g. ("count", "consecutiveSuccessLimit")
    message: str  # Argo's own wording

    def __str__(self) -> str:
        where = f"AnalysisTemplate {self.template}" + (f" metric {self.metric}" if self.metric else "")
        return f"{where}: {self.message}"


def _int(value: Any) -> int:
    """intstr.IntValue(): an int, or a string Atoi parses, else 0."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    try:
        return int(str(value))
    except ValueError:
        return 0


def validate_metric(m: dict) -> tuple[tuple[str, ...], str] | None:
    """ValidateMetric: the first rule one metric breaks, as (fields, Argo's message), or None."""
    count, fl = _int(m.get("count", 0)), _int(m.get("failureLimit", 0))
    csl, il = _int(m.get("consecutiveSuccessLimit", 0)), _int(m.get("inconclusiveLimit", 0))
    if csl < 0:
        return ("consecutiveSuccessLimit",), "consecutiveSuccessLimit must be >= 0"
    if fl < -1:
        return ("failureLimit",), "failureLimit must be >= 0, or -1 to be disabled"
    if csl == 0 and fl == -1:
        return ("failureLimit", "consecutiveSuccessLimit"), "failureLimit and consecutiveSuccessLimit cannot both be disabled"
    if il < 0:
        return ("inconclusiveLimit",), "inconclusiveLimit must be >= 0"
    if "consecutiveErrorLimit" in m and _int(m["consecutiveErrorLimit"]) < 0:
        return ("consecutiveErrorLimit",), "consecutiveErrorLimit must be >= 0"
    if count > 0:
        if fl >= 0 and count < fl + csl:
            return (("count", "failureLimit", "consecutiveSuccessLimit"),
                    f"count ({count}) must be >= failureLimit + consecutiveSuccessLimit ({fl} + {csl}) if both >= 0")
        if fl < 0 and count < csl:
            return ("count", "consecutiveSuccessLimit"), "count must be >= consecutiveSuccessLimit"
        if count < il:
            return ("count", "inconclusiveLimit"), "count must be >= inconclusiveLimit"
    if count > 1 and not m.get("interval"):
        return ("interval",), "interval must be specified when count > 1"
    for key, what in (("interval", "interval"), ("initialDelay", "startDelay")):
        if m.get(key) and not _GO_DURATION.fullmatch(str(m[key])):
            return (key,), f"invalid {what} string: time: invalid duration {m[key]!r}"
    provider = m.get("provider") or {}
    n = sum(provider.get(p) is not None for p in PROVIDERS) + len(provider.get("plugin") or {})
    if n != 1:
        return ("provider",), "no provider specified" if n == 0 else "multiple providers specified"
    return None


def validate_metrics(template: str, metrics: list[dict]) -> list[Violation]:
    """ValidateMetrics, which stops at the first problem; this reports one per metric."""
    if not metrics:
        return [Violation(template, None, ("metrics",), "no metrics specified")]
    out, seen = [], set()
    for i, m in enumerate(metrics):
        name = m.get("name")
        if name in seen:
            out.append(Violation(template, name, ("name",), f"metrics[{i}]: duplicate name '{name}'"))
        seen.add(name)
        broken = validate_metric(m)
        if broken:
            out.append(Violation(template, name, broken[0], f"metrics[{i}]: {broken[1]}"))
    return out


def substitute(value: Any, args: dict[str, str]) -> tuple[Any, list[str]]:
    """Replace `{{args.X}}` everywhere in value, as Argo does before it validates or queries.
    Returns the result and the tags no arg resolves."""
    missing: list[str] = []

    def one(s: str) -> str:
        def tag(match: re.Match) -> str:
            key = match.group(1).strip()
            if key.startswith("args.") and key[5:] in args:
                return args[key[5:]]
            missing.append(match.group(1))
            return ""
        return _TAG.sub(tag, s)

    def walk(v: Any) -> Any:
        if isinstance(v, str):
            return one(v)
        if isinstance(v, dict):
            return {k: walk(x) for k, x in v.items()}
        if isinstance(v, list):
            return [walk(x) for x in v]
        return v

    return walk(value), missing


def validate_run(templates: list[dict], ref_args: list[dict], background: bool) -> list[Violation]:
    """One AnalysisRun as Argo builds it from a Rollout's reference to `templates` with `ref_args`."""
    label = "+".join(t["metadata"]["name"] for t in templates)
    out: list[Violation] = []
    metrics = [m for t in templates for m in t["spec"].get("metrics", [])]
    names = [m.get("name") for m in metrics]
    out += [Violation(label, n, ("name",), f"two metrics have the same name '{n}'")
            for n in sorted({n for n in names if names.count(n) > 1}) if len(templates) > 1]
    if out:  # FlattenTemplates failed: Argo creates no run
        return out
    declared = [a for t in templates for a in t["spec"].get("args", [])]
    values = {a["name"]: str(a["value"]) for a in declared if "value" in a}
    # A template's own valueFrom (a Secret's key): Argo reads it when it creates the run (ResolveArgs).
    values |= {a["name"]: "secret-value" for a in declared if "valueFrom" in a and a["name"] not in values}
    for arg in ref_args:  # MergeArgs ignores an arg the templates do not declare
        if any(a["name"] == arg["name"] for a in declared):  # valueFrom: Argo reads it from the Rollout
            values[arg["name"]] = str(arg.get("value", "dummy-value"))
    unresolved = [Violation(label, None, ("args",), f"args.{a['name']} was not resolved")
                  for a in declared if a["name"] not in values and "valueFrom" not in a]
    if unresolved:  # Argo creates no run past MergeArgs
        return out + unresolved
    resolved = []
    for m in metrics:
        r, missing = substitute(m, values)
        out += [Violation(label, m.get("name"), ("args",), f"failed to resolve {{{{{tag}}}}}") for tag in missing]
        resolved.append(r)
    out += validate_metrics(label, resolved)
    if not background:
        out += [Violation(label, m.get("name"), ("count",),
                          f"metric {m.get('name')} runs indefinitely. Invalid value for count: {m.get('count')}")
                for m in resolved if _int(m.get("count", 0)) == 0 and m.get("interval")]
    return out


def validate_rollout(docs: list[dict]) -> list[Violation]:
    """Every AnalysisRun the Rollouts in `docs` would create: the background analysis and each step's."""
    templates = {d["metadata"]["name"]: d for d in docs if d.get("kind") == "AnalysisTemplate"}
    out: list[Violation] = []
    for rollout in (d for d in docs if d.get("kind") == "Rollout"):
        canary = rollout["spec"].get("strategy", {}).get("canary", {})
        refs = [(canary["analysis"], True)] if canary.get("analysis") else []
        refs += [(s["analysis"], False) for s in canary.get("steps", []) if "analysis" in s]
        for ref, background in refs:
            names = [t["templateName"] for t in ref.get("templates", [])]
            absent = [n for n in names if n not in templates]
            out += [Violation(n, None, ("templateName",), f"AnalysisTemplate '{n}' not found") for n in absent]
            if not absent:
                out += validate_run([templates[n] for n in names], ref.get("args", []), background)
    return list(dict.fromkeys(out))  # a template used by several steps is reported once
