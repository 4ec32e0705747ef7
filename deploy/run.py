"""Entry points for the CLI: `kiln deploy canary`, `kiln deploy render`, `kiln route`.

Each is a few lines of composition over the pieces in this package, so the CLI stays thin:
- deploy_canary: the recipe's `deploy.target`, resolved in the registry (targets.py), opened for the
  run's two engines and walked: what `kiln deploy canary` runs, whatever the target;
- deploy_local: the local target's walk for arms given as BackendSpecs (a URL, a command, the fake engine);
- render_manifests: write the Kubernetes/Argo Rollouts manifests for the same policy;
- `kiln route` is `kiln.deploy.router_process.serve_router(RouterConfig(...), api_key)`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from kiln.deploy.base import DeployRequest, DeployTarget
from kiln.deploy.canary import CanaryResult, recover_crashed_walk, run_canary
from kiln.deploy.config import DeployConfig
from kiln.deploy.journal import CanaryJournal
from kiln.deploy.kubernetes import Rendered, render
from kiln.deploy.local import BackendSpec, LocalTarget, kiln_serve
from kiln.deploy.targets import TARGETS
from kiln.core.gate.policy import GateSection

__all__ = ["deploy_canary", "deploy_local", "kiln_serve", "render_manifests"]


def deploy_canary(request: DeployRequest) -> CanaryResult:
    """`kiln deploy canary`: the target `request.deploy.target` names (an unknown name is BadInput with
    "Did you mean"), opened for the request and walked; its outcome."""
    target = TARGETS.get(request.deploy.target)
    return _walk(target.open(request), request.policy, request.deploy, request.journal, request.log,
                 request.state_path)


def _walk(target: DeployTarget, policy: GateSection, deploy: DeployConfig, journal: CanaryJournal | None,
          log: Callable[[str], None], state_path: Path | None) -> CanaryResult:
    with target as started:
        log(f"kiln deploy ({started.name}): canary walk: " + ", ".join(f"{s.weight:g}%" for s in deploy.steps))
        return started.walk(lambda t: run_canary(t, policy, deploy, journal, log, state_path=state_path))


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
    target = LocalTarget(stable, candidate, deploy.router, port=port, api_key=api_key,
                         upstream_api_key=upstream_api_key, log_path=log_path, keep_serving=keep_serving, log=log)
    if state_path is not None:
        recover_crashed_walk(state_path, api_key, log)
    return _walk(target, policy, deploy, journal, log, state_path)


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
