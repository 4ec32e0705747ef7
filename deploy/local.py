"""The local deploy target (the default, `deploy.target: local`): both arms and the router on this machine.

Each arm is a `kiln serve`-compatible server: one already running (url), one this target starts
(command, with "{port}" replaced by a free port, e.g. ["kiln", "serve", "ENGINE_DIR", "--port",
"{port}"]), or the fake engine (tests, demos). The router fronts both; clients use `target.url`.

Keys: the router sends its arms an upstream key and never a client's credentials, so the arms
this target starts are given that key (a fake arm as its api_key, a command arm as $KILN_API_KEY,
`kiln serve`'s default --api-key-env); with none given, one is made here, so the arms on loopback
answer only their router. The router's /admin always needs a key too (router_process.py makes one
when there is no client key).

promote(): the router's stable arm is pointed at the canary's server, the old stable finishes
what it is serving and is stopped. rollback(): weight 0, the canary finishes and is stopped. In
both cases no request in flight is cut: the router retires a backend only once it is idle.

If the router dies, a watchdog restarts it at once on the same listening socket (connections wait
in its backlog meanwhile) with stable only: the walk's observations died with it, so the next
call from the controller raises RouterRestarted and the controller rolls back. Stable keeps
serving throughout; only the requests the dead router had accepted fail.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from pydantic import model_validator

from kiln.deploy.base import DeployRequest, DeployTarget, Observations, observations_from
from kiln.deploy.config import RouterConfig, RouterOptions, Section
from kiln.deploy.proxy import upstream_key
from kiln.deploy.router_process import RouterProcess
from kiln.deploy.targets import TARGETS
from kiln.engine.serve.admission import api_keys
from kiln.engine.serve.fake import FakeEngineConfig, FakeServer
from kiln.engine.remote import free_port, wait_healthy
from kiln.core.errors import BadInput, KilnError

R = TypeVar("R")
ARM_KEY_ENV = "KILN_API_KEY"  # where a command arm (`kiln serve`, by default) reads the key its router sends


class BackendSpec(Section):
    """How one arm gets served: exactly one of url, command, fake."""

    url: str | None = None
    command: list[str] | None = None
    fake: FakeEngineConfig | None = None
    health_timeout_s: float = 600

    @model_validator(mode="after")
    def _one(self) -> BackendSpec:
        given = [k for k in ("url", "command", "fake") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"set exactly one of url, command, fake (got {given or 'none'})")
        if self.command is not None and not any("{port}" in part for part in self.command):
            raise ValueError("command must contain '{port}' where the server's port goes")
        return self


@dataclass
class Arm:
    url: str
    handle: Any = None  # FakeServer or Popen, None for a server this target did not start

    @property
    def pid(self) -> int | None:
        return getattr(self.handle, "pid", None)

    def stop(self) -> None:
        if isinstance(self.handle, FakeServer):
            self.handle.__exit__(None, None, None)
        elif isinstance(self.handle, subprocess.Popen) and self.handle.poll() is None:
            self.handle.terminate()  # kiln serve drains on SIGTERM
            try:
                self.handle.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.handle.kill()
                self.handle.wait()
        self.handle = None


def start_arm(spec: BackendSpec, api_key: str | None) -> Arm:
    """Start (or wait for) one arm; an arm started here requires `api_key`, the one its router sends."""
    if spec.fake is not None:
        return Arm((server := FakeServer(spec.fake, api_key=api_key).__enter__()).url, server)
    if spec.url is not None:
        wait_healthy(spec.url.rstrip("/"), spec.health_timeout_s, name="backend")
        return Arm(spec.url.rstrip("/"))
    port = free_port()
    cmd = [part.replace("{port}", str(port)) for part in spec.command or []]
    try:
        env = {k: v for k, v in os.environ.items() if k != ARM_KEY_ENV} | ({ARM_KEY_ENV: api_key} if api_key else {})
        proc = subprocess.Popen(cmd, env=env)
    except OSError as e:
        raise BadInput(f"backend command {cmd[0]!r} cannot start: {e}. Check the command (e.g. 'kiln serve').") from None
    arm = Arm(f"http://127.0.0.1:{port}", proc)
    try:
        wait_healthy(arm.url, spec.health_timeout_s, proc, "backend")
    except KilnError:
        arm.stop()
        raise
    return arm


def kiln_serve(engine_dir: str | Path) -> BackendSpec:
    """An arm served by `kiln serve ENGINE_DIR` on a free port, with the interpreter kiln runs under
    (a `kiln` on PATH may be another install, or none without an activated venv)."""
    return BackendSpec(command=[sys.executable, "-m", "kiln.pipeline", "serve", str(engine_dir), "--port", "{port}"])


class RouterRestarted(KilnError):
    """The router died and was restarted with stable only; the walk cannot go on."""


@TARGETS.register("local", RouterOptions)
class LocalTarget(DeployTarget):
    name = "local"

    def __init__(self, stable: BackendSpec, canary: BackendSpec, options: RouterOptions | None = None, port: int = 0,
                 api_key: str | None = None, upstream_api_key: str | None = None, log_path: str | None = None,
                 keep_serving: bool = False, log: Callable[[str], None] = print):
        """keep_serving: after a walk (`walk`), keep the router and the winning arm up until SIGTERM/SIGINT
        (a real local deployment); otherwise the walk's end stops everything."""
        self.specs = {"stable": stable, "canary": canary}
        self.options, self.port = options or RouterOptions(), port
        api_keys(api_key, "api_key")  # a blank key is refused before any arm starts
        self.api_key, self.log_path, self.keep_serving, self.log = api_key, log_path, keep_serving, log
        self.upstream_api_key = upstream_key(upstream_api_key) or secrets.token_urlsafe(32)  # its arms need one
        self.arms: dict[str, Arm] = {}
        self.router: RouterProcess | None = None
        self.restarts: list[int | None] = []  # exit codes of routers that died and were replaced
        self.restart_failures: list[str] = []  # restarts that failed (each retried, backing off to 2 s)
        self._reported = 0
        self._closing = threading.Event()
        self._lock = threading.Lock()
        self._watchdog: threading.Thread | None = None

    @classmethod
    def open(cls, request: DeployRequest) -> LocalTarget:
        """Both engines served by `kiln serve` on this machine behind the router on request.port. A walk
        whose controller died (request.state_path says walking) is rolled back first."""
        target = cls(kiln_serve(request.stable), kiln_serve(request.candidate), request.deploy.router,
                     port=request.port, api_key=request.api_key, log_path=request.log_path,
                     keep_serving=request.keep_serving, log=request.log)  # refuses a blank key first
        if request.state_path is not None:
            from kiln.deploy.canary import recover_crashed_walk  # the controller's statistics load scipy: not at import

            recover_crashed_walk(request.state_path, request.api_key, request.log)
        return target

    def walk(self, controller: Callable[[DeployTarget], R]) -> R:
        self.log(f"kiln deploy: router on {self.url}")
        result = controller(self)
        if self.keep_serving:
            _wait_for_signal(self.log, self.url)
        return result

    @property
    def url(self) -> str:
        assert self.router is not None, "enter the target first (with LocalTarget(...) as target)"
        return self.router.url

    def __enter__(self) -> LocalTarget:
        try:
            for arm in ("stable", "canary"):
                self.arms[arm] = start_arm(self.specs[arm], self.upstream_api_key)
            config = RouterConfig(**self.options.model_dump(), port=self.port, stable_url=self.arms["stable"].url,
                                  canary_url=self.arms["canary"].url, weight=0)
            self.router = RouterProcess(config, self.api_key, self.upstream_api_key, self.log_path).__enter__()
        except BaseException:
            self.close()
            raise
        self._watchdog = threading.Thread(target=self._watch, name="kiln-router-watchdog", daemon=True)
        self._watchdog.start()
        return self

    def _watch(self) -> None:
        pause = 0.05
        while not self._closing.wait(pause):
            with self._lock:
                router = self.router
                if router is None or router.alive() or self._closing.is_set():
                    continue
                code = router.proc.returncode if router.proc else None
                canary = self.arms.get("canary")
                try:
                    router.restart(router.config.model_copy(update={
                        "stable_url": self.arms["stable"].url, "canary_url": canary.url if canary else None,
                        "weight": 0}))
                except Exception as e:  # noqa: BLE001 - a failed restart is retried, never the end of the watch
                    self.restart_failures.append(f"{type(e).__name__}: {e}")
                    pause = min(2.0, pause * 2)  # back off while it keeps failing
                    continue
                pause = 0.05
                self.restarts.append(code)

    def describe(self) -> dict[str, Any]:
        """What a controller that crashed would need to find and clean up: urls and process ids."""
        router = self.router
        return {"router_url": router.url if router else None,
                "router_pid": router.proc.pid if router and router.proc else None,
                "arms": {name: {"url": arm.url, "pid": arm.pid} for name, arm in self.arms.items()}}

    def set_traffic(self, weight: float) -> None:
        self._admin(lambda r: r.set_weight(weight))

    def observe(self, cursor: tuple[int, int] = (0, 0)) -> Observations:
        return observations_from(self._admin(lambda r: r.observations(*cursor)))

    def _admin(self, call: Any) -> Any:
        """An admin call; a router that died before or during it surfaces as RouterRestarted."""
        try:
            return call(self._router())
        except RouterRestarted:
            raise
        except KilnError:
            deadline = time.monotonic() + 10  # the watchdog restarts within a router start-up
            while len(self.restarts) == self._reported and time.monotonic() < deadline:
                time.sleep(0.05)
            self._router()  # raises RouterRestarted if it was restarted
            raise

    def promote(self) -> None:
        router = self._router()
        router.set_backends(self.arms["canary"].url, None)
        self._retire("stable")
        self.arms["stable"] = self.arms.pop("canary")

    def rollback(self) -> None:
        router = self._router()
        router.set_weight(0)
        router.set_backends(self.arms["stable"].url, None)
        self._retire("canary")
        self.arms.pop("canary", None)

    def _retire(self, arm: str, timeout_s: float = 120) -> None:
        """Stop an arm's server once the router has no request left on it."""
        deadline = time.monotonic() + timeout_s
        while self._router().state()["retiring"] and time.monotonic() < deadline:
            time.sleep(0.05)
        if arm in self.arms:
            self.arms[arm].stop()

    def _router(self) -> RouterProcess:
        if self.router is None:
            raise KilnError("the local target is not running: use it as a context manager")
        if len(self.restarts) > self._reported:
            self._reported = len(self.restarts)
            raise RouterRestarted(f"the router died (exit code {self.restarts[-1]}) and was restarted on the same "
                                  "port with all traffic on stable; the walk's observations died with it")
        return self.router

    def close(self) -> None:
        self._closing.set()
        if self._watchdog is not None:
            self._watchdog.join()
        if self.router is not None:
            self.router.stop()
            self.router = None
        for arm in self.arms.values():
            arm.stop()
        self.arms.clear()


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
