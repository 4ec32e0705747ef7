"""The bearer-key check of kiln's three aiohttp apps: `kiln serve`, the fake engine and the router.

Each app states which paths need which keys as `Zone`s, first match wins; /health and /metrics stay
open (probes and Prometheus reach them without a key, as vLLM's do), as does any path no zone covers.
Keys are compared in constant time, every key (admission.key_matches). A refusal is a 401 in the
OpenAI error shape, which the openai client raises as AuthenticationError, with the
`WWW-Authenticate: Bearer` header RFC 6750 asks of a 401.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from kiln.engine.serve.admission import key_matches

OPEN_PATHS = ("/health", "/metrics")
WRONG_KEY = "Missing or wrong API key (send 'Authorization: Bearer <key>')."


@dataclass(frozen=True)
class Zone:
    """Paths that start with `prefix` need one of `keys`. Without keys the zone is open, unless
    `closed` is set: then it is shut to everyone, and `closed` says why and how to open it."""

    prefix: str
    keys: Sequence[bytes]
    closed: str | None = None


def unauthorized(message: str = WRONG_KEY) -> web.Response:
    body = {"error": {"message": message, "type": "authentication_error", "param": None, "code": 401}}
    return web.json_response(body, status=401, headers={"WWW-Authenticate": "Bearer"})


class BearerAuth:
    """The check (`refusal`) and the aiohttp middleware that applies it (`middleware`)."""

    def __init__(self, zones: Sequence[Zone], open_paths: Sequence[str] = OPEN_PATHS):
        self.zones, self.open_paths = tuple(zones), tuple(open_paths)

    def zone(self, path: str) -> Zone | None:
        if path in self.open_paths:
            return None
        return next((z for z in self.zones if path.startswith(z.prefix)), None)

    def refusal(self, request: web.Request) -> web.Response | None:
        """The 401 for `request`, or None when it may pass."""
        zone = self.zone(request.path)
        if zone is None:
            return None
        if not zone.keys:
            return unauthorized(zone.closed) if zone.closed else None
        return None if key_matches(request.headers.get("Authorization", ""), list(zone.keys)) else unauthorized()

    @web.middleware
    async def middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        refusal = self.refusal(request)
        return await handler(request) if refusal is None else refusal
