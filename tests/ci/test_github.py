"""`publish` under a simulated GitHub Actions job: job summary, step outputs (parsed the way the
runner parses $GITHUB_OUTPUT), the pull-request comment body, annotations, and no secret in any
of them. Run directories are hand-written fixtures (verdict.json + report.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.pipeline.github import publish as github
from kiln.core.errors import BadInput

PASSWORD = "s3cret-tracking-pw"
TOKEN = "ghp_tokenvalue123456"
USER_SECRET = "hunter2-in-a-custom-var"
HEAD_SHA = "0123456789abcdef0123456789abcdef01234567"

CHECKS_PASS = [
    {"name": "perplexity", "verdict": "Successful", "observed": 35.9, "baseline": 35.45,
     "threshold": "≤ +5%", "ci": [1.002, 1.021], "reason": ""},
    {"name": "decode_tok_s", "verdict": "Successful", "observed": 61.0, "baseline": 36.0,
     "threshold": "≥ 1.2×", "ci": [1.6, 1.8], "reason": ""},
]
CHECKS_FAIL = [
    CHECKS_PASS[1],
    {"name": "perplexity", "verdict": "Failed", "observed": 117.0, "baseline": 35.45,
     "threshold": "≤ +5%", "ci": [3.1, 3.5], "reason": "whole interval above the margin"},
    {"name": "agree|ment", "verdict": "Inconclusive", "observed": 0.81, "baseline": None,
     "threshold": "≥ 0.8", "ci": [0.74, 0.88], "reason": "interval straddles the threshold"},
]


def parse_outputs(text: str) -> dict[str, str]:
    """$GITHUB_OUTPUT as the runner reads it: `name=value` or `name<<DELIM` ... `DELIM`."""
    out, lines, i = {}, text.split("\n"), 0
    while i < len(lines):
        line = lines[i]
        i += 1
        if not line:
            continue
        if "=" in line and ("<<" not in line or line.index("=") < line.index("<<")):
            name, value = line.split("=", 1)
            out[name] = value
            continue
        name, delimiter = line.split("<<", 1)
        value = []
        while lines[i] != delimiter:
            value.append(lines[i])
            i += 1
        i += 1
        out[name] = "\n".join(value)
    return out


@pytest.fixture
def actions(tmp_path: Path) -> dict[str, str]:
    """The environment a step of a pull_request workflow sees, with three secrets in it."""
    workspace = tmp_path / "workspace"
    (workspace / "recipes").mkdir(parents=True)
    (workspace / "recipes" / "demo.yaml").write_text("name: demo\n")
    event = tmp_path / "event.json"
    event.write_text(json.dumps({"action": "synchronize", "number": 42, "pull_request": {
        "number": 42, "html_url": "https://github.com/acme/models/pull/42",
        "head": {"sha": HEAD_SHA}, "base": {"sha": "f" * 40}}}))
    for name in ("summary.md", "output.txt"):
        (tmp_path / name).write_text("")
    return {"GITHUB_ACTIONS": "true", "GITHUB_WORKSPACE": str(workspace), "GITHUB_EVENT_PATH": str(event),
            "GITHUB_EVENT_NAME": "pull_request", "GITHUB_STEP_SUMMARY": str(tmp_path / "summary.md"),
            "GITHUB_OUTPUT": str(tmp_path / "output.txt"), "GITHUB_SERVER_URL": "https://github.com",
            "GITHUB_REPOSITORY": "acme/models", "GITHUB_RUN_ID": "987654",
            "MLFLOW_TRACKING_PASSWORD": PASSWORD, "GITHUB_TOKEN": TOKEN, "TEAM_API_KEY": USER_SECRET,
            "SHORT_TOKEN": "1", "PATH": "/usr/bin"}


def make_run(tmp_path: Path, env: dict[str, str], verdict: str, exit_code: int, checks: list[dict],
             tracking_uri: str = f"https://alice:{PASSWORD}@mlflow.acme.test/") -> Path:
    run_dir = tmp_path / "runs" / f"demo-{verdict.lower()}"
    run_dir.mkdir(parents=True)
    (run_dir / "verdict.json").write_text(json.dumps({
        "verdict": verdict, "exit_code": exit_code, "rule": "any Failed -> Failed", "checks": checks,
        "mlflow": {"tracking_uri": tracking_uri, "experiment_id": "3", "run_id": "abc123"},
        "recipe": str(Path(env["GITHUB_WORKSPACE"]) / "recipes" / "demo.yaml")}))
    (run_dir / "report.md").write_text(
        f"# kiln: demo — {verdict}\n\nExit code {exit_code}.\n\n## Links\n\n"
        f"- MLflow run: {tracking_uri}#/experiments/3/runs/abc123\n"
        f"- the job saw token {TOKEN} and key {USER_SECRET}\n")
    (run_dir / "report.html").write_text("<html></html>")
    return run_dir


def written(env: dict[str, str], run_dir: Path) -> tuple[str, dict[str, str], str]:
    summary = Path(env["GITHUB_STEP_SUMMARY"]).read_text()
    outputs = parse_outputs(Path(env["GITHUB_OUTPUT"]).read_text())
    return summary, outputs, (run_dir / github.COMMENT_FILE).read_text()


def assert_no_secret(*texts: str) -> None:
    for text in texts:
        for secret in (PASSWORD, TOKEN, USER_SECRET):
            assert secret not in text


def test_detects_github_actions() -> None:
    assert github.in_github_actions({"GITHUB_ACTIONS": "true"})
    assert not github.in_github_actions({})
    assert not github.in_github_actions({"GITHUB_ACTIONS": "false", "CI": "true"})


def test_passing_gate(tmp_path: Path, actions: dict[str, str], capsys: pytest.CaptureFixture) -> None:
    run_dir = make_run(tmp_path, actions, "Successful", 0, CHECKS_PASS)
    github.publish(run_dir, actions)
    summary, outputs, comment = written(actions, run_dir)

    assert summary.startswith("# kiln: demo — Successful")
    assert outputs["verdict"] == "Successful" and outputs["exit-code"] == "0"
    assert Path(outputs["run-dir"]) == run_dir.resolve()
    assert Path(outputs["report"]).read_text().startswith("# kiln: demo")
    assert Path(outputs["report-html"]).name == "report.html"
    assert Path(outputs["comment"]) == (run_dir / "pr-comment.md").resolve()
    assert outputs["recipe"] == "recipes/demo.yaml"
    assert outputs["failed-checks"] == ""
    assert outputs["mlflow-run-url"] == "https://mlflow.acme.test/#/experiments/3/runs/abc123"

    first, headline = comment.splitlines()[:2]
    assert first == "<!-- kiln-report:recipes/demo.yaml -->"
    assert headline == "### ✅ kiln gate: **Successful** — `recipes/demo.yaml`"
    assert "2 of 2 checks passed" in comment and "exit code 0 (passed)" in comment
    assert f"PR #42 at `{HEAD_SHA[:12]}`" in comment
    assert "[MLflow run](https://mlflow.acme.test/#/experiments/3/runs/abc123)" in comment
    assert "(https://github.com/acme/models/actions/runs/987654)" in comment
    assert "<details><summary>Full report</summary>" in comment and "# kiln: demo — Successful" in comment
    assert capsys.readouterr().out == ""  # nothing to annotate
    assert_no_secret(summary, comment, Path(actions["GITHUB_OUTPUT"]).read_text())


def test_failing_gate(tmp_path: Path, actions: dict[str, str], capsys: pytest.CaptureFixture) -> None:
    run_dir = make_run(tmp_path, actions, "Failed", 1, CHECKS_FAIL)
    github.publish(run_dir, actions)
    summary, outputs, comment = written(actions, run_dir)
    out = capsys.readouterr().out

    assert outputs["verdict"] == "Failed" and outputs["exit-code"] == "1"
    # Two checks did not pass: a multi-line output, which must survive the heredoc format.
    assert outputs["failed-checks"].splitlines() == [
        "perplexity: Failed (observed 117, threshold ≤ +5%)",
        "agree|ment: Inconclusive (observed 0.81, threshold ≥ 0.8)"]
    assert "failed-checks<<ghadelimiter_" in Path(actions["GITHUB_OUTPUT"]).read_text()

    assert comment.splitlines()[1] == "### ❌ kiln gate: **Failed** — `recipes/demo.yaml`"
    assert "1 of 3 checks passed" in comment and "exit code 1 (gate failed)" in comment
    table = [line for line in comment.splitlines() if line.startswith("| ")]
    assert table[1].startswith("| ❌ Failed | perplexity | 117 | 35.45 | ≤ +5% | [3.1, 3.5] |")  # worst first
    assert table[2].startswith("| ⚠️ Inconclusive | agree\\|ment | 0.81 | — |")  # pipe escaped, no baseline
    assert table[3].startswith("| ✅ Successful | decode_tok_s |")
    assert "- **perplexity** (Failed): whole interval above the margin" in comment

    assert "::error file=recipes/demo.yaml,title=kiln Failed::perplexity: Failed — observed 117," in out
    assert "::warning file=recipes/demo.yaml,title=kiln Inconclusive::agree|ment: Inconclusive" in out
    assert "decode_tok_s" not in out
    assert_no_secret(summary, comment, Path(actions["GITHUB_OUTPUT"]).read_text(), out)


def test_quality_interval_is_shown_as_the_drop_its_threshold_bounds(tmp_path: Path, actions: dict[str, str],
                                                                    capsys: pytest.CaptureFixture) -> None:
    # verdict.json as the gate writes it: the interval is of candidate - baseline (accuracy fell)
    check = {"name": "quality:word_swap_acc", "kind": "quality", "metric": "word_swap_acc", "verdict": "Inconclusive",
             "observed": 0.9075, "baseline": 0.975, "threshold": "drop ≤ 0.03", "ci": [-0.1, -0.04],
             "drop": 0.0675, "drop_ci": [0.04, 0.1], "reason": ""}
    github.publish(make_run(tmp_path, actions, "Inconclusive", 3, [check]), actions)
    comment = (tmp_path / "runs" / "demo-inconclusive" / github.COMMENT_FILE).read_text()
    assert "| drop ≤ 0.03 | drop [0.04, 0.1] |" in comment
    assert "interval drop [0.04, 0.1]" in capsys.readouterr().out


def test_inconclusive_is_told_apart(tmp_path: Path, actions: dict[str, str], capsys: pytest.CaptureFixture) -> None:
    run_dir = make_run(tmp_path, actions, "Inconclusive", 3, [CHECKS_PASS[0], CHECKS_FAIL[2]])
    github.publish(run_dir, actions)
    _, outputs, comment = written(actions, run_dir)
    assert outputs["verdict"] == "Inconclusive" and outputs["exit-code"] == "3"
    assert comment.splitlines()[1].startswith("### ⚠️ kiln gate: **Inconclusive**")
    assert "exit code 3 (gate inconclusive)" in comment and "cannot decide" in comment
    out = capsys.readouterr().out
    assert out.startswith("::warning ") and "::error" not in out


def test_secrets_are_masked_everywhere(tmp_path: Path, actions: dict[str, str], capsys: pytest.CaptureFixture) -> None:
    run_dir = make_run(tmp_path, actions, "Failed", 1, CHECKS_FAIL)
    github.publish(run_dir, actions)
    summary, _, comment = written(actions, run_dir)
    assert "https://***@mlflow.acme.test/" in summary  # credentials in the report's URL
    assert "token *** and key ***" in summary and "token *** and key ***" in comment
    assert "Exit code 1." in summary  # SHORT_TOKEN=1 is too short to be a secret: text stays intact
    assert_no_secret(summary, comment, Path(actions["GITHUB_OUTPUT"]).read_text(), capsys.readouterr().out)


def test_redact_url_credentials_and_query_tokens() -> None:
    text = "postgresql://u:pw12@db/x https://h/x?sig=abcdef&v=1 https://h/#/runs/1"
    assert github.redact(text, {}) == "postgresql://***@db/x https://h/x?sig=***&v=1 https://h/#/runs/1"


def test_summary_and_outputs_append(tmp_path: Path, actions: dict[str, str]) -> None:
    Path(actions["GITHUB_STEP_SUMMARY"]).write_text("earlier step\n")
    Path(actions["GITHUB_OUTPUT"]).write_text("earlier=1\n")
    github.publish(make_run(tmp_path, actions, "Successful", 0, CHECKS_PASS), actions)
    assert Path(actions["GITHUB_STEP_SUMMARY"]).read_text().startswith("earlier step\n# kiln: demo")
    assert parse_outputs(Path(actions["GITHUB_OUTPUT"]).read_text())["earlier"] == "1"


def test_multiline_output_delimiter_never_collides() -> None:
    value = "line one\nEOF\nghadelimiter_\nline four"
    line = github.output_line("x", value)
    assert parse_outputs(line) == {"x": value}
    assert github.output_line("y", "one line") == "y=one line\n"


def test_mlflow_link_only_for_http_servers(tmp_path: Path, actions: dict[str, str]) -> None:
    run_dir = make_run(tmp_path, actions, "Successful", 0, CHECKS_PASS, tracking_uri="sqlite:////tmp/mlflow.db")
    github.publish(run_dir, actions)
    _, outputs, comment = written(actions, run_dir)
    assert outputs["mlflow-run-url"] == ""
    assert "MLflow run `abc123` (local tracking store, not linkable)" in comment
    assert github.mlflow_run_url({"tracking_uri": "http://[::1]:5000/mlflow/", "experiment_id": 0, "run_id": "r"}) \
        == "http://[::1]:5000/mlflow/#/experiments/0/runs/r"
    assert github.mlflow_run_url({"tracking_uri": "databricks", "experiment_id": "1", "run_id": "r"}) is None


def test_comment_fits_githubs_limit(tmp_path: Path, actions: dict[str, str]) -> None:
    run_dir = make_run(tmp_path, actions, "Successful", 0, CHECKS_PASS)
    (run_dir / "report.md").write_text("# kiln: demo\n" + "x" * 200_000)
    github.publish(run_dir, actions)
    comment = (run_dir / github.COMMENT_FILE).read_text()
    assert len(comment) <= 65_536
    assert "report truncated" in comment and comment.rstrip().endswith("</sub>")


def test_outside_a_pull_request(tmp_path: Path, actions: dict[str, str]) -> None:
    env = {k: v for k, v in actions.items() if k not in ("GITHUB_EVENT_PATH", "GITHUB_STEP_SUMMARY")}
    run_dir = make_run(tmp_path, env, "Successful", 0, CHECKS_PASS)
    github.publish(run_dir, env)
    comment = (run_dir / github.COMMENT_FILE).read_text()
    assert comment.startswith("<!-- kiln-report:recipes/demo.yaml -->") and "PR #" not in comment


def test_missing_verdict_is_bad_input(tmp_path: Path, actions: dict[str, str]) -> None:
    with pytest.raises(BadInput, match="verdict.json"):
        github.publish(tmp_path, actions)
    (tmp_path / "verdict.json").write_text(json.dumps({"verdict": "Successful", "exit_code": 0, "checks": []}))
    with pytest.raises(BadInput, match="names the recipe"):
        github.publish(tmp_path, actions)


def test_recipe_and_mlflow_run_from_state_json(tmp_path: Path, actions: dict[str, str]) -> None:
    """A verdict.json without `recipe` and `mlflow`: the run's state.json names both."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "verdict.json").write_text(json.dumps({"verdict": "Successful", "exit_code": 0, "checks": CHECKS_PASS}))
    (run_dir / "state.json").write_text(json.dumps({
        "recipe": "recipes/demo.yaml", "tracking_uri": "http://127.0.0.1:5000", "experiment_id": "7",
        "mlflow_parent": "parent1", "status": "done"}))
    github.publish(run_dir, actions)
    _, outputs, comment = written(actions, run_dir)
    assert comment.startswith("<!-- kiln-report:recipes/demo.yaml -->")
    assert outputs["mlflow-run-url"] == "http://127.0.0.1:5000/#/experiments/7/runs/parent1"
    assert "_kiln wrote no report.md for this run._" in comment


def test_no_verdict_command(tmp_path: Path, actions: dict[str, str]) -> None:
    """The workflow's fallback when `kiln validate` rejects the recipe: same outputs, the log's tail."""
    log = tmp_path / "kiln.log"
    log.write_text("loading recipes/demo.yaml\nerror: optimize.bits: 5 is not one of 2, 3, 4, 8; "
                   f"set optimize.bits (token {TOKEN})\n")
    runs = tmp_path / "runs"
    proc = subprocess.run([sys.executable, "-m", "kiln.pipeline.github", "no-verdict", "--run-dir", str(runs),
                           "--recipe", "recipes/demo.yaml", "--exit-code", "2", "--log", str(log)],
                          env=actions, capture_output=True, text=True, cwd=actions["GITHUB_WORKSPACE"])
    assert proc.returncode == 0, proc.stderr
    summary, outputs, comment = written(actions, runs)
    assert outputs["verdict"] == "Error" and outputs["exit-code"] == "2"
    assert comment.startswith("<!-- kiln-report:recipes/demo.yaml -->\n### 💥 kiln gate: **Error**")
    assert "exit code 2 (bad input)" in comment and "optimize.bits: 5 is not one of" in comment
    assert "kiln rejected the recipe or its input" in summary
    assert proc.stdout.startswith("::error file=recipes/demo.yaml::kiln: kiln rejected the recipe or its input")
    assert_no_secret(summary, comment, proc.stdout)


def test_add_masks_hides_url_credentials() -> None:
    env = {"MLFLOW_TRACKING_URI": f"https://alice:{PASSWORD}@mlflow.acme.test", "OTHER": "https://h/x"}
    assert github.add_masks(env) == [f"::add-mask::{PASSWORD}", f"::add-mask::alice:{PASSWORD}"]


def test_the_comment_says_how_the_run_ended(tmp_path: Path, actions: dict[str, str]) -> None:
    """The outcome table's line (kiln.pipeline.stages.outcomes) under the title: a search whose budget ran out
    must read as not judged, not only as Inconclusive."""
    run_dir = make_run(tmp_path, actions, "Inconclusive", 3, CHECKS_FAIL)
    record = json.loads((run_dir / "verdict.json").read_text())
    record["summary"] = "not judged: the search budget (3 s) ran out before every check of fp32-copy ran"
    (run_dir / "verdict.json").write_text(json.dumps(record))
    github.publish(run_dir, actions)
    _, _, comment = written(actions, run_dir)
    assert "**not judged: the search budget (3 s) ran out before every check of fp32-copy ran.**" in comment


def policy_report(actions: dict[str, str], tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    (tmp_path / "output.txt").write_text("")
    proc = subprocess.run([sys.executable, "-m", "kiln.pipeline.github", "policy-report", "--recipe",
                           "recipes/demo.yaml", "--out", str(tmp_path / "policy.md"), *args],
                          env=actions, capture_output=True, text=True, cwd=actions["GITHUB_WORKSPACE"])
    return proc, parse_outputs((tmp_path / "output.txt").read_text())


def test_policy_report_command(tmp_path: Path, actions: dict[str, str]) -> None:
    """The action's policy step: the section in the summary and a file for the comment, the outcome as outputs."""
    same = {"old": {"recipe": "a", "sha256": "1" * 64}, "new": {"recipe": "b", "sha256": "1" * 64},
            "outcome": "identical", "needs_approval": False, "changes": []}
    (tmp_path / "same.json").write_text(json.dumps(same))
    proc, out = policy_report(actions, tmp_path, "--diff", str(tmp_path / "same.json"))
    assert proc.returncode == 0, proc.stderr
    assert out == {"policy": "identical", "needs-approval": "false", "section": str(tmp_path / "policy.md")}
    section = (tmp_path / "policy.md").read_text()
    assert section.startswith("#### Policy of `recipes/demo.yaml`: identical to the base branch's")
    assert "Judged under the base branch's policy (`111111111111`)." in section
    assert section in (tmp_path / "summary.md").read_text()

    looser = {**same, "new": {"recipe": "b", "sha256": "2" * 64}, "changes": [
        {"path": "gate.checks[quality:perplexity]", "old": {"kind": "quality", "margin": 0.05}, "new": None,
         "direction": "looser"},
        {"path": "gate.confidence", "old": 0.95, "new": 0.99, "direction": "stricter"}]}
    (tmp_path / "looser.json").write_text(json.dumps(looser))
    proc, out = policy_report(actions, tmp_path, "--diff", str(tmp_path / "looser.json"), "--diff-exit-code", "1",
                              "--label", "ok-to-loosen")
    assert out["policy"] == "looser" and out["needs-approval"] == "true"
    section = (tmp_path / "policy.md").read_text()
    assert "| 🔓 looser | `gate.checks[quality:perplexity]` | `{\"kind\": \"quality\", \"margin\": 0.05}` | `—` |" in section
    assert "| 🔒 stricter | `gate.confidence` | `0.95` | `0.99` |" in section
    assert "the pull request's (`222222222222`) decides nothing before it is merged" in section
    assert "**Not approved**" in section and "`ok-to-loosen`" in section
    proc, out = policy_report(actions, tmp_path, "--diff", str(tmp_path / "looser.json"), "--approved", "true")
    assert "**Approved**" in (tmp_path / "policy.md").read_text() and out["needs-approval"] == "true"

    # a base copy this kiln cannot read: judged under its own policy, and approval is needed
    (tmp_path / "diff.log").write_text(f"error: recipes/demo.yaml: 1 problem(s) (token {TOKEN})\n")
    proc, out = policy_report(actions, tmp_path, "--diff", str(tmp_path / "missing.json"), "--diff-exit-code", "2",
                              "--diff-log", str(tmp_path / "diff.log"))
    assert proc.returncode == 0 and out["policy"] == "unreadable" and out["needs-approval"] == "true"
    assert "could not be compared" in (tmp_path / "policy.md").read_text()
    assert_no_secret((tmp_path / "policy.md").read_text(), (tmp_path / "summary.md").read_text())

    proc, out = policy_report(actions, tmp_path)  # no diff: the recipe is new in the pull request
    assert out["policy"] == "new" and out["needs-approval"] == "false"
