"""Running the router: in the foreground (`kiln route`) or as a subprocess driven from Python.

`serve_router(config)` is what `kiln route` runs: uvloop, one JSON log line per request on
stderr, drain on SIGTERM. `RouterProcess(config)` starts it in a child process (the controller and
any load generator then never share a GIL with it) and talks to its admin endpoints. API keys
travel through the environment, never the command line, so they do not show in `ps`. /admin always
needs a key: a RouterProcess given no client key makes its own admin key (secrets.token_urlsafe),
which only it holds, so nothing else on the machine can move its traffic.

The parent binds the listening socket and hands it to the child: if the router dies, connections
wait in the socket's backlog (none is refused) until `restart()` serves the same socket again, so
only the requests the dead router had accepted fail.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from typing import Any

from kiln.deploy.config import RouterConfig
from kiln.core.errors import KilnError

READY = "KILN_ROUTER_READY"
KEY_ENV, UPSTREAM_KEY_ENV, ADMIN_KEY_ENV = "KILN_ROUTER_API_KEY", "KILN_ROUTER_UPSTREAM_API_KEY", "KILN_ROUTER_ADMIN_KEY"


def serve_router(config: RouterConfig, api_key: str | None = None, upstream_api_key: str | None = None,
                 sock: socket.socket | None = None, admin_key: str | None = None) -> None:
    """Serve until SIGTERM/SIGINT, then drain. Prints `KILN_ROUTER_READY <port>` on stdout when up.
    `sock`: an already listening socket (from RouterProcess) instead of binding config.port.
    A blank key is BadInput (raised before anything binds); see router.py for who needs which key."""
    import uvloop

    from kiln.deploy.router import Router
    from kiln.engine.serve.admission import serve_until_drained

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    for name in ("kiln.requests", "kiln.serve"):
        logging.getLogger(name).addHandler(handler)
        logging.getLogger(name).setLevel(logging.INFO)
    router = Router(config, api_key, upstream_api_key, admin_key)
    keys = ("API key required" if router.keys else "no API key") + (
        ", /admin needs a key" if router.admin_keys else ", /admin closed (no key)")

    def ready(port: int) -> None:
        print(f"{READY} {port}", flush=True)
        print(f"kiln router on http://{config.host}:{port} (stable {config.stable_url}, canary "
              f"{config.canary_url or '-'} at {config.weight:g}%; {keys})", file=sys.stderr, flush=True)

    uvloop.run(serve_until_drained(router.app(), router.admission, config.host, config.port, ready, sock=sock))


def listening_socket(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(4096)
    sock.set_inheritable(True)
    return sock


class RouterProcess:
    """The router in a child process; `.url` once entered. Admin calls are plain blocking HTTP."""

    def __init__(self, config: RouterConfig, api_key: str | None = None, upstream_api_key: str | None = None,
                 log_path: str | None = None, start_timeout_s: float = 30, admin_key: str | None = None):
        """`admin_key`: what /admin needs; by default the (first) client key, or without one a key made
        here. Blank keys are refused here, before a child starts."""
        from kiln.deploy.proxy import upstream_key
        from kiln.engine.serve.admission import api_keys

        clients = api_keys(api_key, "api_key")  # these raise on a blank key, here rather than in the child
        upstream_key(upstream_api_key)
        api_keys(admin_key, "admin_key")
        self.config, self.api_key, self.upstream_api_key = config, api_key, upstream_api_key
        self.admin_key = admin_key or (clients[0].decode() if clients else secrets.token_urlsafe(32))
        self.log_path, self.start_timeout_s = log_path, start_timeout_s
        self.proc: subprocess.Popen[str] | None = None
        self.sock: socket.socket | None = None
        self.url = ""

    def __enter__(self) -> RouterProcess:
        try:
            self.sock = listening_socket(self.config.host, self.config.port)
        except OSError as e:
            raise KilnError(f"router cannot listen on {self.config.host}:{self.config.port}: {e}") from None
        self._spawn()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _spawn(self) -> None:
        assert self.sock is not None
        env = {**os.environ, KEY_ENV: self.api_key or "", UPSTREAM_KEY_ENV: self.upstream_api_key or "",
               ADMIN_KEY_ENV: self.admin_key}
        stderr = open(self.log_path, "a") if self.log_path else subprocess.DEVNULL  # noqa: SIM115 - owned by the child
        fd = self.sock.fileno()
        cmd = [sys.executable, "-m", "kiln.deploy.router_process", self.config.model_dump_json(), str(fd)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env, pass_fds=(fd,))
        from kiln.engine.serve.fake import _readline_with_timeout

        line = _readline_with_timeout(self.proc, self.start_timeout_s)
        if not line.startswith(READY):
            self.stop()
            raise KilnError(f"router did not start (first output: {line!r}); see {self.log_path or 'its stderr'}")
        self.url = f"http://{self.config.host}:{int(line.split()[1])}"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def restart(self, config: RouterConfig) -> None:
        """Serve the same socket again with `config` (after the router died)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.config = config
        self._spawn()

    def stop(self, timeout: float = 30) -> int | None:
        """SIGTERM (the router drains), then SIGKILL if it does not exit in time."""
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        return self.proc.returncode if self.proc else None

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        req = urllib.request.Request(self.url + path, method=method,
                                     data=json.dumps(body).encode() if body is not None else None)
        req.add_header("Content-Type", "application/json")
        req.add_header("Authorization", f"Bearer {self.admin_key}")
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise KilnError(f"router {method} {path}: HTTP {e.code}: {e.read()[:300]!r}") from None
        except OSError as e:
            raise KilnError(f"router {method} {path}: unreachable ({e})") from None

    def set_weight(self, weight: float) -> dict[str, Any]:
        return self._call("POST", "/admin/weight", {"weight": weight})

    def set_backends(self, stable_url: str, canary_url: str | None) -> dict[str, Any]:
        return self._call("POST", "/admin/backends", {"stable_url": stable_url, "canary_url": canary_url})

    def state(self) -> dict[str, Any]:
        return self._call("GET", "/admin/state")

    def observations(self, since: int = 0, mirror_since: int = 0) -> dict[str, Any]:
        return self._call("GET", f"/admin/observations?since={since}&mirror_since={mirror_since}")


if __name__ == "__main__":
    # `python -m kiln.deploy.router_process '<RouterConfig json>'`: what RouterProcess runs.
    # A second argument is the fd of a listening socket inherited from RouterProcess.
    inherited = socket.socket(fileno=int(sys.argv[2])) if len(sys.argv) > 2 else None
    # An empty variable is RouterProcess's "none" (it never passes a blank key: it refused those).
    serve_router(RouterConfig.model_validate_json(sys.argv[1]), os.environ.get(KEY_ENV) or None,
                 os.environ.get(UPSTREAM_KEY_ENV) or None, inherited, os.environ.get(ADMIN_KEY_ENV) or None)
