"""One bearer-key check (engine/serve/auth.py) for kiln's three aiohttp apps: `kiln serve`, the fake engine and
the router, each running for real on 127.0.0.1 and asked the same questions."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest

from kiln.deploy.config import RouterConfig
from kiln.deploy.router_process import RouterProcess
from kiln.engine.serve.fake import FakeEngineConfig, FakeServer
from kiln.engine.serve.server_thread import ServerThread

KEY = "the-one-key"


def _ask(url: str, authorization: str | None) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(url, headers={"Authorization": authorization} if authorization else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


@pytest.fixture(scope="module")
def apps(served_engine):
    """name -> base URL of each app, all three holding KEY; the router's stable arm is the fake engine."""
    with ServerThread(served_engine, api_key=KEY, model_name="tiny") as serve, \
            FakeServer(FakeEngineConfig(model="tiny"), api_key=KEY) as fake, \
            RouterProcess(RouterConfig(port=0, stable_url=fake.url), api_key=KEY, upstream_api_key=KEY) as router:
        yield {"kiln serve": serve.url, "fake engine": fake.url, "router": router.url}


@pytest.mark.parametrize("name", ["kiln serve", "fake engine", "router"])
def test_every_app_answers_a_key_the_same_way(apps, name):
    url = apps[name]
    refusals = [_ask(url + "/v1/models", auth) for auth in (None, "Bearer wrong", f"Basic {KEY}", "Bearer ")]
    for status, headers, body in refusals:
        assert status == 401 and headers["WWW-Authenticate"] == "Bearer", (name, status, headers)
        assert json.loads(body) == {"error": {"message": "Missing or wrong API key (send 'Authorization: Bearer "
                                              "<key>').", "type": "authentication_error", "param": None, "code": 401}}
    for auth in (f"Bearer {KEY}", f"bearer  {KEY}"):  # the scheme is case-insensitive (RFC 7235)
        status, _, body = _ask(url + "/v1/models", auth)
        assert status == 200 and json.loads(body)["data"][0]["id"] == "tiny", (name, auth)
    for path in ("/health", "/metrics"):  # probes and scrapers carry no key
        assert _ask(url + path, None)[0] == 200, (name, path)
    client = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()
    assert [m.id for m in openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0).models.list()] == ["tiny"]


def test_what_each_app_guards_beyond_v1(apps):
    """The apps differ only in their zones: `kiln serve` guards every path but the open ones (an unknown path
    is 401 before it is 404), the fake engine /v1 and /fake, the router /v1 and /admin."""
    assert _ask(apps["kiln serve"] + "/nowhere", None)[0] == 401
    assert _ask(apps["kiln serve"] + "/nowhere", f"Bearer {KEY}")[0] == 404
    assert _ask(apps["fake engine"] + "/nowhere", None)[0] == 404
    assert _ask(apps["fake engine"] + "/fake/stats", None)[0] == 401
    assert _ask(apps["fake engine"] + "/fake/stats", f"Bearer {KEY}")[0] == 200
    assert _ask(apps["router"] + "/admin/state", "Bearer wrong")[0] == 401
    assert _ask(apps["router"] + "/admin/state", f"Bearer {KEY}")[0] == 200  # the client key, with no admin key
    assert _ask(apps["router"] + "/nowhere", None)[0] == 404
