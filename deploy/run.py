"""Entry points for the CLI: `kiln deploy` (local canary walk), `kiln deploy render`, `kiln route`.

Each is a few lines of composition over the pieces in this package, so the CLI stays thin:
- deploy_local: start both arms and the router, walk the canary, promote or roll back;
- render_manifests: write the Kubernetes/Argo Rollouts manifests for the same policy;
- `kiln route` is `kiln.deploy.router_process.serve_router(RouterConfig(...), api_key)`.
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from kiln.deploy.canary import CanaryResult, recover_crashed_walk, run_canary
from kiln.deploy.config import DeployConfig
from kiln.deploy.journal import CanaryJournal
from kiln.deploy.kubernetes import Rendered, render
from kiln.deploy.local import BackendSpec, LocalTarget
from kiln.core.gate.policy import GateSection


def kiln_serve(engine_dir: str | Path) -> BackendSpec:
    """An arm served by `kiln serve ENGINE_DIR` on a free port, with the interpreter kiln runs under
    (a `kiln` on PATH may be another install, or none without an activated venv)."""
    return BackendSpec(command=[sys.executable, "-m", "kiln.pipeline", "serve", str(engine_dir), "--port", "{port}"])


def deploy_local(policy: GateSection, deploy: DeployConfig, stable: BackendSpec, candidate: BackendSpec, *,
                 port: int = 8080, api_key: str | None = None, upstream_api_key: str | None = None,
                 journal: CanaryJournal | None = None, keep_serving: bool = False,
                 log: Callable[[str], None] = print, log_path: str | None = None,
                 state_path: Path | None = None) -> CanaryResult:
    """Walk a canary on this machine. Clients send traffic to http://127.0.0.1:<port> meanwhile.

    journal: what records the walk and settles the version (kiln.pipeline.tracking.canary_journal for
    MLflow); by default nothing is recorded.
    keep_serving: after the walk, keep the router and the winning arm up until SIGTERM/SIGINT
    (a real local deployment); otherwise stop everything and return.
    state_path: the walk's state, written at every change; a walk whose controller died (the
    state says walking) is rolled back first, then this one starts.
    """
    if state_path is not None:
        recover_crashed_walk(state_path, api_key, log)
    with LocalTarget(stable, candidate, deploy.router, port=port, api_key=api_key,
                     upstream_api_key=upstream_api_key, log_path=log_path) as target:
        log(f"kiln deploy: router on {target.url}; canary walk: "
            + ", ".join(f"{s.weight:g}%" for s in deploy.steps))
        result = run_canary(target, policy, deploy, journal, log, state_path=state_path)
        if keep_serving:
            _wait_for_signal(log, target.url)
    return result


def _wait_for_signal(log: Callable[[str], None], url: str) -> None:
    stop = {"now": False}

    def handler(*_: object) -> None:
        stop["now"] = True

    old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    log(f"kiln deploy: serving on {url} until SIGTERM / Ctrl-C")
    try:
        while not stop["now"]:
            time.sleep(0.5)
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def render_manifests(name: str, policy: GateSection, deploy: DeployConfig, out: Path,
                     log: Callable[[str], None] = print, verify: tuple[str, str] | None = None) -> Rendered:
    """Write the manifests to `out` (one YAML file, atomically) and report what was skipped. `verify`:
    the registered (model, version) each pod checks before it serves."""
    rendered = render(name, policy, deploy, verify)
    rendered.write(out)
    for warning in rendered.warnings:
        log(f"warning: {warning}")
    log(f"kiln deploy render: {len(rendered.documents)} manifests -> {out}")
    return rendered
