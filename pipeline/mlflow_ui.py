"""`kiln ui`'s server: MLflow's own app, whose page opens an experiment on its runs table.

MLflow 3.17 opens every experiment on its GenAI overview (empty for kiln) unless the browser has
chosen "Model training" in the sidebar; the choice is kept per browser in localStorage
(`mlflow.workflowType_v1`), and the experiment tag `mlflow.experimentKind` is not read. kiln's
experiments are model training, so the page this app serves makes that choice where the browser
has made none (a first visit), and leaves a choice the user made alone. Every other request is
MLflow's, unchanged. Registered as the MLflow app `kiln` (pyproject.toml, `mlflow.app`), started
by `mlflow server --app-name kiln`. Should a later MLflow rename the key, the page opens as
MLflow's own does and the browser test says so.
"""

from __future__ import annotations

import json
from typing import Any

KEY, VALUE = "mlflow.workflowType_v1", "machine_learning"
SEED = (f"<script>try{{if(localStorage.getItem({json.dumps(KEY)})===null)"
        f"localStorage.setItem({json.dumps(KEY)},{json.dumps(json.dumps(VALUE))})}}catch(e){{}}</script>").encode()
PAGES = ("/", "/index.html")

_mlflow: Any = None


def _inner() -> Any:
    global _mlflow
    if _mlflow is None:
        from mlflow.server.fastapi_app import app as mlflow_app  # reads the server's settings from its environment

        _mlflow = mlflow_app
    return _mlflow


class SeededUI:
    """ASGI: MLflow's app, with the seed at the top of the page's <head>. An object, not a function:
    MLflow's server takes an app that is a plain function for a factory and would call it."""

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        await _serve(scope, receive, send)


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
