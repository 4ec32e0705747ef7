"""The scheduler thread: the only code that touches the engine while the server runs.

HTTP handlers (asyncio) submit requests and scoring jobs; this thread adds them to the engine,
calls `step()` while there is work, and hands each step's tokens back to the event loop in one
`call_soon_threadsafe`. Requests that arrive while others decode join the batch at the next
step (continuous batching is the engine's job; feeding it promptly is ours). Serving metrics
are measured here, from the engine's own token timestamps.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kiln.engine.base import Engine, GenerationRequest, TokenEvent

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    """Prometheus metrics in their own registry (several servers may share one process)."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.ttft = Histogram("kiln_time_to_first_token_seconds", "Time to first token", registry=r,
                              buckets=_LATENCY_BUCKETS)
        self.tpot = Histogram("kiln_time_per_output_token_seconds", "Mean time between output tokens "
                              "of a request (after the first)", registry=r, buckets=_LATENCY_BUCKETS)
        self.e2e = Histogram("kiln_e2e_request_latency_seconds", "Request latency, submit to last token",
                             registry=r, buckets=_LATENCY_BUCKETS)
        self.running = Gauge("kiln_requests_in_flight", "Requests submitted and not finished", registry=r)
        self.waiting = Gauge("kiln_queue_depth", "Requests waiting for their first token", registry=r)
        self.prompt_tokens = Counter("kiln_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("kiln_generation_tokens", "Tokens generated", registry=r)
        self.cold_start = Gauge("kiln_cold_start_seconds", "Process start to ready, by phase (boot: interpreter "
                                "and imports; load; warmup; total)", ["phase"], registry=r)


class Ticket:
    """One submitted generation: its events arrive on `events` (None marks the end)."""

    def __init__(self, request: GenerationRequest):
        self.request = request
        self.events: asyncio.Queue[TokenEvent | Exception | None] = asyncio.Queue()
        self.submitted = time.perf_counter()
        self.first: float | None = None
        self.count = 0
        self.seq_id: int | None = None
        self.done = False


class Scheduler:
    def __init__(self, engine: Engine, loop: asyncio.AbstractEventLoop, metrics: Metrics):
        self.engine, self.loop, self.metrics = engine, loop, metrics
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._by_seq: dict[int, Ticket] = {}
        self._thread = threading.Thread(target=self._run, name="kiln-scheduler", daemon=True)
        self._stopping = False

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._inbox.put(("wake", None))
        self._thread.join(timeout=30)

    # ----- called from the event loop -------------------------------------------------------

    def submit(self, request: GenerationRequest) -> Ticket:
        ticket = Ticket(request)
        self.metrics.running.inc()
        self.metrics.waiting.inc()
        self.metrics.prompt_tokens.inc(len(request.prompt_ids))
        self._inbox.put(("add", ticket))
        return ticket

    def cancel(self, ticket: Ticket) -> None:
        if not ticket.done:
            self._inbox.put(("cancel", ticket))

    def call(self, fn: Callable[[Engine], Any]) -> asyncio.Future:
        """Run `fn(engine)` on the scheduler thread (scoring); await the returned future."""
        future = self.loop.create_future()
        self._inbox.put(("call", (fn, future)))
        return future

    # ----- the scheduler thread -------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping:
            busy = self.engine.has_work()
            try:  # block only when idle; while decoding, take what is queued and step
                item = self._inbox.get(block=not busy)
                self._handle(*item)
                while True:
                    self._handle(*self._inbox.get_nowait())
            except queue.Empty:
                pass
            if self.engine.has_work():
                try:
                    events = self.engine.step()
                except Exception as e:  # fail every request in flight, keep serving new ones
                    self._fail_all(e)
                    continue
                self.loop.call_soon_threadsafe(_deliver, self._account(events))

    def _handle(self, kind: str, payload: Any) -> None:
        if kind == "add":
            try:
                payload.seq_id = self.engine.add(payload.request)
                self._by_seq[payload.seq_id] = payload
            except Exception as e:
                self._finish(payload)
                self.loop.call_soon_threadsafe(payload.events.put_nowait, e)
        elif kind == "cancel" and payload.seq_id in self._by_seq:
            self.engine.cancel(payload.seq_id)
            self._finish(self._by_seq.pop(payload.seq_id))
        elif kind == "call":
            fn, future = payload
            try:
                result, error = fn(self.engine), None
            except Exception as e:
                result, error = None, e
            self.loop.call_soon_threadsafe(_resolve, future, result, error)

    def _account(self, events: list[TokenEvent]) -> list[tuple[Ticket, TokenEvent]]:
        """Update metrics and bookkeeping; pair each event with its ticket for delivery."""
        m, pairs = self.metrics, []
        for ev in events:
            t = self._by_seq.get(ev.seq_id)
            if t is None:
                continue
            pairs.append((t, ev))
            t.count += 1
            m.generation_tokens.inc()
            if t.first is None:
                t.first = ev.time
                m.waiting.dec()
                m.ttft.observe(ev.time - t.submitted)
            if ev.finish_reason is not None:
                if t.count > 1:
                    m.tpot.observe((ev.time - t.first) / (t.count - 1))
                m.e2e.observe(ev.time - t.submitted)
                self._finish(self._by_seq.pop(ev.seq_id))
        return pairs

    def _finish(self, t: Ticket) -> None:
        if t.done:
            return
        t.done = True
        self.metrics.running.dec()
        if t.first is None:
            self.metrics.waiting.dec()

    def _fail_all(self, error: Exception) -> None:
        for seq_id, t in list(self._by_seq.items()):
            self.engine.cancel(seq_id)
            self._finish(t)
            self.loop.call_soon_threadsafe(t.events.put_nowait, error)
        self._by_seq.clear()


def _deliver(pairs: list[tuple[Ticket, TokenEvent]]) -> None:  # on the event loop
    for ticket, ev in pairs:
        ticket.events.put_nowait(ev)
        if ev.finish_reason is not None:
            ticket.events.put_nowait(None)


def _resolve(future: asyncio.Future, result: Any, error: Exception | None) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
