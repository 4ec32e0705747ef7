"""The run's report (verdict first, then each check with its evidence) and its registry version.

Markdown for terminals, pull requests and the GitHub job summary; a self-contained HTML page of
the same content; both logged to the parent MLflow run. The candidate becomes a registered model
version with alias `challenger`, tagged with the verdict, each check and the lineage.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

from kiln.pipeline.files import atomic_write_json, atomic_write_text
from kiln.pipeline.gate.base import CheckResult, Evidence, Verdict
from kiln.pipeline.gate.policy import GateOutcome
from kiln.pipeline.metrics import METRICS

ICON = {Verdict.SUCCESSFUL: "✅", Verdict.FAILED: "❌", Verdict.INCONCLUSIVE: "⚠️", Verdict.ERROR: "💥"}


def _fmt(v: float | None) -> str:
    if v is None:
        return "—"
    return f"{v:.4g}" if abs(v) < 1e6 else f"{v:.3e}"


def check_rows(results: list[CheckResult]) -> list[list[str]]:
    rows = []
    for r in results:
        ci = f"[{_fmt(r.ci[0])}, {_fmt(r.ci[1])}]" if r.ci else "—"
        rows.append([f"{ICON[r.verdict]} {r.verdict.value}", r.name, _fmt(r.observed), _fmt(r.baseline),
                     r.threshold, ci, r.reason + (f" (≈{r.items_needed} items would decide it)" if r.items_needed else "")])
    return rows


CHECK_HEADER = ["verdict", "check", "candidate", "baseline", "threshold", "interval", "evidence"]


def markdown(name: str, outcome: GateOutcome, evidence: dict[str, Evidence], links: dict[str, str]) -> str:
    lines = [f"# kiln: {name} — {ICON[outcome.verdict]} {outcome.verdict.value}", "",
             f"Rule: {outcome.rule}. Exit code {int(outcome.exit_code)}.", "", "## Checks", "",
             _md_table(CHECK_HEADER, check_rows(outcome.results)), "", "## Metrics", ""]
    names = sorted(set(evidence["baseline"].metrics) | set(evidence["candidate"].metrics))
    rows = [[n, _fmt(evidence["baseline"].metrics.get(n)), _fmt(evidence["candidate"].metrics.get(n)),
             METRICS[n].unit if n in METRICS else ""] for n in names]
    lines += [_md_table(["metric", "baseline", "candidate", "unit"], rows), ""]
    if links:
        lines += ["## Links", ""] + [f"- {k}: {v}" for k, v in links.items()] + [""]
    return "\n".join(lines)


def _md_table(header: list[str], rows: list[list[str]]) -> str:
    esc = [[c.replace("|", "\\|") for c in row] for row in rows]
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in esc])


def html_page(md_title: str, outcome: GateOutcome, evidence: dict[str, Evidence]) -> str:
    def table(header: list[str], rows: list[list[str]]) -> str:
        head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows)
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"

    names = sorted(set(evidence["baseline"].metrics) | set(evidence["candidate"].metrics))
    metric_rows = [[n, _fmt(evidence["baseline"].metrics.get(n)), _fmt(evidence["candidate"].metrics.get(n))] for n in names]
    color = {"Successful": "#1a7f37", "Failed": "#cf222e"}.get(outcome.verdict.value, "#9a6700")
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>{html.escape(md_title)}</title>
<style>body{{font-family:system-ui,sans-serif;margin:2em;max-width:1100px}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:4px 8px;text-align:left}}.v{{color:{color}}}</style></head><body>
<h1>{html.escape(md_title)}: <span class="v">{outcome.verdict.value}</span></h1>
<p>Rule: {html.escape(outcome.rule)}. Exit code {int(outcome.exit_code)}.</p>
<h2>Checks</h2>{table(CHECK_HEADER, check_rows(outcome.results))}
<h2>Metrics</h2>{table(["metric", "baseline", "candidate"], metric_rows)}
</body></html>"""


def register(ctx: Any, outcome: GateOutcome, artifact_path: Path, artifact_sha: str) -> dict[str, Any]:
    """Register the candidate as a model version with alias `challenger`."""
    client = ctx.tracker.client
    name = ctx.recipe.tracking.registered_model or ctx.recipe.name
    from mlflow.exceptions import MlflowException

    try:
        client.create_registered_model(name)
    except MlflowException:
        pass  # already exists
    tags = {"kiln.verdict": outcome.verdict.value, "kiln.recipe_hash": ctx.recipe.digest(),
            "kiln.artifact_sha256": artifact_sha, "kiln.run_dir": str(ctx.run_dir.resolve()),
            **{f"kiln.check.{r.name}": r.verdict.value for r in outcome.results}}
    mv = client.create_model_version(name, source=str(Path(artifact_path).resolve()), run_id=ctx.parent_run, tags=tags)
    client.set_registered_model_alias(name, "challenger", mv.version)
    return {"name": name, "version": mv.version, "alias": "challenger"}


def publish(ctx: Any, outcome: GateOutcome, evidence: dict[str, Evidence], artifact: Any) -> Path:
    version = register(ctx, outcome, artifact.path, artifact.manifest.get("sha256", ""))
    links = {"registered model": f"{version['name']} v{version['version']} (alias {version['alias']})"}
    if url := ctx.tracker.run_url(ctx.parent_run):
        links["MLflow run"] = url
    md = markdown(ctx.recipe.name, outcome, evidence, links)
    atomic_write_text(ctx.run_dir / "report.md", md)
    atomic_write_text(ctx.run_dir / "report.html", html_page(f"kiln: {ctx.recipe.name}", outcome, evidence))
    atomic_write_json(ctx.run_dir / "registry.json", version)
    for f in ("report.md", "report.html", "verdict.json", "registry.json"):
        ctx.tracker.log_artifacts(ctx.parent_run, ctx.run_dir / f)
    ctx.tracker.log(ctx.parent_run, tags={"kiln.registered_version": f"{version['name']}/{version['version']}"})
    return ctx.run_dir / "report.md"
