"""Fake engine servers for the load-generator tests (subprocesses, so no GIL is shared)."""

from __future__ import annotations

import pytest

from kiln.engine.serve.fake import FakeEngineConfig, FakeServer


@pytest.fixture(scope="module")
def steady_server():
    """Unlimited capacity, 800 ms to first token, 25 ms between tokens.

    Long enough that 2% (16 ms, 0.5 ms) is more than the scheduling noise of a busy 2-core
    machine, where the loopback round trip alone took 4 ms (p50) and 11 ms (p99) while other
    jobs ran.
    """
    with FakeServer(FakeEngineConfig(ttft_ms=800, tpot_ms=25)) as server:
        yield server


@pytest.fixture(scope="module")
def small_server():
    """Two slots, 50 ms TTFT, 10 ms TPOT: a 10-token request holds a slot ~0.14 s, so the
    server completes at most ~14 req/s and queues the rest."""
    with FakeServer(FakeEngineConfig(ttft_ms=50, tpot_ms=10, capacity=2)) as server:
        yield server
