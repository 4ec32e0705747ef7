"""The scrubbing that keeps credentials out of what kiln writes and prints."""

from __future__ import annotations

import io
import logging

import pytest

from kiln.core import credentials as secrets
from kiln.core.files import atomic_write_json, atomic_write_text


@pytest.fixture(autouse=True)
def no_known_secrets(monkeypatch):
    monkeypatch.setattr(secrets, "_known", set())


def test_uri_password_and_its_encoded_forms_are_masked():
    secrets.remember_uri("https://alice:p%40ss%2Fw0rd@mlflow.example/")
    text = "p@ss/w0rd | p%40ss%2Fw0rd | https://alice:p%40ss%2Fw0rd@mlflow.example/"
    assert secrets.scrub(text) == "*** | *** | https://alice:***@mlflow.example/"
    secrets.remember_uri("https://tok3n-only@host/")  # a token as the user name
    assert secrets.scrub("tok3n-only") == "***"


def test_environment_credentials(monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", "dapi-123456")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wJalrXUtnFEMI")
    secrets.remember_environment()
    assert secrets.scrub("token dapi-123456 key wJalrXUtnFEMI") == "token *** key ***"


def test_short_values_are_not_treated_as_secrets():
    secrets.remember("ab")
    assert secrets.scrub("a b ab") == "a b ab"


def test_files_streams_and_log_records(tmp_path):
    secrets.remember("hunter2-long")
    atomic_write_text(tmp_path / "a.txt", "pw=hunter2-long")
    atomic_write_json(tmp_path / "b.json", {"uri": "http://u:hunter2-long@h", "hunter2-long": 1})
    assert "hunter2" not in (tmp_path / "a.txt").read_text() + (tmp_path / "b.json").read_text()
    inner = io.StringIO()
    stream = secrets.ScrubbingStream(inner)
    print("see hunter2-long", file=stream)
    assert inner.getvalue() == "see ***\n" and stream.getvalue() == "see ***\n"  # other attributes delegate
    record = logging.LogRecord("kiln", logging.INFO, __file__, 1, "connect %s", ("http://u:hunter2-long@h",), None)
    secrets.ScrubFilter().filter(record)
    assert record.getMessage() == "connect http://u:***@h"
