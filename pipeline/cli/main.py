"""The `kiln` command line. Exit codes: see kiln.core.errors (0 pass, 1 gate failed,
2 bad input, 3 inconclusive, 4 internal error)."""

from __future__ import annotations

import json
import logging
import os
import shlex
import sys
import traceback
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from typer._click.exceptions import ClickException  # typer bundles click; 0.26 names no public base
from rich.table import Table

from kiln.core.credentials import guard_streams
from kiln.core.errors import BadInput, ExitCode, KilnError
from kiln.core.home import runs_root, sqlite_artifacts, where_hint
from kiln.core.units import amount
from kiln.pipeline.cli.app import FreshOpt, JsonOpt, RecipeArg, RunArg, RunsOpt, SetOpt, app, console, err, port_option
from kiln.pipeline.cli.policy import PolicyFromOpt, judged_recipe


def _env() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    # MLflow prints "View run … at <tracking URI>" for every run it ends: dozens of lines per
    # kiln run, with any credentials in the URI. kiln's report links the parent run once.
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' weight-loading bars too
    if not sys.stderr.isatty():  # a log file or CI: each bar would be hundreds of redraws in one line
        os.environ.setdefault("TQDM_DISABLE", "1")
        os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    logging.getLogger("torchao").addFilter(_CudaKernelNotice())
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)  # torchao's enum-registration deprecations


class _CudaKernelNotice(logging.Filter):
    """torchao warns at import for each CUDA kernel library it cannot load; on a CPU machine that
    is expected and says nothing to the user. Its other warnings pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Failed to load ")


@app.command()
def validate(recipe: RecipeArg, set_: SetOpt = [],  # noqa: B006 - typer reads defaults
             policy_from: PolicyFromOpt = None, as_json: JsonOpt = False) -> None:
    """Check a recipe without running it: its fields, and every file and folder it names (model folder,
    evaluation text, prompt sets, task files) with the counts its stages need from them."""
    from kiln.pipeline.stages.inputs import validate_inputs

    try:
        r = judged_recipe(recipe, set_, policy_from)
        validate_inputs(r)
    except BadInput as e:
        if as_json:  # the document says why; the message still goes to stderr, exit 2
            print(json.dumps({"recipe": str(recipe), "valid": False, "errors": e.problems or [str(e)]}, indent=2))
        raise
    if as_json:
        arms = [{"name": name, "optimize": view.optimize.method, "engine": view.engine.backend} for name, view in r.arms()]
        print(json.dumps({"recipe": str(recipe), "valid": True, "name": r.name, "search": r.candidates is not None,
                          "gate_checks": len(r.gate.checks), "arms": arms,
                          "baseline_engine": r.baseline.engine.backend if r.baseline.engine else None}, indent=2))
        return
    _print_valid(recipe, r)


def _print_valid(recipe: Path, r) -> None:
    checks = f"{len(r.gate.checks)} gate checks"
    if r.candidates is None:
        console.print(f"[green]✓[/green] {recipe}: valid ({r.name}, optimize={r.optimize.method}, "
                      f"engine={r.engine.backend}, {checks})", soft_wrap=True)
        return
    # A search: one line per arm, so a list of candidates reads as a list.
    console.print(f"[green]✓[/green] {recipe}: valid ({r.name}, a search over {len(r.candidates)} candidates, {checks})",
                  soft_wrap=True)
    base = r.baseline.engine.backend if r.baseline.engine else "torch"
    console.print(f"  baseline: the checkpoint unchanged, engine={base}", soft_wrap=True)
    for name, view in r.arms():
        console.print(f"  {name}: optimize={view.optimize.method}, engine={view.engine.backend}", soft_wrap=True)
    for c in r.candidates:
        if c.champion:
            console.print(f"  {c.name}: the registry's champion, as it was served", soft_wrap=True)


@app.command()
def schema() -> None:
    """Print the recipe's JSON schema."""
    from kiln.pipeline.recipe.schema import Recipe

    print(json.dumps(Recipe.model_json_schema(), indent=2))


@app.command()
def run(recipe: RecipeArg, set_: SetOpt = [],  # noqa: B006
        runs: RunsOpt = None,
        fresh: FreshOpt = [],  # noqa: B006
        policy_from: PolicyFromOpt = None,
        new_run: Annotated[bool, typer.Option("--new-run", help="start a new run folder even where the last run of "
                                              "this recipe was interrupted (by default it is continued)")] = False) -> None:
    """Run the pipeline: optimize → evaluate quality → benchmark → gate. Continues an interrupted run."""
    from kiln.pipeline.runner import run_pipeline

    r = judged_recipe(recipe, set_, policy_from)
    outcome, run_dir = run_pipeline(r, recipe, runs_root(runs), console, set(fresh), new_run=new_run)
    print((run_dir / "report.md").read_text())  # plain: Markdown tables must not be re-wrapped
    print(f"run directory: {run_dir}")
    from kiln.pipeline.github import publish as github

    if github.in_github_actions():
        github.publish(run_dir)
    raise typer.Exit(int(outcome.exit_code))


@app.command("runs")
def runs_(runs: RunsOpt = None, as_json: JsonOpt = False) -> None:
    """List runs, newest first (those under kiln's home unless --runs names another folder)."""
    from kiln.pipeline.runner import list_runs

    listed = list_runs(runs_root(runs))
    if as_json:
        print(json.dumps(listed, indent=2))
        return
    t = Table("run", "status", "verdict", "exit")
    for s in listed:
        t.add_row(s["run"], s.get("status", "?"), s.get("verdict", "—"), str(s.get("exit_code", "—")))
    console.print(t)
    if not listed:  # on stderr: a pipe reading the table gets the table alone
        err.print(f"no runs under {runs_root(runs)}; runs kept elsewhere: {where_hint()}", soft_wrap=True,
                  markup=False)


@app.command()
def show(run_name: RunArg,
         runs: RunsOpt = None, as_json: JsonOpt = False) -> None:
    """Print a run's stages, metrics and verdict."""
    d = cli_ops.run_dir(run_name, runs)
    state = json.loads((d / "state.json").read_text())
    stages = [json.loads(f.read_text()) for f in sorted((d / "stages").glob("*.json"), key=lambda p: p.stat().st_mtime)]
    report = (d / "report.md").read_text() if (d / "report.md").exists() else None
    if as_json:
        print(json.dumps({"run": d.name, "run_dir": str(d), "state": state, "stages": stages, "report_md": report},
                         indent=2))
        return
    t = Table("stage", "role", "reused", "metrics")
    for s in stages:
        shown = ", ".join(f"{k} {amount(k, v)}" for k, v in s["metrics"].items() if isinstance(v, int | float))
        t.add_row(s["stage"], s["role"], "yes" if s["reused"] else "", shown)
    console.print(t)
    if report is not None and console.is_terminal:  # rendered for a person; Markdown as it is for a pipe or a file
        from rich.markdown import Markdown

        console.print(Markdown(report))
    elif report is not None:
        console.print(report, markup=False)
    else:
        console.print(f"status: {state.get('status')}")


@app.command()
def ui(port: Annotated[int, port_option("the MLflow UI")] = 5000, host: cli_ops.HostOpt = "127.0.0.1",  # cli_ops: imported below, read when typer runs
       tracking_uri: Annotated[str | None, typer.Option(help="default: $MLFLOW_TRACKING_URI, else mlflow.db in kiln's home")] = None,
       api_key_env: cli_ops.KeyEnvOpt = "KILN_API_KEY", insecure_no_api_key: cli_ops.InsecureOpt = False) -> None:
    """Start the MLflow UI on the same store; print each kiln experiment's runs table.

    With an API key every request needs it (a browser logs in with the key as the password), since
    anyone who reaches the UI can move a model's aliases; a non-loopback --host needs one."""
    from kiln.pipeline.tracking.ui import UI_KEY_ENV
    from kiln.pipeline.tracking.runs import EXPERIMENT_KIND, default_uri, experiment_url, open_client, redact_uri

    api_key = cli_ops._key(api_key_env)
    cli_ops.check_exposure(host, api_key, api_key_env, insecure_no_api_key)
    uri = tracking_uri or default_uri()
    env = {k: v for k, v in os.environ.items() if k != UI_KEY_ENV} | {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    if api_key:  # through the environment: the command line shows in `ps`
        env[UI_KEY_ENV] = api_key
    cmd = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", uri, "--host", host,
           "--port", str(port), "--workers", "1", "--app-name", "kiln"]  # kiln.pipeline.tracking.ui
    if where := sqlite_artifacts(uri):  # an experiment made in the UI: beside the store too, not in ./mlartifacts
        cmd += ["--artifacts-destination", str(where)]
    console.print(f"MLflow UI on http://{host}:{port} (store {redact_uri(uri)}" + ("; API key required" if api_key else "")
                  + "); Ctrl-C to stop", soft_wrap=True)
    kiln_made = " and ".join(f"tags.`{key}` = '{value}'" for key, value in EXPERIMENT_KIND.items())
    for exp in open_client(uri).search_experiments(filter_string=kiln_made):
        console.print(f"  {exp.name}: {experiment_url(f'http://{host}:{port}', exp.experiment_id)}", soft_wrap=True, markup=False)
    sys.stdout.flush()  # exec replaces the process: what is still buffered would be lost
    os.execvpe(cmd[0], cmd, env)


@app.command("prepare-demo")
def prepare_demo() -> None:
    """Convert the demo model and prepare the demo data (offline, cached)."""
    from kiln.pipeline.demo.prepare import prepare_demo as prep

    prep(console)


def main() -> None:
    guard_streams()  # before anything can print a credential
    _env()
    try:
        code = app(standalone_mode=False)
    except KilnError as e:
        # soft_wrap: the terminal wraps a long message; rich would cut a path in two ("…/c\nonfig.json")
        err.print(f"[red]error:[/red] {escape(str(e))}", highlight=False, soft_wrap=True)
        sys.exit(int(e.exit_code))
    except (typer.Exit, SystemExit) as e:
        sys.exit(getattr(e, "exit_code", getattr(e, "code", 0)))
    except KeyboardInterrupt:  # Ctrl-C outside a command (typer answers one inside with exit 130, below)
        _interrupted()
    except ClickException as e:  # typer's bundled click: unknown option, bad option value, no arguments
        if hasattr(e, "show"):
            e.show()
        else:
            err.print(f"[red]error:[/red] {escape(str(e))}", soft_wrap=True)
        sys.exit(int(ExitCode.BAD_INPUT))
    except Exception as e:  # noqa: BLE001 - the documented internal-error exit
        traceback.print_exc()
        err.print(f"[red]internal error:[/red] {type(e).__name__}: {escape(str(e))}", soft_wrap=True)
        sys.exit(int(ExitCode.INTERNAL_ERROR))
    if code == ExitCode.INTERRUPTED:  # typer turned Ctrl-C into a bare exit 130: it printed nothing
        _interrupted()
    sys.exit(code if isinstance(code, int) else 0)


def _interrupted() -> None:
    """Ctrl-C: exit 130, saying how to go on; `kiln run` continues the interrupted run's folder
    (kiln.pipeline.runner), so the hint is the command as typed."""
    if sys.argv[1:2] == ["run"]:
        again = shlex.join(["kiln", *sys.argv[1:]])
        err.print(f"interrupted; to resume, run the same command again: {again}", markup=False, soft_wrap=True)
    else:
        err.print("interrupted", markup=False)
    sys.exit(int(ExitCode.INTERRUPTED))


# After this file's commands, so `kiln --help` lists them first. cli_ops and cache_cmd import the app from
# cli_app, never from here: the arrow runs one way.
from kiln.pipeline.cli import ops as cli_ops  # noqa: E402,F401 - registers the serving, deploy and planning commands
from kiln.pipeline.cli import cache as cache_cmd  # noqa: E402,F401 - registers `kiln cache`
from kiln.pipeline.cli import policy as policy_cmd  # noqa: E402,F401 - registers `kiln policy`
from kiln.pipeline.cli import verify as verify_cmd  # noqa: E402,F401 - registers `kiln verify` and `kiln key`
