"""`kiln ui`'s server: MLflow's own app, whose page opens an experiment on its runs table.

MLflow 3.17 opens every experiment on its GenAI overview (empty for kiln) unless the browser has
chosen "Model training" in the sidebar; the choice is kept per browser in localStorage
(`mlflow.workflowType_v1`), and the experiment tag `mlflow.experimentKind` is not read. kiln's
experiments are model training, so the page this app serves makes that choice where the browser
has made none (a first visit), and leaves a choice the user made alone. The same way it starts the
MLflow assistant's chat panel closed (its button stays): opened on a first visit, it takes a quarter
of the page, where the runs table's verdict and figures columns go, for a chat that needs an LLM
provider kiln does not set up. Every other request is MLflow's, unchanged. Registered as the MLflow app `kiln` (pyproject.toml, `mlflow.app`), started
by `mlflow server --app-name kiln`. Should a later MLflow rename the key, the page opens as
MLflow's own does and the browser test says so.

It also holds the door. MLflow's server has no login of its own (short of its `basic-auth` app and
user database), and anyone who reaches it can move a registered model's `champion` alias. When
`kiln ui` is given an API key it hands it over in $KILN_UI_API_KEY (never on the command line), and
every request but /health (probes) must carry it: `Authorization: Bearer <key>` (an MLflow client
with MLFLOW_TRACKING_TOKEN=<key>), or HTTP Basic with the key as the password (a browser's login
prompt, any user name). Anything else gets 401 with `WWW-Authenticate: Basic`, so a browser asks.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import json
import os
from typing import Any

KEY, VALUE = "mlflow.workflowType_v1", "machine_learning"
# What a browser that has chosen nothing gets (localStorage key -> value as MLflow's UI stores it).
FIRST_VISIT = {KEY: json.dumps(VALUE), "mlflow.assistant.fab.autoOpenedOnFirstLoad_v1": "true",
               "mlflow.assistant.panelOpen_v1": "false"}
SEED = ("<script>try{" + "".join(f"if(localStorage.getItem({json.dumps(k)})===null)"
                                  f"localStorage.setItem({json.dumps(k)},{json.dumps(v)});" for k, v in FIRST_VISIT.items())
        + "}catch(e){}</script>").encode()
PAGES = ("/", "/index.html")
UI_KEY_ENV = "KILN_UI_API_KEY"  # set by `kiln ui` (pipeline/cli/main.py) for the server process it starts
OPEN = ("/health",)

_mlflow: Any = None


def _inner() -> Any:
    global _mlflow
    if _mlflow is None:
        from mlflow.server.fastapi_app import app as mlflow_app  # reads the server's settings from its environment

        _mlflow = mlflow_app
    return _mlflow


class SeededUI:
    """ASGI: MLflow's app behind `kiln ui`'s API key (when it has one), with the seed at the top of
    the page's <head>. An object, not a function:
    MLflow's server takes an app that is a plain function for a factory and would call it."""

    def __init__(self) -> None:
        from kiln.engine.serve.admission import api_keys

        # Read where the server imports this app: a blank key stops it starting, never serves open.
        self.keys = api_keys(os.environ.get(UI_KEY_ENV), f"${UI_KEY_ENV}")

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if self.keys and scope["type"] in ("http", "websocket") and scope.get("path") not in OPEN \
                and not _authorized(dict(scope.get("headers") or []).get(b"authorization", b""), self.keys):
            await _refuse(scope, receive, send)
            return
        await _serve(scope, receive, send)


def _authorized(header: bytes, keys: list[bytes]) -> bool:
    """Bearer <key>, or Basic <user:key> (any user name); constant-time against every key."""
    scheme, _, value = header.strip().partition(b" ")
    sent = value.strip()
    if scheme.lower() == b"basic":
        try:
            sent = base64.b64decode(sent, validate=True).partition(b":")[2]
        except (binascii.Error, ValueError):
            return False
    elif scheme.lower() != b"bearer":
        return False
    return bool(sent) and any([hmac.compare_digest(sent, key) for key in keys])


async def _refuse(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "websocket":
        await receive()  # websocket.connect
        await send({"type": "websocket.close", "code": 1008})
        return
    body = json.dumps({"error_code": "UNAUTHENTICATED", "message": "kiln ui needs its API key: 'Authorization: "
                       "Bearer <key>' (MLFLOW_TRACKING_TOKEN), or log in with the key as the password."}).encode()
    await send({"type": "http.response.start", "status": 401, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        (b"www-authenticate", b'Basic realm="kiln ui", charset="UTF-8"')]})
    await send({"type": "http.response.body", "body": body})


async def _serve(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http" or scope.get("method") != "GET" or scope.get("path") not in PAGES:
        await _inner()(scope, receive, send)
        return
    start: dict[str, Any] = {}
    body: list[bytes] = []

    async def seeded(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            start.update(message)
            return
        body.append(message.get("body", b""))
        if message.get("more_body"):
            return
        page = b"".join(body)
        if start.get("status") == 200 and b"<head>" in page:
            page = page.replace(b"<head>", b"<head>" + SEED, 1)
        headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
        await send({**start, "headers": [*headers, (b"content-length", str(len(page)).encode())]})
        await send({"type": "http.response.body", "body": page})

    await _inner()(scope, receive, seeded)


app = SeededUI()
