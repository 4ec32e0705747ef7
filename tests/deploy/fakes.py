"""Fake-engine settings shared by the deploy tests."""

from __future__ import annotations

from kiln.engine.serve.fake import FakeEngineConfig

# Slow enough that a loaded 2-core machine's scheduling jitter stays small next to them.
BASE = {"ttft_ms": 40.0, "tpot_ms": 15.0}


def fake(**overrides: float | str) -> FakeEngineConfig:
    return FakeEngineConfig(**{**BASE, **overrides})
