"""`ServerThread`: the kiln server on a background thread and a free loopback port.

For tests, benches and notebooks that need a live OpenAI endpoint in-process (the `remote`
backend's tests talk to one). Production serving is `serve()` in server.py, run by `kiln serve`.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from pathlib import Path

from aiohttp import web

from kiln.engine.serve.admission import AdmissionConfig
from kiln.engine.base import Engine
from kiln.engine.serve.server import STATE, create_app

# What measurements serve behind: a load test measures the engine, so a request beyond the batch
# waits (as it would inside the engine) instead of being refused by `kiln serve`'s time-bounded
# queue; 32 running and 64 waiting were kiln serve's defaults when the load stages were calibrated.
LOAD_TEST_ADMISSION = AdmissionConfig(max_concurrency=32, max_queue=64)


class ServerThread:
    """The same server on a background thread and a free loopback port, for tests and benches.

    `engine` is an Engine (not closed on exit), a callable returning one, or a built engine dir.
    `admission`: queue bounds, rate limits and request logs (`kiln serve`'s own defaults are
    engine.admission.SERVE_ADMISSION).
    """

    def __init__(self, engine: Engine | Callable[[], Engine] | Path, api_key: str | None = None,
                 model_name: str | None = None, admission: AdmissionConfig = LOAD_TEST_ADMISSION):
        from kiln.engine.loader import load_engine

        if isinstance(engine, Engine):
            self._app = create_app(lambda: engine, api_key, model_name, owns_engine=False, admission=admission)
        else:
            load = engine if callable(engine) else (lambda: load_engine(Path(engine)))
            self._app = create_app(load, api_key, model_name, admission=admission)
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kiln-server", daemon=True)
        self.url = ""

    def _run(self) -> None:
        import uvloop

        self._loop = uvloop.new_event_loop()
        self._runner = web.AppRunner(self._app, handler_cancellation=True)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"
        self._started.set()
        self._loop.run_forever()
        self._loop.run_until_complete(self._runner.cleanup())
        self._loop.close()

    @property
    def status(self) -> str:
        return self._app[STATE].status

    def start(self, wait_ready: float | None = 120) -> ServerThread:
        self._thread.start()
        self._started.wait()
        deadline = time.monotonic() + (wait_ready or 0)
        while wait_ready and self.status != "ready" and time.monotonic() < deadline:
            if self.status.startswith("failed"):
                raise RuntimeError(f"server failed to start: {self.status}")
            time.sleep(0.02)
        return self

    def drain(self) -> bool:
        """What SIGTERM does to `kiln serve`: /health and new requests get 503, in-flight requests
        finish (up to the admission's drain_timeout_s). True when they all did; `stop()` after."""
        return asyncio.run_coroutine_threadsafe(self._app[STATE].admission.drain(), self._loop).result()

    def stop(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=60)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
