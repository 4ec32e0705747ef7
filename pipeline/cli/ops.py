"""`kiln` commands around a finished run: serve it, route to it, walk a canary, move aliases,
compare runs, plan memory and capacity. Registered on the one `kiln` app (cli_app.py) when `cli.py` imports it."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Any

import typer

from kiln.engine.serve.admission import SERVE_ADMISSION
from kiln.pipeline.cli.app import (FreshOpt, JsonOpt, RecipeArg, RunArg, RunsOpt, SetOpt, app, console, port_option,
                                   size_option, typer_app)
from kiln.core.errors import BadInput
from kiln.core.home import runs_root, where_hint
from kiln.core.units import DEFAULT_CURRENCY

HostOpt = Annotated[str, typer.Option(help="bind address; loopback unless you mean otherwise (any other address "
                                           "needs an API key, or --insecure-no-api-key)")]
InsecureOpt = Annotated[bool, typer.Option("--insecure-no-api-key",
                                           help="serve a non-loopback --host with no API key: anyone who can reach "
                                                "it can use it")]
KeyEnvOpt = Annotated[str, typer.Option(help="env var holding the API key clients must send (unset: no key)")]
AdminKeyEnvOpt = Annotated[str, typer.Option(help="env var holding the key /admin/* needs (unset: the client key; "
                                                  "neither set: /admin is closed)")]
TrackingOpt = Annotated[str | None, typer.Option(help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else mlflow.db "
                                                      "in kiln's home)")]
ForceOpt = Annotated[bool, typer.Option("--force", help="go ahead with this one action though the verdict does not "
                                                        "verify or did not pass (needs --reason)")]
NameArg = Annotated[str, typer.Argument(help="the registered model's name (the recipe's tracking.registered_model, "
                                             "else its name)")]
ReasonOpt = Annotated[str | None, typer.Option(help="why --force: recorded with this action (on the version, and in "
                                                    "the champion history when champion moves)")]


def _forced(force: bool, reason: str | None) -> str | None:
    """The reason to override the gate, given only with both --force and a non-empty --reason."""
    if force and not (reason or "").strip():
        raise BadInput("--force: say why with --reason TEXT; the reason is recorded on the version and in the "
                       "champion history.")
    if reason and not force:
        raise BadInput("--reason: only with --force (it records why a version that did not pass goes ahead).")
    return reason.strip() if force and reason else None
deploy_app = typer_app(help="Canary rollouts: walk one where the recipe's deploy.target says (local: this machine; "
                            "kubernetes: a cluster, under Argo Rollouts), or render Argo Rollouts manifests.")
app.add_typer(deploy_app, name="deploy")


def _key(env_name: str) -> str | None:
    """The API key(s) in $env_name; None when it is unset. Set but holding no key (blank, ",", "a,,")
    is refused: a server started with it would say a key is required and serve open."""
    from kiln.engine.serve.admission import api_keys

    value = os.environ.get(env_name)
    api_keys(value, f"${env_name}")
    return value


def check_exposure(host: str, key: str | None, key_env: str, insecure: bool) -> None:
    """Refuse to open an unauthenticated server beyond this machine unless asked to in so many words."""
    import ipaddress

    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name other than localhost: may resolve anywhere
        loopback = False
    if not loopback and not key and not insecure:
        raise BadInput(f"--host {host}: not a loopback address, and ${key_env} holds no API key, so anyone who "
                       f"can reach {host} could use this server. Export {key_env}=<key> (clients send "
                       "'Authorization: Bearer <key>'), or pass --insecure-no-api-key to serve it open.")


def run_dir(run: str, runs: Path | None) -> Path:
    """A run's folder: RUN itself, or RUN under --runs (default: kiln's home)."""
    runs = runs_root(runs)
    d = Path(run) if Path(run).is_dir() else runs / run
    if not (d / "state.json").exists():
        raise BadInput(f"RUN: no run '{run}' under {runs}/ (see `kiln runs`; runs kept elsewhere: {where_hint()}).")
    return d


def engine_dir(target: str, role: str, runs: Path | None) -> Path:
    """An engine folder, or a run's engine for `role`."""
    from kiln.engine.base import REBUILD
    from kiln.core.files import read_json

    p = Path(target)
    if (p / "kiln-engine.json").exists():
        return p
    if p.is_dir() and not (p / "state.json").exists():
        raise BadInput(f"{target}: not an engine folder (no kiln-engine.json) nor a run (no state.json). {REBUILD}")
    stage = run_dir(target, runs) / "stages" / f"engine-{role}.json"
    if not stage.exists():
        raise BadInput(f"{target}: not an engine folder (no kiln-engine.json) and the run has no {role} engine.")
    return Path(read_json(Path(read_json(stage)["path"]) / "result.json")["engine_dir"])


def _queue_wait(value: str) -> float | str | None:
    """--queue-wait: 'auto', 'off' or seconds >= 0."""
    if value in ("auto", "off"):
        return None if value == "off" else value
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0 or seconds == float("inf"):
        raise BadInput(f"--queue-wait {value!r}: give 'auto', 'off' or a number of seconds >= 0.")
    return seconds


ApiKeyEnvOpt = Annotated[str, typer.Option(help="env var holding the API key clients must send; several "
                                               "comma-separated keys = several tenants (unset: no key)")]
MaxRunningOpt = Annotated[int | None, typer.Option(min=1, show_default="the engine's max_batch_size",
                                                   help="requests admitted at once (more than the engine "
                                                   "batches would wait inside it, unseen by --queue-wait)")]
MaxQueueOpt = Annotated[int | None, typer.Option(min=0, show_default="--max-running",
                                                 help="most requests waiting beyond --max-running")]
QueueWaitOpt = Annotated[str, typer.Option(help="queue a request only if its estimated wait for a slot fits: "
                                           "'auto' (half the median slot-to-first-token time, so admitted "
                                           "TTFT stays within 1.5x of at-capacity; with --ttft-slo-ms, what "
                                           "that leaves), seconds, or 'off' (--max-queue alone). Otherwise "
                                           "an immediate 429 whose Retry-After is the estimated wait")]
TtftSloOpt = Annotated[float | None, typer.Option(min=0, help="TTFT objective for --queue-wait auto "
                                                  "(`kiln deploy render` passes the recipe's)")]
RateLimitOpt = Annotated[float, typer.Option(min=0, help="requests/s per API key (token bucket); 0 = off")]
RateBurstOpt = Annotated[int, typer.Option(min=1, help="requests an API key may send at once before "
                                           "--rate-limit applies")]
DrainTimeoutOpt = Annotated[float, typer.Option(min=0, help="on SIGTERM: stop admitting, let in-flight "
                                                "requests finish for up to this many seconds, exit 0")]
RequestLogOpt = Annotated[str, typer.Option(help="one JSON line per request (queue time, TTFT, TPOT, tokens "
                                            "in/out): 'stderr', 'stdout', a file (appended) or 'off'")]


@app.command()
def serve(target: Annotated[str, typer.Argument(metavar="ENGINE_DIR|RUN", help="an engine folder (kiln-engine.json), "
                                                                             "or a run whose arm to serve")],
          role: Annotated[str, typer.Option(help="with a RUN: which arm to serve")] = "candidate",
          host: HostOpt = "127.0.0.1", port: Annotated[int, port_option("the server")] = 8000,
          api_key_env: ApiKeyEnvOpt = "KILN_API_KEY",
          served_model_name: Annotated[str | None, typer.Option(
              help="the name in /v1/models and in responses' `model` (default: a RUN's recipe name, with "
                   "-baseline for --role baseline; an engine folder's model folder name)")] = None,
          max_running: MaxRunningOpt = None, max_queue: MaxQueueOpt = None, queue_wait: QueueWaitOpt = "auto",
          ttft_slo_ms: TtftSloOpt = None, rate_limit: RateLimitOpt = 0,
          rate_burst: RateBurstOpt = SERVE_ADMISSION.rate_limit_burst,
          drain_timeout: DrainTimeoutOpt = SERVE_ADMISSION.drain_timeout_s, request_log: RequestLogOpt = "stderr",
          insecure_no_api_key: InsecureOpt = False, runs: RunsOpt = None,
          force: ForceOpt = False, reason: ReasonOpt = None) -> None:
    """Serve an engine behind an OpenAI-compatible API (/v1/completions, /v1/chat/completions, /health, /metrics).

    A RUN's candidate is served only once its signed verdict verifies against the bytes on disk and
    passed (`kiln verify RUN`); else exit 5 (not verified) or 2 (did not pass), unless --force --reason.
    A full queue answers 429 at once; SIGTERM drains (in-flight requests finish) and exits 0.
    Prints the cold start (boot, engine load, warm-up) when ready. An engine that fails to load,
    or a port in use, exits 2 with the fix.
    """
    from kiln.engine.serve.admission import log_requests_to
    from kiln.engine.loader import check_hardware, read_manifest
    from kiln.engine.serve.server import serve as serve_engine

    check_exposure(host, _key(api_key_env), api_key_env, insecure_no_api_key)
    reason = _forced(force, reason)
    d = engine_dir(target, role, runs)
    if not (Path(target) / "kiln-engine.json").exists():  # a run, not an engine folder
        run = run_dir(target, runs)
        if role == "candidate":
            verified_run(run, reason, "serve")
        served_model_name = served_model_name or _run_recipe(run).name + ("" if role == "candidate" else f"-{role}")
    check_hardware(read_manifest(d), d)  # the cheap checks before binding; the load itself follows
    admission = SERVE_ADMISSION.model_validate({
        **SERVE_ADMISSION.model_dump(), "max_concurrency": max_running, "max_queue": max_queue,
        "max_queue_wait_s": _queue_wait(queue_wait), "ttft_slo_ms": ttft_slo_ms or None,
        "rate_limit_rps": rate_limit or None, "rate_limit_burst": rate_burst, "drain_timeout_s": drain_timeout,
        "log_requests": request_log != "off"})
    if admission.log_requests:
        log_requests_to(request_log)

    console.print(f"serving {d} on http://{host}:{port}" + (" (API key required)" if _key(api_key_env) else ""))
    serve_engine(d, host=host, port=port, api_key=_key(api_key_env), model_name=served_model_name,
                 admission=admission, on_ready=_print_ready)
    console.print("drained and stopped")
    _exit_now()


def _print_ready(cold: dict[str, float]) -> None:
    console.print(f"ready in {cold['total_s']:.1f} s (boot {cold['boot_s']:.1f} s, engine load "
                  f"{cold['load_s']:.1f} s, warm-up {cold['warmup_s']:.1f} s)")


def _exit_now() -> None:
    """Exit 0 without the interpreter's teardown: finalizing torch and a loaded model took ~2.8 s
    after the drain had finished, which the pod's grace period (and --drain-timeout's promise)
    would have to cover. Logs and streams are flushed first; nothing else is left to save."""
    import logging
    import sys

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@app.command()
def tune(recipe: RecipeArg, set_: SetOpt = [],  # noqa: B006
         runs: RunsOpt = None,
         fresh: FreshOpt = []) -> None:  # noqa: B006
    """Tune the recipe's engine knobs (`tune`) on its candidate: every trial, the Pareto front, the winner.

    The same cached stage `kiln run` uses, so a later `kiln run` builds the winner without re-tuning.
    """
    from kiln.pipeline.recipe.model_source import resolve_model
    from kiln.pipeline.recipe.schema import load_recipe
    from kiln.pipeline.runner import _finish, start_run
    from kiln.pipeline.stages.optimize import quantize, tune_engine

    r = load_recipe(recipe, set_).single("kiln tune")
    if r.tune is None:
        raise BadInput(f"{recipe}: tune is not set; add `tune: {{space: {{max_batch_size: [1, 4, 8]}}}}` "
                       "beside engine (see recipes/demo-tune.yaml).")
    ctx = start_run(r, recipe, runs_root(runs), console, set(fresh))  # `--fresh tune`: tune again though this search ran
    try:
        art = quantize(ctx, "candidate", r.optimize, resolve_model(r.model.path, ctx.cache))
        outcome = tune_engine(ctx, art)
    except BaseException as e:
        _finish(ctx, "KILLED" if isinstance(e, KeyboardInterrupt) else "FAILED", None)
        raise
    _finish(ctx, "FINISHED", None)
    print((outcome.path / "trials.md").read_text())  # plain: a Markdown table must not be re-wrapped
    print(f"winner: {outcome.result['winner']}\nrun directory: {ctx.run_dir}")


@app.command("fake-engine")
def fake_engine(ttft_ms: Annotated[float, typer.Option(help="time to first token, ms")] = 50.0,
                tpot_ms: Annotated[float, typer.Option(help="time per output token after the first, ms")] = 10.0,
                capacity: Annotated[int | None, typer.Option(help="max concurrent generations (default unlimited)")] = None,
                slowdown: Annotated[float, typer.Option(help="multiplies TTFT and TPOT (a slower canary: 1.5)")] = 1.0,
                error_rate: Annotated[float, typer.Option(help="share of requests answered with a 500")] = 0.0,
                host: HostOpt = "127.0.0.1", port: Annotated[int, port_option("the fake engine")] = 8000,
                api_key_env: KeyEnvOpt = "KILN_API_KEY", insecure_no_api_key: InsecureOpt = False) -> None:
    """A fake engine streaming at a set TTFT/TPOT: for testing load generators, routers, canaries."""
    from kiln.engine.serve.fake import FakeEngineConfig, serve_fake

    key = _key(api_key_env)
    check_exposure(host, key, api_key_env, insecure_no_api_key)
    cfg = FakeEngineConfig(ttft_ms=ttft_ms, tpot_ms=tpot_ms, capacity=capacity, slowdown=slowdown, error_rate=error_rate)
    console.print(f"fake engine on http://{host}:{port}: TTFT {ttft_ms * slowdown:g} ms, TPOT {tpot_ms * slowdown:g} ms"
                  + (" (API key required)" if key else ""))
    serve_fake(cfg, host=host, port=port, api_key=key)


@app.command()
def route(stable: Annotated[str, typer.Option(help="stable backend URL (replicas of one engine: comma-separated)")],
          canary: Annotated[str | None, typer.Option(help="canary backend URL (replicas: comma-separated)")] = None,
          weight: Annotated[float, typer.Option(help="percent of traffic to the canary")] = 0.0,
          mirror_fraction: Annotated[float, typer.Option(
              help="share of greedy prompts also answered by the canary and by stable again, and scored")] = 0.0,
          host: HostOpt = "127.0.0.1", port: Annotated[int, port_option("the router")] = 8080,
          api_key_env: KeyEnvOpt = "KILN_API_KEY",
          upstream_api_key_env: Annotated[str, typer.Option(help="env var holding the key the router sends to both "
                                                                 "backends (unset: none)")] = "KILN_UPSTREAM_API_KEY",
          admin_key_env: AdminKeyEnvOpt = "KILN_ADMIN_KEY",
          insecure_no_api_key: InsecureOpt = False,
          balance: Annotated[str, typer.Option(help="how an arm's replicas share requests: prefix (by a hash of the "
                                                    "prompt prefix: warm prompt caches) or round-robin")] = "prefix",
          ) -> None:
    """One OpenAI-compatible entry point splitting traffic between a stable and a canary backend.

    Backends get the upstream key, never a client's credentials."""
    from kiln.deploy.config import RouterConfig
    from kiln.deploy.router_process import serve_router

    key, upstream, admin = _key(api_key_env), _key(upstream_api_key_env), _key(admin_key_env)
    check_exposure(host, key, api_key_env, insecure_no_api_key)
    from pydantic import ValidationError

    try:
        cfg = RouterConfig(host=host, port=port, stable_url=stable, canary_url=canary, weight=weight,
                           mirror_fraction=mirror_fraction, balance=balance)
    except ValidationError as e:
        raise BadInput(f"kiln route: {'; '.join(str(err['msg']) for err in e.errors())} (--stable, --canary, "
                       "--balance prefix|round-robin)") from None
    try:
        serve_router(cfg, api_key=key, upstream_api_key=upstream, admin_key=admin)
    except OSError as e:  # the port in use
        raise BadInput(f"--host/--port: cannot listen on {host}:{port} ({e.strerror or e}). Choose another "
                       "--port, or stop the process that holds it.") from None


def _run_recipe(d: Path):
    from kiln.pipeline.recipe.schema import load_recipe

    return load_recipe(d / "recipe.yaml")


@deploy_app.command("canary")
def deploy_canary(run: RunArg, runs: RunsOpt = None,
                  port: Annotated[int, port_option("the canary's router (deploy.target local)")] = 8080,
                  api_key_env: KeyEnvOpt = "KILN_API_KEY",
                  keep_serving: Annotated[bool, typer.Option(help="keep the router and the winner up afterwards "
                                                                  "(deploy.target local)")] = False,
                  force: ForceOpt = False, reason: ReasonOpt = None) -> None:
    """Walk a run's candidate through the recipe's canary steps against its baseline, where deploy.target says.

    local (the default): both engines and the router on this machine, judged live by the recipe's gate policy.
    kubernetes: the rendered manifests applied with kubectl (its current context) and Argo Rollouts' walk
    followed to its end; what the cluster lacks is named first. Either way the candidate is promoted (alias
    `champion` moves) or rolled back. A run that did not pass its gate is refused (exit 2) unless --force --reason TEXT.
    """
    from kiln.deploy.base import DeployRequest
    from kiln.deploy.run import deploy_canary as walk
    from kiln.pipeline.tracking.canary_journal import canary_journal
    from kiln.core.files import read_json

    d = run_dir(run, runs)
    recipe = _run_recipe(d)
    state = read_json(d / "state.json")
    if not (d / "registry.json").is_file():
        raise BadInput(f"RUN: {d.name} has no registered version (status {state.get('status', '?')}); "
                       "only a finished run's candidate can go out as a canary.")
    registry = read_json(d / "registry.json")
    reason = _forced(force, reason)
    from kiln.pipeline.tracking.registry import permit, record_override

    client = _client(recipe.tracking.uri)
    name, version = registry["name"], str(registry["version"])
    allowed = permit(client, name, version, reason, "deploy")  # the version, as the registry holds it
    verified_run(d, reason, "deploy")  # and this run: its verdict, and the bytes its engines serve from the cache
    if allowed.forced or reason:
        record_override(client, name, version, "deploy canary", reason or "")
    journal = canary_journal(recipe.tracking.uri, recipe.tracking.experiment, name, version,
                             state["mlflow_parent"], forced=reason)
    result = walk(DeployRequest(recipe.name, recipe.gate, recipe.deploy, engine_dir(str(d), "baseline", runs),
                                engine_dir(str(d), "candidate", runs), version=(name, version), journal=journal,
                                log=console.print, port=port, api_key=_key(api_key_env), keep_serving=keep_serving,
                                state_path=d / "deploy-state.json"))
    console.print(f"canary {result.status}: {result.reason}")
    raise typer.Exit(result.exit_code)


@deploy_app.command("render")
def deploy_render(recipe: RecipeArg, out: Annotated[Path, typer.Option(help="YAML file to write")] = Path("rollout.yaml"),
                  set_: SetOpt = [],  # noqa: B006
                  version: Annotated[str | None, typer.Option("--model-version", help="the registered version the "
                                                                    "manifests roll out; "
                                                                    "refused unless its run passed")] = None,
                  tracking_uri: TrackingOpt = None, force: ForceOpt = False, reason: ReasonOpt = None) -> None:
    """Render Argo Rollouts manifests (Rollout, AnalysisTemplates from the gate policy, Services, autoscaler, and
    with deploy.router.mirror_fraction > 0 the router in front of both arms), every pod on the image
    deploy.kubernetes.image:image_tag (by default kiln:<version>, what kiln's Dockerfile builds).

    With --model-version, the recipe's registered version is checked first (`kiln verify NAME VERSION`): one
    whose attestation does not verify (exit 5) or whose run did not pass (exit 2) is refused unless
    --force --reason TEXT, recorded on the version for this render alone."""
    from kiln.deploy.run import render_manifests
    from kiln.pipeline.tracking.registry import permit, record_override, registered_name
    from kiln.pipeline.recipe.schema import load_recipe

    r = load_recipe(recipe, set_)
    reason = _forced(force, reason)
    if version is not None:
        client = _client(tracking_uri or r.tracking.uri)
        if permit(client, registered_name(r), version, reason, "render a rollout of").forced:
            record_override(client, registered_name(r), version, "deploy render", reason or "")
    elif force:
        raise BadInput("--force: only with --model-version (the version whose gate it overrides).")
    render_manifests(r.name, r.gate, r.deploy, out, log=console.print,
                     verify=(registered_name(r), version) if version is not None else None)


def verified_run(d: Path, reason: str | None, what: str) -> Any:
    """The run's verified attestation (`kiln verify RUN`) when it passed; None when `reason` (--force) lets
    `what` go ahead without one. Else NotVerified (exit 5) or, verified and not passed, BadInput (exit 2)."""
    from kiln.core.errors import NotVerified
    from kiln.pipeline.provenance.attestation import verify_run

    try:
        verified = verify_run(d)
    except NotVerified as e:
        if reason:
            console.print(f"[yellow]! {e}; going ahead (--force: {reason})[/yellow]", markup=True, soft_wrap=True)
            return None
        raise NotVerified(f"{e}. kiln will not {what} it; pass --force --reason TEXT to override for this action.") from None
    p = verified.predicate
    if not p.get("passed") and not reason:
        raise BadInput(f"RUN: {d.name} ended {p.get('verdict')} (exit {p.get('exit_code')}); kiln will {what} only a run "
                       "that passed its gate. Pass --force --reason TEXT to override for this action.")
    return verified


def _client(tracking_uri: str | None):
    from kiln.pipeline.tracking.runs import open_client

    return open_client(tracking_uri)


@app.command()
def promote(name: NameArg, version: Annotated[str, typer.Argument(help="the version `champion` moves to")],
            tracking_uri: TrackingOpt = None, force: ForceOpt = False,
            reason: ReasonOpt = None) -> None:
    """Move the `champion` alias to VERSION (remembering the one it replaces, for rollback).

    A version whose run did not pass its gate is refused (exit 2) unless --force --reason TEXT."""
    from kiln.pipeline.tracking import registry as model_registry

    previous = model_registry.promote(_client(tracking_uri), name, version, _forced(force, reason))
    console.print(f"{name}: champion -> v{version}" + (f" (was v{previous})" if previous else ""))


@app.command()
def rollback(name: NameArg, to: Annotated[str | None, typer.Option(help="version to restore")] = None,
             tracking_uri: TrackingOpt = None, force: ForceOpt = False, reason: ReasonOpt = None) -> None:
    """Move `champion` back to the version it replaced (or --to VERSION), read from the champion history.

    The target is held to the promotion's rule: its run passed, or it carries a recorded --force reason."""
    from kiln.pipeline.tracking import registry as model_registry

    current, target = model_registry.rollback(_client(tracking_uri), name, to, _forced(force, reason))
    console.print(f"{name}: champion -> v{target} (rolled back from v{current})")


@app.command()
def compare(run_a: Annotated[str, typer.Argument(metavar="RUN_A", help="the run whose candidate is the bar")],
            run_b: Annotated[str, typer.Argument(metavar="RUN_B", help="the run whose candidate is judged, by its gate")],
            runs: RunsOpt = None) -> None:
    """Judge RUN_B's candidate against RUN_A's candidate with RUN_B's gate policy: the gate's own table.

    A ratio speed check is Inconclusive: the two were never measured as pairs (it shows B over A through
    a baseline both runs share); measure them in one run to judge it."""
    from kiln.core.files import read_json
    from kiln.evaluate.perf.compare import across_runs
    from kiln.pipeline.provenance.evidence import evidence_from_run
    from kiln.pipeline.report.report import CHECK_HEADER, check_rows

    a, b = run_dir(run_a, runs), run_dir(run_b, runs)
    baselines = {read_json(f)["key"] if (f := d / "stages" / "engine-baseline.json").is_file() else None for d in (a, b)}
    same_baseline = len(baselines) == 1 and None not in baselines
    outcome = across_runs(_run_recipe(b).gate, evidence_from_run(b), evidence_from_run(a), same_baseline)
    from rich.table import Table

    t = Table(*CHECK_HEADER, title=f"{b.name} vs {a.name}: {outcome.verdict.value}")
    for row in check_rows(outcome.results):
        t.add_row(*row)
    console.print(t)
    raise typer.Exit(int(outcome.exit_code))


@app.command("plan-memory")
def plan_memory_cmd(recipe: RecipeArg, set_: SetOpt = [],  # noqa: B006
                    context: Annotated[int, typer.Option(help="serving context in tokens")] = 4096,
                    batch: Annotated[int, typer.Option(help="concurrent sequences")] = 1,
                    kv_dtype: Annotated[str | None, typer.Option(help="KV cache dtype (default: the serving dtype)")] = None,
                    available: Annotated[str | None, typer.Option(
                        help="plan against this much memory (24G, 512M: powers of 1024) instead of what is free "
                             "here now: the machine the run is for")] = None,
                    as_json: JsonOpt = False) -> None:
    """How much memory each arm needs (the baseline and every candidate, one line each) to quantize, to
    serve, to run the parity check's torch reference, to build its engine and to be evaluated (both
    arms' engines in one process), against what is free; `kiln run` checks the same plan before it
    loads anything. Exit 2 with the numbers and the change that fits if one does not."""
    from kiln.optimize.memory import arms_table, check_arms
    from kiln.pipeline.stages.memory_plan import arm_plans, first_change
    from kiln.core.home import kiln_cache
    from kiln.pipeline.recipe.model_source import resolve_model
    from kiln.pipeline.recipe.schema import load_recipe

    r = load_recipe(recipe, set_)
    free = size_option("--available", available)
    model = resolve_model(r.model.path, kiln_cache())
    plans, fields = arm_plans(r, model.config, context=context, batch=batch, kv_dtype=kv_dtype, available=free)
    if as_json:  # the same exit 2 when an arm does not fit, after the document
        print(json.dumps({"arms": {name: {"optimize_engine": what, **plan.to_dict()} for name, (what, plan) in plans.items()},
                          "champions": [c.name for c in r.candidates or [] if c.champion]}, indent=2))
        check_arms(plans, fields, first=first_change(r, model.config))
        return
    if r.candidates is None:
        console.print(plans["candidate"][1].table())
    console.print(arms_table(plans))
    for c in r.candidates or []:
        if c.champion:
            console.print(f"{c.name}: the registry's champion, served as it was judged (not planned here)")
    check_arms(plans, fields, first=first_change(r, model.config))


@app.command("plan-capacity")
def plan_capacity_cmd(target_rps: Annotated[float, typer.Option(help="expected requests per second")],
                      goodput: Annotated[float, typer.Option(help="requests/s one replica serves within the SLO")],
                      headroom: Annotated[float, typer.Option(help="share of each replica's goodput left spare "
                                                                   "(0.2: plan replicas at 80%)")] = 0.2,
                      price_per_hour: Annotated[float | None, typer.Option(help="price of one replica-hour, for the "
                                                                           "cost per month")] = None,
                      currency: Annotated[str, typer.Option(help="what --price-per-hour is in: an ISO 4217 code "
                                                                 "(USD shows as $) or a symbol")] = DEFAULT_CURRENCY) -> None:
    """Replicas (and cost per month) to serve a target rate within the SLO."""
    from kiln.evaluate.capacity import plan_capacity

    console.print(plan_capacity(target_rps, goodput, headroom, price_per_hour, currency).table())
