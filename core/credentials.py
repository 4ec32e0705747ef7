"""Credentials kiln holds, and the scrubbing that keeps them out of everything it writes or prints.

A team's tracking server takes a password (in the URI, `http://user:pass@host`, or in
`MLFLOW_TRACKING_PASSWORD`), a token, or S3 keys. kiln never needs to show any of them, yet they
reach many places: the resolved recipe, MLflow params, MLflow's own "View run … at <uri>" lines,
error messages that quote a URI. Redacting at each place misses the next one, so the scrubbing
sits where bytes leave the process: every text file kiln writes (`kiln.core.files`), every
MLflow param and tag (`Tracker.log`), the run log, and the CLI's stdout and stderr.
"""

from __future__ import annotations

import logging
import os
import sys
import urllib.parse
from typing import Any, TextIO

# Environment variables whose values are credentials (MLflow's and S3's own names).
SECRET_ENV = ("MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
MASK = "***"
_known: set[str] = set()


def remember(value: str | None) -> None:
    """Treat `value` as a secret from now on (with its URL-encoded forms). Short strings are not
    remembered: masking every "a" or "1" in the output would hide more than it protects."""
    if not value or len(value) < 4:
        return
    _known.update({value, urllib.parse.quote(value, safe=""), urllib.parse.quote_plus(value)})


def remember_uri(uri: str | None) -> None:
    """The password in a URI's user info (`scheme://user:password@host`)."""
    if not uri or "://" not in uri:
        return
    netloc = uri.split("://", 1)[1].split("/", 1)[0]
    if "@" in netloc:
        userinfo = netloc.rsplit("@", 1)[0]
        _, _, password = userinfo.partition(":")
        remember(password or userinfo)  # `token@host` carries the token as the user name
        remember(urllib.parse.unquote(password or userinfo))


def remember_environment() -> None:
    for name in SECRET_ENV:
        remember(os.environ.get(name))
    remember_uri(os.environ.get("MLFLOW_TRACKING_URI"))


def scrub(text: str) -> str:
    for secret in sorted(_known, key=len, reverse=True):  # longest first: an encoded form contains the plain one
        if secret in text:
            text = text.replace(secret, MASK)
    return text


class ScrubFilter(logging.Filter):
    """Masks secrets in a log record's final message (for handlers that write files)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if _known:
            record.msg, record.args = scrub(record.getMessage()), None
        return True


class ScrubbingStream:
    """A text stream that masks secrets in what is written to it; everything else is the wrapped
    stream's (isatty, encoding, fileno, buffer), so rich and tqdm behave as before."""

    def __init__(self, inner: TextIO):
        self._inner = inner

    def write(self, s: str) -> int:
        self._inner.write(scrub(s) if _known else s)
        return len(s)

    def flush(self) -> None:
        self._inner.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def guard_streams() -> None:
    """Scrub the process's stdout and stderr (the CLI calls this first, before MLflow is imported
    and its log handlers take a reference to sys.stderr)."""
    remember_environment()
    if not isinstance(sys.stdout, ScrubbingStream):
        sys.stdout = ScrubbingStream(sys.stdout)
    if not isinstance(sys.stderr, ScrubbingStream):
        sys.stderr = ScrubbingStream(sys.stderr)
