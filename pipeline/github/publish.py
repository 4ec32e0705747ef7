"""GitHub Actions: report a kiln run the way a pull-request reviewer wants to read it.

Under Actions (GITHUB_ACTIONS=true) `kiln run` ends with `publish(run_dir)`, which
- appends the Markdown report to the job summary ($GITHUB_STEP_SUMMARY);
- sets step outputs ($GITHUB_OUTPUT): verdict, exit-code, run-dir, report, report-html, comment,
  recipe, failed-checks, mlflow-run-url;
- writes `pr-comment.md` into the run dir: the body of the one comment per recipe that the
  workflow keeps updated; its first line `<!-- kiln-report:<recipe> -->` is how it finds it again;
- annotates every check that did not pass on the recipe file, so it shows in the PR's diff.

Secrets never reach any of these: values of secret-like environment variables and credentials
inside URLs become *** before anything is written. `python -m kiln.pipeline.github` adds the
workflow's helpers: `changed-recipes` (the job matrix), `no-verdict` (report a run that ended
before its gate), `add-masks` (hide URL credentials in the job log), `policy-report` (what a pull
request changed in a recipe's policy, and whether that needs an approval).
"""

from __future__ import annotations

import argparse
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from kiln.core.errors import BadInput
from kiln.core.files import atomic_write_text, read_json
from kiln.core.units import check_figures
from kiln.pipeline.github.actions import in_github_actions, output_line  # noqa: F401 - in_github_actions: `kiln run` asks here
from kiln.pipeline.github.changes import add_cli as add_changes_cli

COMMENT_FILE = "pr-comment.md"
MARKER = "<!-- kiln-report:{recipe} -->"
# GitHub refuses comment bodies over 65,536 characters and step summaries over 1 MiB.
COMMENT_LIMIT = 60_000
SUMMARY_LIMIT = 1_000_000
SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSW|API_?KEY|ACCESS_KEY|PRIVATE_KEY|CREDENTIAL|AUTH"
                         r"|CONNECTION_STRING|_PAT$|^MLFLOW_TRACKING_USERNAME$", re.IGNORECASE)
_URL_USERINFO = re.compile(r"(?P<scheme>\b[a-zA-Z][a-zA-Z0-9+.-]*://)[^/\s@]+@")
_SECRET_QUERY = re.compile(r"(?P<key>[?&](?:token|access_token|sig|signature|password|api_key|key)=)[^&\s#]+",
                           re.IGNORECASE)
ICON = {"Successful": "✅", "Failed": "❌", "Inconclusive": "⚠️", "Error": "💥"}
ORDER = {"Failed": 0, "Error": 1, "Inconclusive": 2, "Successful": 3}
EXIT_MEANING = {0: "passed", 1: "gate failed", 2: "bad input", 3: "gate inconclusive", 4: "internal error",
                5: "not verified"}


def redact(text: str, env: Mapping[str, str] = os.environ) -> str:
    """Replace secret env values, URL credentials and secret query parameters with ***."""
    # Short values ("1", "true") would shred ordinary text; no real secret is that short.
    secrets = sorted({v for k, v in env.items() if SECRET_NAME.search(k) and len(v) >= 4}, key=len, reverse=True)
    for value in secrets:
        text = text.replace(value, "***")
    text = _URL_USERINFO.sub(r"\g<scheme>***@", text)
    return _SECRET_QUERY.sub(r"\g<key>***", text)


def mlflow_run_url(mlflow: Mapping[str, Any] | None) -> str | None:
    """`<server>/#/experiments/<id>/runs/<id>` for an http(s) tracking server, credentials dropped."""
    mlflow = mlflow or {}
    parts = urlsplit(str(mlflow.get("tracking_uri") or ""))
    exp, run = mlflow.get("experiment_id"), mlflow.get("run_id")
    if parts.scheme not in ("http", "https") or not parts.netloc or exp is None or not run:
        return None
    host = parts.netloc.rpartition("@")[2]
    return f"{parts.scheme}://{host}{parts.path.rstrip('/')}/#/experiments/{exp}/runs/{run}"


def publish(run_dir: Path, env: Mapping[str, str] = os.environ, recipe: str | Path | None = None) -> None:
    """Report a finished run (verdict.json, report.md in `run_dir`) to GitHub Actions.

    The recipe and the MLflow run come from verdict.json, else from the run's state.json;
    `recipe` is needed only when neither names it.
    """
    run_dir = Path(run_dir)
    if not (run_dir / "verdict.json").is_file():
        raise BadInput(f"{run_dir}/verdict.json: not found; publish needs a finished run directory "
                       "(pass the directory `kiln run` printed).")
    verdict = read_json(run_dir / "verdict.json")
    state = read_json(run_dir / "state.json") if (run_dir / "state.json").is_file() else {}
    recipe = verdict.get("recipe") or state.get("recipe") or recipe
    if not recipe:
        raise BadInput(f"{run_dir}: neither verdict.json nor state.json names the recipe; pass recipe= "
                       "(the comment marker needs it, or two recipes would share one comment).")
    mlflow = verdict.get("mlflow") or {"tracking_uri": state.get("tracking_uri"),
                                       "experiment_id": state.get("experiment_id"), "run_id": state.get("mlflow_parent")}
    report = run_dir / "report.md"
    report_md = report.read_text() if report.is_file() else "_kiln wrote no report.md for this run._\n"
    rel = _recipe_path(recipe, env)
    mlflow_url = mlflow_run_url(mlflow)
    body = comment_body(rel, verdict, report_md, _event(env), _links(env, mlflow_url, mlflow))
    _write_all(run_dir, rel, verdict, report_md, body, mlflow_url, env)
    _annotate(rel, verdict.get("checks") or [], env)


def publish_no_verdict(run_dir: Path, recipe: str, exit_code: int, log: str = "",
                       env: Mapping[str, str] = os.environ) -> None:
    """Report a run that ended before its gate (bad recipe, crash): the same outputs, the log's tail."""
    rel = _recipe_path(recipe, env)
    verdict = {"verdict": "Error", "exit_code": exit_code, "checks": []}
    what = "kiln rejected the recipe or its input" if exit_code == 2 else "kiln stopped before its gate"
    tail = "\n".join(log.rstrip().splitlines()[-40:])
    report_md = f"# kiln: {rel} — {ICON['Error']} {what} (exit {exit_code}, {_meaning(exit_code)})\n\n"
    if tail:
        report_md += "Last lines of the log:\n\n```text\n" + tail.replace("```", "``\u200b`") + "\n```\n"
    body = comment_body(rel, verdict, report_md, _event(env), _links(env, None, None), fold=False)
    _write_all(Path(run_dir), rel, verdict, report_md, body, None, env)
    print(_command("error", f"kiln: {what} (exit {exit_code})", {"file": rel}, env))


def comment_body(recipe: str, verdict: Mapping[str, Any], report_md: str, pr: Mapping[str, Any],
                 links: list[str], fold: bool = True) -> str:
    """The pull-request comment: marker, headline, checks worst first, then the report (folded
    when the table already told the story)."""
    v, code = verdict.get("verdict", "Error"), int(verdict.get("exit_code", 4))
    checks = sorted(verdict.get("checks") or [], key=lambda c: ORDER.get(c.get("verdict"), 1))
    bad = [c for c in checks if c.get("verdict") != "Successful"]
    head = [MARKER.format(recipe=recipe.replace("--", "-%2D")),
            f"### {ICON.get(v, '💥')} kiln gate: **{v}** — `{recipe}`", ""]
    facts = [f"exit code {code} ({_meaning(code)})"]
    if checks:
        facts.insert(0, f"{len(checks) - len(bad)} of {len(checks)} checks passed")
    if pr.get("number"):
        facts.append(f"PR #{pr['number']}" + (f" at `{str(pr['head_sha'])[:12]}`" if pr.get("head_sha") else ""))
    head += [" · ".join(facts + links), ""]
    if verdict.get("summary"):  # how the run ended, the row of the outcomes table (kiln.pipeline.stages.outcomes)
        head += [f"**{_cell(verdict['summary'])}.**", ""]
    if v == "Inconclusive":
        head += ["> The data cannot decide at the policy's confidence level (not a regression, not a pass). "
                 "More samples usually settle it; the recipe's `gate.on_inconclusive` says whether it blocks.", ""]
    # The report's warnings (a contention guard the recipe switched off: a pull request's recipe is its own)
    if warnings := [line for line in report_md.split("\n## ", 1)[0].splitlines() if line.startswith("> ⚠️")]:
        head += [*warnings, ""]
    if checks:
        head += [_table(checks), ""]
    reasons = [f"- **{_cell(c.get('name'))}** ({c.get('verdict')}): {_cell(c.get('reason'))}" for c in bad if c.get("reason")]
    head += [*reasons, ""] if reasons else []
    opening, closing = (["<details><summary>Full report</summary>", ""], ["", "</details>"]) if fold else ([], [])
    tail = [*closing, "", "<sub>kiln updates this comment on every push.</sub>", ""]
    room = COMMENT_LIMIT - len("\n".join(head + opening + tail))
    return "\n".join([*head, *opening, _truncate(report_md, room).rstrip("\n"), *tail])


def _write_all(run_dir: Path, recipe: str, verdict: Mapping[str, Any], report_md: str, body: str,
               mlflow_url: str | None, env: Mapping[str, str]) -> None:
    body = redact(body, env)
    atomic_write_text(run_dir / COMMENT_FILE, body)
    if path := env.get("GITHUB_STEP_SUMMARY"):
        with open(path, "a", encoding="utf-8") as f:
            f.write(redact(_truncate(report_md, SUMMARY_LIMIT), env).rstrip("\n") + "\n\n")
    if path := env.get("GITHUB_OUTPUT"):
        failed = [f"{c.get('name')}: {c.get('verdict')} (observed {check_figures(c)[0]}, "
                  f"threshold {c.get('threshold') or '—'})" for c in verdict.get("checks") or []
                  if c.get("verdict") != "Successful"]
        html = run_dir / "report.html"
        outputs = {"verdict": verdict.get("verdict", "Error"), "exit-code": str(verdict.get("exit_code", 4)),
                   "run-dir": str(run_dir.resolve()), "report": str((run_dir / "report.md").resolve()),
                   "report-html": str(html.resolve()) if html.is_file() else "",
                   "comment": str((run_dir / COMMENT_FILE).resolve()), "recipe": recipe,
                   "failed-checks": "\n".join(failed), "mlflow-run-url": mlflow_url or ""}
        with open(path, "a", encoding="utf-8") as f:
            f.write("".join(output_line(k, redact(v, env)) for k, v in outputs.items()))


def _annotate(recipe: str, checks: list[Mapping[str, Any]], env: Mapping[str, str]) -> None:
    level = {"Failed": "error", "Error": "error", "Inconclusive": "warning"}
    for c in checks:
        if c.get("verdict") in level:
            observed, baseline, interval = check_figures(c)
            msg = (f"{c.get('name')}: {c.get('verdict')} — observed {observed}, baseline {baseline}, "
                   f"threshold {c.get('threshold') or '—'}, interval {interval}"
                   + (f". {c['reason']}" if c.get("reason") else ""))
            print(_command(level[c["verdict"]], msg, {"file": recipe, "title": f"kiln {c.get('verdict')}"}, env))


def _command(level: str, message: str, props: Mapping[str, str], env: Mapping[str, str]) -> str:
    """A workflow command (`::error file=…::msg`), escaped so data cannot end it early."""
    def esc(s: str, prop: bool) -> str:
        s = redact(s, env).replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")
        return s.replace(":", "%3A").replace(",", "%2C") if prop else s

    props_s = ",".join(f"{k}={esc(v, True)}" for k, v in props.items() if v)
    return f"::{level} {props_s}::{esc(message, False)}" if props_s else f"::{level}::{esc(message, False)}"


# --- the policy a pull request changed ------------------------------------------------------------

POLICY_ICON = {"looser": "🔓", "changed": "❔", "stricter": "🔒", "identical": "", "new": "🆕", "unreadable": "💥"}
NEEDS_APPROVAL = ("looser", "changed", "unreadable")
MUST_PASS = "Successful"  # a recipe with no expected verdict must pass


def policy_report(recipe: str, diff: Mapping[str, Any] | None, approved: bool, label: str,
                  expect: tuple[str, str] = ("", ""), unreadable: str = "") -> tuple[str, str]:
    """(outcome, Markdown section) for one recipe of a pull request against the base branch's copy.

    `diff`: `kiln policy diff --json` of the base's copy and the PR's, None for a recipe new in the PR;
    `expect`: the verdicts expected of it on the base branch and in the PR; `unreadable`: why the two
    could not be compared. The outcome is the weakest of the policy's and the expectation's changes."""
    from kiln.pipeline.recipe.policy import PolicyChange, overall

    changes = [PolicyChange(**c) for c in (diff or {}).get("changes", [])]
    base_expect, head_expect = (e or MUST_PASS for e in expect)
    if diff is not None and base_expect != head_expect:
        way = "stricter" if head_expect == MUST_PASS else "looser" if base_expect == MUST_PASS else "changed"
        changes.append(PolicyChange("expected verdict", base_expect, head_expect, way))
    outcome = "unreadable" if unreadable else "new" if diff is None else overall(changes)
    title = {"new": "new (the base branch has no such recipe): judged under its own",
             "unreadable": "could not be compared with the base branch's",
             "identical": "identical to the base branch's"}.get(outcome, f"{outcome} than the base branch's")
    lines = [f"#### {POLICY_ICON[outcome]} Policy of `{recipe}`: {title}".replace("####  ", "#### "), ""]
    if unreadable:
        lines += [f"`kiln policy diff` failed ({_cell(unreadable)}): the recipe is judged under its own policy.", ""]
    elif diff is not None:
        old, new = diff["old"]["sha256"][:12], diff["new"]["sha256"][:12]
        lines += [f"Judged under the base branch's policy (`{old}`)" + ("." if old == new else
                  f"; the pull request's (`{new}`) decides nothing before it is merged."), ""]
    if changes:
        lines += ["| | field | base branch | pull request |", "|---|---|---|---|"]
        lines += [f"| {POLICY_ICON[c.direction]} {c.direction} | `{_cell(c.path)}` | {_value(c.old)} "
                  f"| {_value(c.new)} |" for c in changes]
        lines.append("")
    if outcome in NEEDS_APPROVAL:
        lines += [_approval(approved, label), ""]
    return outcome, "\n".join(lines)


def _approval(approved: bool, label: str) -> str:
    if approved:
        return (f"**Approved** (the pull request carries the label `{label}`): the change may merge. This run is "
                "still judged under the base branch's policy and expectations; the new ones apply once merged.")
    return (f"**Not approved**: a looser or changed policy fails this check until someone with triage or write "
            f"access adds the label `{label}` to the pull request (the check runs again when they do).")


def _value(v: Any) -> str:
    text = "—" if v is None else v if isinstance(v, str) else json.dumps(v, sort_keys=True)
    return f"`{_cell(text if len(text) <= 80 else text[:77] + '...')}`"


def write_policy_report(out: Path, recipe: str, diff: Mapping[str, Any] | None, approved: bool, label: str,
                        expect: tuple[str, str], unreadable: str = "", env: Mapping[str, str] = os.environ) -> str:
    """policy_report's section to `out`, the job summary, and step outputs `policy`, `needs-approval`, `section`."""
    outcome, section = policy_report(_recipe_path(recipe, env), diff, approved, label, expect, unreadable)
    section = redact(section, env)
    atomic_write_text(out, section)
    if path := env.get("GITHUB_STEP_SUMMARY"):
        with open(path, "a", encoding="utf-8") as f:
            f.write(section.rstrip("\n") + "\n\n")
    if path := env.get("GITHUB_OUTPUT"):
        outputs = {"policy": outcome, "needs-approval": str(outcome in NEEDS_APPROVAL).lower(),
                   "section": str(Path(out).resolve())}
        with open(path, "a", encoding="utf-8") as f:
            f.write("".join(output_line(k, v) for k, v in outputs.items()))
    return outcome


def add_masks(env: Mapping[str, str] = os.environ) -> list[str]:
    """`::add-mask::` lines for credentials inside URL-valued env vars (the runner masks whole
    secrets only, not the password part of a tracking URI that a library may log on its own)."""
    lines = []
    for value in env.values():
        for m in re.finditer(r"://([^/\s@]+)@", value):
            password = m.group(1).partition(":")[2]
            lines += [f"::add-mask::{s}" for s in (password, m.group(1)) if len(s) >= 4]
    return lines


def _recipe_path(recipe: str | Path, env: Mapping[str, str]) -> str:
    """The recipe as the repository names it (stable across runners, so the marker matches)."""
    p = Path(recipe)
    base = Path(env.get("GITHUB_WORKSPACE") or os.getcwd())
    if p.is_absolute():
        try:
            p = p.resolve().relative_to(base.resolve())
        except ValueError:
            pass
    return p.as_posix()


def _event(env: Mapping[str, str]) -> dict[str, Any]:
    path = env.get("GITHUB_EVENT_PATH")
    if not path or not Path(path).is_file():
        return {}
    event = json.loads(Path(path).read_text())
    pr = event.get("pull_request") or {}
    return {"number": pr.get("number") or event.get("number"), "head_sha": (pr.get("head") or {}).get("sha"),
            "url": pr.get("html_url")}


def _links(env: Mapping[str, str], mlflow_url: str | None, mlflow: Mapping[str, Any] | None) -> list[str]:
    links = []
    if mlflow_url:
        links.append(f"[MLflow run]({mlflow_url})")
    elif mlflow and mlflow.get("run_id"):
        links.append(f"MLflow run `{mlflow['run_id']}` (local tracking store, not linkable)")
    if env.get("GITHUB_RUN_ID") and env.get("GITHUB_REPOSITORY"):
        server = env.get("GITHUB_SERVER_URL", "https://github.com")
        links.append(f"[workflow run and artifacts]({server}/{env['GITHUB_REPOSITORY']}/actions/runs/{env['GITHUB_RUN_ID']})")
    return links


def _table(checks: list[Mapping[str, Any]]) -> str:
    """Each check's figures in their units, as the report shows them (kiln.core.units.check_figures): a speed-up
    as 7.32x, an agreement in percent, a size in MB; the interval in the threshold's terms (a quality check's is
    the drop's, positive is worse)."""
    rows = ["| | check | candidate | baseline | threshold | interval |", "|---|---|---|---|---|---|"]
    for c in checks:
        observed, baseline, interval = check_figures(c)
        rows.append(f"| {ICON.get(c.get('verdict'), '💥')} {c.get('verdict')} | {_cell(c.get('name'))} | {observed} "
                    f"| {baseline} | {_cell(c.get('threshold') or '—')} | {_cell(interval)} |")
    return "\n".join(rows)


def _cell(v: Any) -> str:
    return str(v if v is not None else "").replace("|", "\\|").replace("\n", " ")


def _meaning(code: int) -> str:
    return EXIT_MEANING.get(code, "unknown exit code")


def _truncate(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    note = "\n\n_… report truncated here; the whole report is in the job summary and the run's artifact._\n"
    return text[: max(0, limit - len(note))] + note


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kiln.pipeline.github", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("publish", help="report a finished run directory (what `kiln run` does itself)")
    p.add_argument("run_dir", type=Path)
    p = sub.add_parser("no-verdict", help="report a run that ended before its gate")
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--recipe", required=True)
    p.add_argument("--exit-code", type=int, required=True)
    p.add_argument("--log", type=Path, help="the run's console log; its tail goes into the report")
    sub.add_parser("add-masks", help="print ::add-mask:: for credentials inside URL-valued env vars")
    _add_policy_cli(sub)
    add_changes_cli(sub)
    args = parser.parse_args(argv)
    if args.command == "publish":
        publish(args.run_dir)
    elif args.command == "no-verdict":
        log = args.log.read_text(errors="replace") if args.log and args.log.is_file() else ""
        publish_no_verdict(args.run_dir, args.recipe, args.exit_code, log)
    elif args.command == "add-masks":
        print("\n".join(add_masks()))
    elif args.command == "policy-report":
        return _policy_cli(args)
    else:
        return args.func(args)
    return 0


def _add_policy_cli(sub: Any) -> None:
    p = sub.add_parser("policy-report", help="report what a pull request changed in a recipe's policy")
    p.add_argument("--recipe", required=True)
    p.add_argument("--out", type=Path, required=True, help="where the Markdown section goes")
    p.add_argument("--diff", type=Path, help="`kiln policy diff BASE_COPY RECIPE --json`; absent: a new recipe")
    p.add_argument("--diff-exit-code", type=int, default=0)
    p.add_argument("--diff-log", type=Path, help="kiln policy diff's stderr, for an exit code of 2 or more")
    p.add_argument("--approved", default="false", help="true when the pull request carries the approval label")
    p.add_argument("--label", default="kiln-policy-approved")
    p.add_argument("--expect-base", default="", help="the verdict the base branch expects of the recipe")
    p.add_argument("--expect-head", default="", help="the verdict the pull request expects of it")


def _policy_cli(args: argparse.Namespace) -> int:
    diff, unreadable = None, ""
    if args.diff is not None:
        if args.diff_exit_code not in (0, 1):
            log = args.diff_log.read_text(errors="replace").strip() if args.diff_log and args.diff_log.is_file() else ""
            unreadable = f"exit {args.diff_exit_code}" + (f": {log.splitlines()[-1]}" if log else "")
        else:
            diff = read_json(args.diff)
    outcome = write_policy_report(args.out, args.recipe, diff, args.approved == "true", args.label,
                                  (args.expect_base, args.expect_head), unreadable)
    print(f"policy of {args.recipe}: {outcome}")
    return 0

