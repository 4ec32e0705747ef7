"""The run's report (verdict first, then each check with its evidence) and its registry version.

After the checks: every quality metric both arms scored item by item, gated or not (difference,
interval, p-value and test, also in comparisons.json); the plots (quality deltas with intervals and
margins; with a load stage, the latency curves with the knee and the decode ceiling vs measured),
the knee and roofline tables, memory and cost, every metric, and the lineage from recipe to
registry version with each step's content key and MLflow run. Markdown for terminals, pull
requests and the GitHub job summary (plots named by their path under the run dir); a
self-contained HTML page of the same content (plots embedded); both logged to the parent MLflow
run. The candidate becomes a registered model version (alias `challenger` when the run passed), tagged with the
verdict, each check and the lineage (`kiln.pipeline.tracking.registry`).

`publish` gathers all of it once (`RunReport`) and hands it to each registered writer in turn: JSON, Markdown,
HTML, then MLflow (which logs every file the others wrote) and the registry, whose tags are set last. Another
output of every run is one function registered with `@writer(name)`.
"""

from __future__ import annotations

import html
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import Any

from kiln.evaluate.capacity import cost_per_million
from kiln.core.errors import BadInput
from kiln.core.files import atomic_write_json, atomic_write_text, read_json
from kiln.core.gate.base import CheckResult, Evidence, Verdict
from kiln.core.gate.policy import GateOutcome
from kiln.core.metrics import COST_PER_1M, COST_PER_1M_B1, delta_figure, interval_figures, ratio_figure
from kiln.core.metrics import METRICS
from kiln.core.registry import did_you_mean
from kiln.core.units import DEFAULT_CURRENCY, amount, check_figures, money, number, ratio
from kiln.core.verdict import percent

ICON = {Verdict.SUCCESSFUL: "✅", Verdict.FAILED: "❌", Verdict.INCONCLUSIVE: "⚠️", Verdict.ERROR: "💥"}


def _fmt(v: float | None) -> str:
    """A figure whose unit the column's header names."""
    return "—" if v is None else number(v)


def check_rows(results: list[CheckResult]) -> list[list[str]]:
    """One row per check, its interval in its threshold's terms: a quality check's is the drop's
    (positive is worse), the others' of the value or ratio the threshold names."""
    rows = []
    for r in results:
        observed, baseline, ci = check_figures(r.to_dict())  # each in its unit: 7.32x, 96.1%, 101.9 MB
        rows.append([f"{ICON[r.verdict]} {r.verdict.value}", r.name, observed, baseline,
                     r.threshold, ci, r.reason])  # an undecided reason already says how many items would decide it
    return rows


CHECK_HEADER = ["verdict", "check", "candidate", "baseline", "threshold", "interval", "evidence"]
COMPARISON_HEADER = ["metric", "baseline", "candidate", "difference", "interval", "p-value", "test"]


def comparison_rows(comparisons: list[Any]) -> list[list[str]]:
    """Every paired quality metric, gated or not: difference = candidate - baseline (relative: / baseline - 1)."""
    def diff(c: Any, v: float) -> str:  # a fraction's difference in percentage points, beside its percentages
        if c.relative:
            return f"{v:+.2%}"
        return f"{100 * v:+.3g} pp" if c.metric in METRICS and METRICS[c.metric].unit == "fraction" else f"{v:+.4g}"

    return [[c.metric, amount(c.metric, c.baseline), amount(c.metric, c.candidate), diff(c, c.difference),
             f"[{diff(c, c.ci_low)}, {diff(c, c.ci_high)}] at {percent(c.confidence)}", _p_value(c.p_value),
             f"{c.method}, n={c.n}"] for c in comparisons]


def _p_value(p: float) -> str:
    return "< 0.0001" if p < 1e-4 else f"{p:.3g}"  # never 1.2e-05


MEMORY_COST = {"size_bytes": "artifact size on disk (what optimize wrote)",
               "peak_rss_bytes": "peak RSS while optimizing (not serving)",
               "load_cost_per_1m_output_tokens": "cost per 1M output tokens (load sweep)"}
Table = tuple[str, list[str], list[list[str]]]  # section title, header, rows


@dataclass
class Sections:
    """What the report shows beside the checks and metrics; every part optional."""

    plots: dict[str, Path] = field(default_factory=dict)  # title -> PNG under the run dir
    search: dict[str, Any] | None = None  # search_record(): the winner and one row per candidate
    load: dict[str, Any] | None = None  # the load stage's result
    lineage: list[dict[str, str]] = field(default_factory=list)
    comparisons: list[Any] = field(default_factory=list)  # kiln.core.stats.Comparison, one per paired metric
    serving: dict[str, float] = field(default_factory=dict)  # role -> bytes the engine serves from (engine_bytes)
    warnings: list[str] = field(default_factory=list)  # shown under the verdict: a contention guard off or blind
    currency: str = DEFAULT_CURRENCY  # the recipe's: every cost is shown in it


def tables(outcome: GateOutcome, evidence: dict[str, Evidence], sections: Sections) -> list[Table]:
    """The report's tables in reading order after the verdict and the plots (empty ones left out)."""
    base, cand = evidence["baseline"].metrics, evidence["candidate"].metrics
    names = sorted(set(base) | set(cand))
    cur = sections.currency
    metric_rows = [[n, amount(n, base.get(n), cur), amount(n, cand.get(n), cur)] for n in names]  # each with its unit
    memory = [[MEMORY_COST[n], amount(n, base.get(n), cur), amount(n, cand.get(n), cur),
               ratio(cand[n] / base[n]) if base.get(n) and n in cand else "—"] for n in MEMORY_COST if n in names]
    if len(served := sections.serving) == 2:  # the artifact is not what OpenVINO, CTranslate2 or llama.cpp load
        memory.insert(1, ["size served from (engine folder, or the artifact it loads)",
                          amount("size_bytes", served["baseline"]), amount("size_bytes", served["candidate"]),
                          ratio(served["candidate"] / served["baseline"]) if served["baseline"] else "—"])
    out: list[Table] = _search_tables(sections.search) if sections.search else []
    out += [("Checks", CHECK_HEADER, check_rows(outcome.results)),
                        ("Quality, paired item by item", COMPARISON_HEADER, comparison_rows(sections.comparisons))]
    out += _load_tables(sections.load or {"per_role": {}})
    out += [("Memory and cost", ["figure", "baseline", "candidate", "candidate / baseline"], memory),
            ("Metrics", ["metric", "baseline", "candidate"], metric_rows),
            ("Lineage", ["step", "key", "MLflow run", "detail"],
             [[r["step"], r["key"], r["mlflow_run"], r["detail"]] for r in sections.lineage])]
    return [t for t in out if t[2]]


SEARCH_HEADER = ["candidate", "engine", "optimize", "verdict", "speed-up [CI]", "perplexity change [CI]",
                 "decode tok/s (b1)", "cost / 1M tokens (b1)", "serving size", "why"]


def _speedup(fig: dict[str, float] | None) -> str:
    return "—" if not fig else f"{fig['ratio']:.2f}x [{fig['low']:.2f}, {fig['high']:.2f}]"


def _search_tables(record: dict[str, Any]) -> list[Table]:
    """The winner and why, then every candidate: how it did and where it stopped."""
    rows, cur = [], record.get("currency", DEFAULT_CURRENCY)  # a search.json from before `currency`: dollars
    for c in record["candidates"]:
        ppl = c["perplexity"]
        rows.append([("🏆 " if c["name"] == record["winner"] else "") + c["name"], c["engine"], c["optimize"],
                     c["verdict"] or "—", _speedup(c["confirmed"] or c["screened"]) + (" (confirmed)" if c["confirmed"] else ""),
                     "—" if not ppl else f"{ppl['change']:+.2%} [{ppl['low']:+.2%}, {ppl['high']:+.2%}]",
                     _fmt(c.get("decode_tok_s")) + (f" ({c['contention']})" if c.get("contention") else "")
                     + _measured_on(c.get("nodes")),
                     money(c.get("cost_per_1m"), cur), amount("size_bytes", c["serving_bytes"]),
                     c["eliminated"] or ("winner" if c["name"] == record["winner"] else "passed every check")
                     + _runoff(c.get("runoff"))])
    summary = [["winner", record["winner"] or "none: no candidate passed every check"], ["why", record["why"]],
               ["statistics", record["statistics"]]]
    if duel := record.get("versus_champion"):
        summary.insert(2, ["against the champion", f"{duel['verdict']}: {duel['reason']}"])
    if (base := record.get("baseline")) and base.get("decode_tok_s"):
        summary.append(["baseline", f"{base['engine']}: {amount('decode_tok_s', base['decode_tok_s'])} at batch 1"
                                    + (f", {money(base['cost_per_1m'], cur)} per 1M output tokens at "
                                       f"{money(record['price_per_hour'], cur)} per machine-hour"
                                       if base.get("cost_per_1m") else "")])
    at = f" at {percent(record['confidence'])}"  # the intervals are at the confidence the verdicts were taken at
    header = [h.replace("[CI]", f"[CI{at}]") for h in SEARCH_HEADER]
    return [("Search", ["what", "result"], summary), ("Candidates", header, rows)]


def _runoff(fig: dict[str, Any] | None) -> str:
    """A candidate's runoff against the leader it met (kiln.pipeline.search.search._runoff), paired at one moment."""
    if not fig:
        return ""
    return f"; against {fig['against']} at one moment {_speedup(fig)} ({_told(fig)})"


def _told(fig: dict[str, Any]) -> str:
    """A paired ratio's reading: shown faster or slower only where its interval leaves 1 out."""
    return "faster" if fig["low"] > 1 else "slower" if fig["high"] < 1 else "not told apart"


def _measured_on(nodes: dict[str, str] | None) -> str:
    """Under a Ray executor, the node the decode figure came from (the confirmation's, else the screening's)."""
    node = (nodes or {}).get("confirmation") or (nodes or {}).get("benchmark")
    return f" on {node}" if node else ""


def search_record(arms: list[Any], winner: Any, policy: Any) -> dict[str, Any]:
    """search.json: what the report's search tables and the Pareto plot are drawn from."""
    from kiln.pipeline.provenance.evidence import evidence_from_run
    from kiln.core.gate.performance import contention

    objective = arms[0].ctx.recipe.search.objective
    price = arms[0].ctx.recipe.search.price_per_hour
    rows, base_tok_s = [], []
    for arm in arms:
        ppl, tok_s, busy = None, None, None
        evidence = evidence_from_run(arm.ctx.run_dir) if arm.engines else {}
        if (arm.ctx.run_dir / "stages" / "quality-candidate.json").exists():
            found = [c for c in comparisons(evidence, policy.confidence) if c.metric == "perplexity"]
            if found:
                ppl = {"change": found[0].difference, "low": found[0].ci_low, "high": found[0].ci_high}
        if evidence and "decode_tok_s" in evidence["candidate"].metrics:  # the confirmation's, where there is one
            tok_s = evidence["candidate"].metrics["decode_tok_s"]
            busy = contention(evidence["candidate"].metrics)
            base_tok_s += evidence["baseline"].repeats.get("decode_tok_s", [])
        rows.append({"name": arm.name, "engine": _serving(arm.ctx.recipe.engine, arm.ctx.recipe.optimize), "optimize": arm.ctx.recipe.optimize.method,
                     "verdict": arm.outcome.verdict.value if arm.outcome else None, "eliminated": arm.eliminated,
                     "reached": arm.reached, "screened": arm.screened, "confirmed": arm.confirmed, "runoff": arm.runoff,
                     "perplexity": ppl, "decode_tok_s": tok_s, "contention": busy, "cost_per_1m": cost_per_million(price, tok_s),
                     "serving_bytes": serving_bytes(arm), "nodes": arm.nodes})
    base_rate = median(base_tok_s) if base_tok_s else None  # over every benchmark it ran in
    baseline = {"engine": _serving(arms[0].ctx.recipe.engine_for("baseline")), "decode_tok_s": base_rate,
                "cost_per_1m": cost_per_million(price, base_rate)}
    won = winner is not None and winner.eliminated is None
    best = winner.confirmed or winner.screened if won else None
    why = (f"the fastest on {objective} among the candidates that passed every check: {_speedup(best)} over the "
           "baseline" + _picked_over(arms, winner)
           + (", measured again on held-out prompts after it was picked" if winner.confirmed else "")
           + (", and faster than the champion" if winner.versus_champion else "")) if won else \
        "every candidate failed a check, was undecided, ran out of the search budget, or did not beat the champion (see why)"
    statistics = (f"{len(arms)} candidate(s), each check and every interval at {policy.confidence:.2%} confidence "
                  f"(gate.confidence {arms[0].ctx.recipe.gate.confidence:.0%} shared by the candidates, Bonferroni), "
                  "so the chance of promoting any candidate truly past a margin stays at the single-candidate rate")
    duel = winner.versus_champion.to_dict() if winner is not None and winner.versus_champion else None
    return {"objective": objective, "winner": winner.name if won else None, "why": why, "statistics": statistics,
            "versus_champion": duel,
            "confidence": policy.confidence, "price_per_hour": price, "currency": arms[0].ctx.recipe.currency,
            "baseline": baseline, "candidates": rows}


def _picked_over(arms: list[Any], winner: Any) -> str:
    """The runoffs the winner came through: the candidates it was measured beside, at one moment, shown
    slower than it, or not told apart from it (the interval held 1: the winner led at screening)."""
    told = {a.name: _told({"low": 1 / a.runoff["high"], "high": 1 / a.runoff["low"]})  # a rival's figure is
            for a in arms if a is not winner and a.runoff and a.runoff["against"] == winner.name}  # rival/winner
    if winner.runoff:
        told[winner.runoff["against"]] = _told(winner.runoff)
    faster = sorted(n for n, t in told.items() if t == "faster")
    tied = sorted(n for n, t in told.items() if t != "faster")
    return ((f", and faster than {', '.join(faster)} measured beside it at one moment (runoff)" if faster else "")
            + (f", and not told apart from {', '.join(tied)} measured beside it at one moment (runoff), kept as the "
               "leader at screening" if tied else ""))


def _serving(cfg: Any, optimize: Any = None) -> str:
    """The backend and what it computes in: a GGUF artifact's own type (llama_cpp's `precision`
    applies only to a checkpoint it converts), else the engine's dtype, weights or quantization."""
    if getattr(optimize, "method", None) == "gguf":
        return f"{cfg.backend} {optimize.type}"
    keys = ("dtype", "weights", "quantization", "precision")
    precision = next((str(v) for k in keys if (v := getattr(cfg, k, None))), "")
    return f"{cfg.backend} {precision}".strip()


def serving_bytes(arm: Any) -> float | None:
    """What the candidate serves from on disk (see `engine_bytes`)."""
    if not arm.engines:
        return None
    return engine_bytes(arm.engines["candidate"], arm.artifact.manifest.get("size_bytes") if arm.artifact else None)


def engine_bytes(engine_dir: Path, artifact_bytes: float | None) -> float | None:
    """What an engine serves from on disk: its folder when it holds converted weights (OpenVINO,
    CTranslate2, GGUF), else the artifact it loads (torch: the folder holds a manifest only)."""
    from kiln.core.files import dir_size

    size = dir_size(engine_dir)
    return size if size > 1 << 20 or artifact_bytes is None else artifact_bytes


def _load_tables(load: dict[str, Any]) -> list[Table]:
    """The sweep's knee per arm, and the roofline's ceiling beside the measured TPOT (MBU)."""
    arms = load["per_role"]
    knees = [[role, _fmt(part["knee"]["rate"]) if part["knee"] else "none", part["headline"],
              part["knee"]["reason"] if part["knee"] else _no_knee(part["stages"]), _paced(part["stages"])]
             for role, part in arms.items()]
    ceiling = [[role, str(r["batch"]), _fmt(r["tokens_per_s_per_user"]), _fmt(r["step_ms"]),
                _fmt(r["measured_tpot_ms"]), f"{r['mbu']:.0%}" if r["mbu"] else "—"]
               for role, part in arms.items() for r in part["roofline"]]
    bandwidth = f" at {load['bandwidth_gb_s']:.1f} GB/s measured" if "bandwidth_gb_s" in load else ""
    return [("Knee (highest rate before TTFT climbs)", ["arm", "knee (req/s)", "headline stage", "why", "who set the pace"],
             knees),
            (f"Decode ceiling vs measured (roofline{bandwidth})",
             ["arm", "batch", "ceiling tok/s per user", "ceiling step (ms)", "measured TPOT p50 (ms)", "MBU"], ceiling),
            *_prefix_table(arms)]


def _prefix_table(arms: dict[str, Any]) -> list[Table]:
    """The prefix-sharing workload (evaluate.load.prefix): TTFT without and with the prompt cache, the
    drop, and the share of prompt tokens the server served from its cache (medians over repeats)."""
    from kiln.evaluate.perf.prefix import (CACHED_TTFT, HIT_RATE, ROUND_ROBIN_HIT_RATE, ROUTED_HIT_RATE, TTFT_DROP,
                                           UNCACHED_TTFT)

    def rate(m: dict[str, Any], name: str) -> str:
        return f"{m[name]:.0%}" if name in m else "not reported by the engine"

    rows, routed = [], []
    for role, part in arms.items():
        if not (p := part.get("prefix")):
            continue
        m = p["metrics"]
        rows.append([role, f"{p['system_tokens']} + {p['user_tokens']}", str(p["prefixes"]), str(p["concurrency"]),
                     _fmt(m.get(UNCACHED_TTFT)), _fmt(m.get(CACHED_TTFT)),
                     f"{m[TTFT_DROP]:.0%}" if TTFT_DROP in m else "—", rate(m, HIT_RATE)])
        if "router" in p:
            routed.append([role, rate(p["router"]["metrics"], ROUTED_HIT_RATE),
                           rate(p["router"]["metrics"], ROUND_ROBIN_HIT_RATE)])
    header = ["arm", "prompt (system + user tokens)", "system prompts", "users", "TTFT p50 without cache (ms)",
              "TTFT p50 with cache (ms)", "TTFT drop", "cache hit rate"]
    tables = [("Prefix cache (shared system prompt, distinct user turns)", header, rows)] if rows else []
    if routed:
        tables.append(("Prefix cache behind kiln route, two replicas", ["arm", "hit rate placed by prefix",
                                                                        "hit rate round-robin"], routed))
    return tables


def _paced(stages: list[dict[str, Any]]) -> str:
    """Which open-loop stages the server limited (in flight grew, sends on time) and which the
    load generator did (it sent late: those say nothing about the server and rank nothing)."""
    by = {who: [s["label"] for s in stages if s.get("limited_by") == who] for who in ("server", "client")}
    parts = [f"{who}-limited: {', '.join(labels)}" for who, labels in by.items() if labels]
    return "; ".join(parts) or "neither: sends on time, the server kept up"


def _no_knee(stages: list[dict[str, Any]]) -> str:
    """Why a sweep found no knee, in its own numbers."""
    open_loop = sorted((s for s in stages if s["target_rate"]), key=lambda s: s["target_rate"])
    unloaded = [s["ttft_ms"]["p50"] for s in stages if s["concurrency"] == 1]
    if len(open_loop) < 2 or not unloaded:
        return "fewer than two open-loop rates, or no one-user stage to compare with"
    low = open_loop[0]
    return (f"even the lowest rate, {low['target_rate']:.3g}/s, queued: TTFT p50 {low['ttft_ms']['p50']:.0f} ms "
            f"against {min(unloaded):.0f} ms for one user")


def markdown(name: str, outcome: GateOutcome, evidence: dict[str, Evidence], links: dict[str, str],
             sections: Sections | None = None) -> str:
    sections = sections or Sections()
    lines = [f"# kiln: {name} — {ICON[outcome.verdict]} {outcome.verdict.value}", "",
             *([f"**{outcome.summary}.**", ""] if outcome.summary else []),
             f"Rule: {outcome.rule}. Exit code {int(outcome.exit_code)}.", "",
             *[line for w in sections.warnings for line in (f"> ⚠️ {w}.", "")]]
    for i, (title, header, rows) in enumerate(tables(outcome, evidence, sections)):
        lines += [f"## {title}", "", _md_table(header, rows), ""]
        if i == 0 and sections.plots:  # the plots follow the checks
            lines += ["## Plots", ""] + [f"- {t}: `plots/{p.name}`" for t, p in sections.plots.items()] + [""]
    if links:
        lines += ["## Links", ""] + [f"- {k}: {v}" for k, v in links.items()] + [""]
    return "\n".join(lines)


def _md_table(header: list[str], rows: list[list[str]]) -> str:
    esc = [[c.replace("|", "\\|") for c in row] for row in rows]
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in esc])


def html_page(md_title: str, outcome: GateOutcome, evidence: dict[str, Evidence],
              sections: Sections | None = None) -> str:
    """The same content as the Markdown, one self-contained file: the plots are embedded."""
    from kiln.pipeline.report.plots import embedded

    def table(header: list[str], rows: list[list[str]]) -> str:
        head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows)
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"

    sections = sections or Sections()
    parts = []
    for i, (title, header, rows) in enumerate(tables(outcome, evidence, sections)):
        parts.append(f"<h2>{html.escape(title)}</h2>{table(header, rows)}")
        if i == 0 and sections.plots:
            parts.append("<h2>Plots</h2>" + "".join(embedded(t, p) for t, p in sections.plots.items()))
    color = {"Successful": "#1a7f37", "Failed": "#cf222e"}.get(outcome.verdict.value, "#9a6700")
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>{html.escape(md_title)}</title>
<style>body{{font-family:system-ui,sans-serif;margin:2em;max-width:1200px}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:4px 8px;text-align:left}}.v{{color:{color}}}img{{max-width:100%}}
figure{{margin:1em 0}}figcaption{{color:#555;font-size:90%}}</style></head><body>
<h1>{html.escape(md_title)}: <span class="v">{outcome.verdict.value}</span></h1>
<p><strong>{html.escape(outcome.summary)}</strong></p>
<p>Rule: {html.escape(outcome.rule)}. Exit code {int(outcome.exit_code)}.</p>
{"".join(f"<p>⚠️ {html.escape(w)}.</p>" for w in sections.warnings)}
{"".join(parts)}
</body></html>"""


def lineage(ctx: Any, outcome: GateOutcome, version: dict[str, Any]) -> list[dict[str, str]]:
    """recipe -> optimize artifact -> engine -> quality -> benchmark -> verdict -> registry version,
    each step with its content key and its MLflow run, in the order the run made them."""
    steps = [{"step": "recipe", "key": ctx.recipe.digest(), "mlflow_run": ctx.parent_run,
              "detail": str(ctx.recipe_path)}]
    for o in ctx.outcomes.values():
        detail = {"optimize": f"artifact sha256 {o.result.get('manifest', {}).get('sha256', '')}",
                  "engine": str(o.result.get("engine_dir", ""))}.get(o.stage, str(o.path))
        steps.append({"step": f"{o.stage}[{o.role}]", "key": o.key, "mlflow_run": o.mlflow_run, "detail": detail})
    gate_runs = ctx.tracker.client.search_runs(
        [ctx.tracker.experiment_id], f"tags.`mlflow.parentRunId` = '{ctx.parent_run}' and tags.`kiln.stage` = 'gate'",
        max_results=1, order_by=["attributes.start_time DESC"])
    steps.append({"step": "verdict", "key": outcome.verdict.value, "detail": outcome.rule,
                  "mlflow_run": gate_runs[0].info.run_id if gate_runs else ""})
    steps.append({"step": "registry version", "key": f"{version['name']} v{version['version']}",
                  "mlflow_run": ctx.parent_run,
                  "detail": f"alias {version['alias']}" if version["alias"] else "no alias (the run did not pass)"})
    return steps


def comparisons(evidence: dict[str, Evidence], confidence: float) -> list[Any]:
    """Each quality metric both arms have per-item records of, compared paired (perplexity as a
    relative change), at the gate's confidence; a metric whose records do not join is left out."""
    from kiln.core.gate.quality import compare, paired_metrics

    cand, base = evidence["candidate"], evidence["baseline"]
    out = []
    for name in paired_metrics(cand, base):
        try:
            out.append(compare(name, cand, base, confidence, relative=name == "perplexity"))
        except (ValueError, BadInput):  # records that differ: the gate's own check reports it as an Error
            continue
    return out


def serving_tag(ctx: Any) -> dict[str, str]:
    """How the candidate was served, as the registry records it (optimize as written, the engine's
    config as built, tuned knobs included): a later search serves the champion exactly so."""
    import json

    from kiln.engine.loader import read_manifest
    from kiln.pipeline.tracking.registry import SERVING

    engine = ctx.outcomes.get("engine:candidate")
    if engine is None:
        return {}
    serving = {"optimize": ctx.recipe.optimize.model_dump(mode="json"),
               "engine": read_manifest(Path(engine.result["engine_dir"]))["config"]}
    return {SERVING: json.dumps(serving, sort_keys=True)}


@dataclass
class RunReport:
    """What a run's outputs are written from: gathered once by `publish`, handed to every writer."""

    ctx: Any  # the run context: recipe, run dir, tracker, parent MLflow run, stage outcomes
    outcome: GateOutcome
    evidence: dict[str, Evidence]
    sections: Sections
    links: dict[str, str]  # shown under the verdict: the registered version, the signed verdict, the MLflow run
    registered: Any  # the registry version, created incomplete; the `registry` writer completes it
    version: dict[str, Any]  # its record (registry.json)
    signed: dict[str, str]  # the version's tags that say where the signed verdict is
    files: list[str] = field(default_factory=list)  # written so far under the run dir, in order

    @property
    def checks(self) -> dict[str, Any]:
        return gate_checks(self.ctx)


def gate_checks(ctx: Any) -> dict[str, Any]:
    """The recipe's gate checks by label."""
    return {c.label: c for c in ctx.recipe.gate.checks}


Writer = Callable[[RunReport], list[str]]  # writes its output; returns the files it wrote under the run dir
WRITERS: dict[str, Writer] = {}  # name -> writer: the outputs of a run, in the order they are registered
LAST = ("mlflow", "registry")  # after every file: MLflow logs what the others wrote, the registry's tags are set last


def writer(name: str) -> Callable[[Writer], Writer]:
    """Decorator: `@writer("csv")` registers an output of every run (its files are logged to MLflow)."""

    def register(write: Writer) -> Writer:
        if name in WRITERS:
            raise RuntimeError(f"report writer '{name}' registered twice")
        WRITERS[name] = write
        return write

    return register


def resolve(names: Sequence[str] | None = None) -> list[Writer]:
    """The writers named, in that order; by default every registered one, MLflow and the registry last."""
    names = names if names is not None else [*(n for n in WRITERS if n not in LAST), *LAST]
    if unknown := [n for n in names if n not in WRITERS]:
        raise BadInput(f"Unknown report output '{unknown[0]}'.{did_you_mean(unknown[0], list(WRITERS))}")
    return [WRITERS[n] for n in names]


def publish(ctx: Any, outcome: GateOutcome, evidence: dict[str, Evidence], artifact: Any,
            search: tuple[list[Any], Any, Any] | None = None) -> Path:
    """The report, its plots and the registry version: the run's report gathered once, then written by every
    registered writer (`resolve`). `search`: (arms, winner, policy) of a search run."""
    report = gather_report(ctx, outcome, evidence, artifact, search)
    for write in resolve():
        report.files += write(report)
    return ctx.run_dir / "report.md"


def gather_report(ctx: Any, outcome: GateOutcome, evidence: dict[str, Evidence], artifact: Any,
                  search: tuple[list[Any], Any, Any] | None) -> RunReport:
    """The registry version (created, not yet complete), the plots and every section the writers show."""
    from kiln.core.gate.performance import guard_warnings
    from kiln.pipeline.report.plots import gather as gather_plots, pareto

    registered, version, signed, links = _register_and_sign(ctx, outcome, artifact)
    if url := ctx.tracker.run_url(ctx.parent_run):
        links["MLflow run"] = url
    load = ctx.outcomes.get("load:pair")
    sections = Sections(plots=gather_plots(ctx.run_dir, outcome.results, gate_checks(ctx), load.path if load else None),
                        load=load.result if load else None, lineage=lineage(ctx, outcome, version),
                        comparisons=comparisons(evidence, (search[2] if search else ctx.recipe.gate).confidence),
                        serving={role: size for role in ("baseline", "candidate")
                                 if (built := ctx.outcomes.get(f"engine:{role}")) is not None and
                                 (size := engine_bytes(Path(built.result["engine_dir"]),
                                                       evidence[role].metrics.get("size_bytes"))) is not None})
    if search:
        sections.search = search_record(*search)
        if plot := pareto(sections.search, ctx.run_dir / "plots" / "search_pareto.png"):
            sections.plots = {"quality change against speed-up, every candidate": plot, **sections.plots}
    sections.warnings = guard_warnings(ctx.recipe.gate.checks, evidence["candidate"].metrics)
    sections.currency = ctx.recipe.currency
    return RunReport(ctx, outcome, evidence, sections, links, registered, version, signed)


@writer("json")
def write_json(r: RunReport) -> list[str]:
    files = {"comparisons.json": [c.to_dict() for c in r.sections.comparisons], "registry.json": r.version,
             "lineage.json": r.sections.lineage, **({"search.json": r.sections.search} if r.sections.search else {})}
    for name, content in files.items():
        atomic_write_json(r.ctx.run_dir / name, content)
    return list(files)


@writer("markdown")
def write_markdown(r: RunReport) -> list[str]:
    atomic_write_text(r.ctx.run_dir / "report.md", markdown(r.ctx.recipe.name, r.outcome, r.evidence, r.links,
                                                            r.sections))
    return ["report.md"]


@writer("html")
def write_html(r: RunReport) -> list[str]:
    page = html_page(f"kiln: {r.ctx.recipe.name}", r.outcome, r.evidence, r.sections)
    atomic_write_text(r.ctx.run_dir / "report.html", page)
    return ["report.html"]


@writer("mlflow")
def write_mlflow(r: RunReport) -> list[str]:
    """The parent run's artifacts (the verdict the runner wrote, every file written before, the plots), its
    deciding figures and the version it registered."""
    tracker, run = r.ctx.tracker, r.ctx.parent_run
    for f in ("verdict.json", *r.files):
        tracker.log_artifacts(run, r.ctx.run_dir / f)
    if r.sections.plots:
        tracker.log_artifacts(run, r.ctx.run_dir / "plots", "plots")
    tracker.show_figures(run, run_figures(r.outcome.results, r.checks, r.sections, r.evidence))
    tracker.log(run, tags={"kiln.registered_version": f"{r.version['name']}/{r.version['version']}"})
    return []


@writer("registry")
def write_registry(r: RunReport) -> list[str]:
    """The version's verdict, checks, lineage and serving tags, and its alias: it reads as finished from here on."""
    from kiln.pipeline.tracking import registry as model_registry

    # The version links back along the chain in the UI; set last: only a finished run's version reads as finished.
    lineage_tags = {"kiln.lineage." + step["step"].replace("[", ".").rstrip("]"):
                    f"{step['key']} (run {step['mlflow_run']})" for step in r.sections.lineage[:-1]}
    model_registry.complete(r.ctx, r.registered, r.outcome, {**lineage_tags, **serving_tag(r.ctx), **r.signed})
    return []


def run_figures(results: list[CheckResult], checks: dict[str, Any], sections: Sections,
                evidence: dict[str, Evidence]) -> dict[str, float]:
    """The deciding figures as metrics of the parent MLflow run, so that its runs table shows and sorts
    them beside the verdict (names: kiln.core.metrics): each ratio check's candidate / baseline (decode
    tok/s: `speedup`) with its interval, each paired quality metric's change with its interval as the
    report gives it, and each arm's cost per 1M output tokens. A search's are its winner's, judged."""
    figures: dict[str, float] = {}
    for r in results:
        config = checks.get(r.name)
        if r.observed is None or not any(getattr(config, b, None) is not None for b in ("min_ratio", "max_ratio")):
            continue  # an absolute bound, or a check that measured nothing: the gate's child run has it
        name = ratio_figure(r.metric)
        if r.kind == "size" and r.baseline:  # exact sizes: a ratio without an interval
            figures[name] = r.observed / r.baseline
        elif r.ci:  # without one the check measured too little (or on a busy machine) to give a ratio
            figures.update(zip((name, *interval_figures(name)), (r.observed, *r.ci), strict=True))
    for c in sections.comparisons:
        name = delta_figure(c.metric)
        figures.update(zip((name, *interval_figures(name)), (c.difference, c.ci_low, c.ci_high), strict=True))
    for role in ("candidate", "baseline"):
        if (cost := evidence[role].metrics.get("load_cost_per_1m_output_tokens")) is not None:
            figures[f"{COST_PER_1M}.{role}"] = cost
    record = sections.search
    if record and (won := [c for c in record["candidates"] if c["name"] == record["winner"]]):
        costs = {"candidate": won[0].get("cost_per_1m"), "baseline": record["baseline"].get("cost_per_1m")}
        for role, cost in costs.items():
            if cost is not None:  # search.price_per_hour set, and a decode rate measured
                figures[f"{COST_PER_1M_B1}.{role}"] = cost
    return figures


def _register_and_sign(ctx: Any, outcome: GateOutcome, artifact: Any) -> tuple[Any, dict[str, Any], dict[str, str],
                                                                                dict[str, str]]:
    """The registry version (under the policy the run was judged by), the signed verdict, and the report's
    links that say both: (registered, version record, version tags of the attestation, links)."""
    from kiln.pipeline.tracking import registry as model_registry

    judged_under = read_json(ctx.run_dir / "policy.json")  # written by the runner's start_run
    registered = model_registry.register(ctx, artifact, judged_under["sha256"])
    version = registered.to_dict(passed=int(outcome.exit_code) == 0)
    alias = f"alias {version['alias']}" if version["alias"] else "no alias: the run did not pass"
    links = {"registered model": f"{version['name']} v{version['version']} ({alias})"
                                 + (", the same artifact and recipe as before" if registered.reused else "")}
    if warning := model_registry.champion_warning_after(ctx.tracker.client, registered, outcome):
        links["registered model"] += f". ⚠️ {warning}"
    signed = _attest(ctx, outcome, artifact, version, judged_under)
    links["signed verdict"] = (f"attestation.dsse.json, key {signed.pop('key_id')[:12]}, policy "
                               f"{judged_under['sha256'][:12]} (`kiln verify {ctx.run_dir}`)")
    return registered, version, signed, links


def _attest(ctx: Any, outcome: GateOutcome, artifact: Any, version: dict[str, Any],
            judged_under: dict[str, Any]) -> dict[str, str]:
    """The run's signed verdict (kiln.pipeline.provenance.attestation) in the run folder and on the parent run; the
    version's tags that say where it is, and the signing key's id (`key_id`, for the report)."""
    from kiln.core.files import sha256_file
    from kiln.pipeline.provenance import attestation

    engine = ctx.outcomes.get("engine:candidate")
    judged = attestation.Judged(
        outcome=outcome, artifact=Path(artifact.path), engine=Path(engine.result["engine_dir"]) if engine else None,
        registered={"name": version["name"], "version": str(version["version"])},
        policy_sha256=judged_under["sha256"], policy=judged_under["policy"],
        recipe={"name": ctx.recipe.name, "sha256": ctx.recipe.digest()}, mlflow_run=ctx.parent_run)
    envelope = attestation.attest(ctx.run_dir, judged)
    ctx.tracker.log_artifacts(ctx.parent_run, envelope)
    return {attestation.ATTESTATION_RUN: ctx.parent_run, attestation.ATTESTATION_SHA: sha256_file(envelope),
            "key_id": read_json(envelope)["signatures"][0]["keyid"]}
