"""The scheduler: the only code that touches the engine while the server runs (a thread, or the loop).

HTTP handlers (asyncio) submit requests and scoring jobs; this thread adds them to the engine,
calls `step()` while there is work, and hands each step's tokens back to the event loop in one
`call_soon_threadsafe`. Requests that arrive while others decode join the batch at the next
step (continuous batching is the engine's job; feeding it promptly is ours). Serving metrics
are measured here, from the engine's own token timestamps.

An engine whose tokens come from elsewhere over sockets (llama.cpp's llama-server: its
`readiness_fd`) is read by the event loop itself instead: the loop adds, polls and cancels its
sequences, and the thread runs only scoring. A token then reaches its HTTP response with no
thread hop; on two cores that llama-server's threads keep busy, every wake-up of another thread
stalls its decode (docs/engines.md).

A failing step fails only the request that caused it: the server validates requests before they
get here, and should one still break the shared step, each request in flight is retried alone
from the tokens it has delivered; those that step alone carry on, the one that fails again gets
the error. A sampled request resumed this way restarts its seeded random stream.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kiln.engine.serve import metric_names as names
from kiln.engine.base import Engine, GenerationRequest, TokenEvent

_WATCH_S = 5.0  # a loop-driven engine is polled this often too, so a server gone silent is noticed
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    """Prometheus metrics in their own registry (several servers may share one process)."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.ttft = Histogram(names.TTFT, "Time to first token", registry=r, buckets=_LATENCY_BUCKETS)
        self.tpot = Histogram(names.TPOT, "Mean time between output tokens of a request (after the first)",
                              registry=r, buckets=_LATENCY_BUCKETS)
        self.e2e = Histogram(names.E2E, "Request latency, submit to last token", registry=r,
                             buckets=_LATENCY_BUCKETS)
        self.running = Gauge(names.RUNNING, "Requests submitted and not finished", registry=r)
        self.waiting = Gauge(names.WAITING, "Requests waiting for their first token", registry=r)
        self.prompt_tokens = Counter(names.PROMPT_TOKENS, "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter(names.GENERATION_TOKENS, "Tokens generated", registry=r)
        self.cold_start = Gauge(names.COLD_START, "Process start to ready, by phase (boot: interpreter "
                                "and imports; load; warmup; total)", ["phase"], registry=r)


class Ticket:
    """One submitted generation: its events arrive on `events` (None marks the end), its own
    queue unless the caller gives one (anything with `put_nowait`, called on the event loop)."""

    def __init__(self, request: GenerationRequest, events: Any = None):
        self.request = request
        self.events: asyncio.Queue[TokenEvent | Exception | None] = asyncio.Queue() if events is None else events
        self.submitted = time.perf_counter()
        self.first: float | None = None
        self.count = 0
        self.tokens: list[int] = []  # delivered so far (scheduler thread): where a retry resumes
        self.seq_id: int | None = None
        self.done = False

    def resumed(self) -> GenerationRequest:
        """The rest of this request: its prompt plus the tokens delivered, for what is left."""
        r = self.request
        return dataclasses.replace(r, prompt_ids=[*r.prompt_ids, *self.tokens],
                                   max_new_tokens=r.max_new_tokens - len(self.tokens))


class Scheduler:
    def __init__(self, engine: Engine, loop: asyncio.AbstractEventLoop, metrics: Metrics):
        self.engine, self.loop, self.metrics = engine, loop, metrics
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._by_seq: dict[int, Ticket] = {}
        self._thread = threading.Thread(target=self._run, name="kiln-scheduler", daemon=True)
        self._stopping = False
        self._fd = engine.readiness_fd()  # not None: the event loop drives generation (_poll)
        self._watchdog: asyncio.TimerHandle | None = None  # set while the loop watches _fd

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._inbox.put(("wake", None))
        self._thread.join(timeout=30)

    def detach(self) -> None:
        """Stop watching a loop-driven engine (on the event loop, before the engine closes)."""
        if self._watchdog is not None:
            self.loop.remove_reader(self._fd)
            self._watchdog.cancel()
            self._watchdog = None

    # ----- called from the event loop -------------------------------------------------------

    def submit(self, request: GenerationRequest, events: Any = None) -> Ticket:
        ticket = Ticket(request, events)
        self.metrics.running.inc()
        self.metrics.waiting.inc()
        self.metrics.prompt_tokens.inc(len(request.prompt_ids))
        if self._fd is None:
            self._inbox.put(("add", ticket))
        else:  # watched from the first request on: warm-up generated on the thread before
            self._watch()
            self._add(ticket, request)
        return ticket

    def cancel(self, ticket: Ticket) -> None:
        if ticket.done:
            return
        if self._fd is None:
            self._inbox.put(("cancel", ticket))
        else:
            self._cancel(ticket)

    def call(self, fn: Callable[[Engine], Any]) -> asyncio.Future:
        """Run `fn(engine)` on the scheduler thread (scoring); await the returned future."""
        future = self.loop.create_future()
        self._inbox.put(("call", (fn, future)))
        return future

    # ----- a loop-driven engine, on the event loop ------------------------------------------

    def _watch(self) -> None:
        if self._watchdog is None:
            self.loop.add_reader(self._fd, self._poll)
            self._watchdog = self.loop.call_later(_WATCH_S, self._tick)

    def _tick(self) -> None:
        self._watchdog = self.loop.call_later(_WATCH_S, self._tick)
        if self.engine.has_work():
            self._poll()

    def _poll(self) -> None:
        try:
            events = self.engine.poll()
        except Exception as e:
            self._isolate(e)
            return
        if events:
            _deliver(self._account(events))

    # ----- the scheduler thread (and what both drivers share) -------------------------------

    def _on_loop(self, fn: Callable[..., None], *args: Any) -> None:
        """Run `fn` on the event loop: now if this is the loop-driven path, else handed over."""
        if self._fd is None:
            self.loop.call_soon_threadsafe(fn, *args)
        else:
            fn(*args)

    def _run(self) -> None:
        while not self._stopping:
            busy = self._fd is None and self.engine.has_work()
            try:  # block only when idle; while decoding, take what is queued and step
                item = self._inbox.get(block=not busy)
                self._handle(*item)
                while True:
                    self._handle(*self._inbox.get_nowait())
            except queue.Empty:
                pass
            if self._fd is None and self.engine.has_work():
                try:
                    events = self.engine.step()
                except Exception as e:
                    self._isolate(e)
                    continue
                self.loop.call_soon_threadsafe(_deliver, self._account(events))

    def _handle(self, kind: str, payload: Any) -> None:
        if kind == "add":
            self._add(payload, payload.request)
        elif kind == "cancel":
            self._cancel(payload)
        elif kind == "call":
            fn, future = payload
            try:
                result, error = fn(self.engine), None
            except Exception as e:
                result, error = None, e
            self.loop.call_soon_threadsafe(_resolve, future, result, error)

    def _cancel(self, t: Ticket) -> None:
        if t.seq_id in self._by_seq:
            self.engine.cancel(t.seq_id)
            self._finish(self._by_seq.pop(t.seq_id))

    def _add(self, t: Ticket, request: GenerationRequest) -> bool:
        try:
            t.seq_id = self.engine.add(request)
        except Exception as e:
            self._fail(t, e)
            return False
        self._by_seq[t.seq_id] = t
        return True

    def _isolate(self, error: Exception) -> None:
        """A shared step failed and which request caused it is unknown: step each request alone
        (from the tokens it has delivered), fail those that fail again, resume the others together.
        For a loop-driven engine this runs on the event loop, which each lone step blocks for a token."""
        suspects = list(self._by_seq.values())
        logging.getLogger("kiln.serve").warning("engine step failed (%s: %s); retrying its %d requests one by one",
                                                type(error).__name__, error, len(suspects))
        for t in suspects:
            self._drop(t)
        survivors = []
        for t in suspects:
            if not self._add(t, t.resumed()):
                continue
            try:
                events = self.engine.step()
            except Exception as e:
                self._drop(t)
                self._fail(t, e)
                continue
            self._on_loop(_deliver, self._account(events))
            if not t.done:
                self._drop(t)
                survivors.append(t)
        for t in survivors:  # they join one batch again at the next step
            self._add(t, t.resumed())

    def _drop(self, t: Ticket) -> None:
        """Take a sequence out of the engine, keeping its ticket open."""
        self._by_seq.pop(t.seq_id, None)
        try:
            self.engine.cancel(t.seq_id)
        except Exception:  # noqa: BLE001 - a broken engine is reported by the step that follows
            logging.getLogger("kiln.serve").exception("cancelling sequence %s failed", t.seq_id)

    def _fail(self, t: Ticket, error: Exception) -> None:
        self._finish(t)
        self._on_loop(t.events.put_nowait, error)

    def _account(self, events: list[TokenEvent]) -> list[tuple[Ticket, TokenEvent]]:
        """Update metrics and bookkeeping; pair each event with its ticket for delivery."""
        m, pairs = self.metrics, []
        for ev in events:
            t = self._by_seq.get(ev.seq_id)
            if t is None:
                continue
            pairs.append((t, ev))
            t.count += 1
            t.tokens.append(ev.token_id)
            if t.first is None:
                t.first = ev.time
                m.waiting.dec()
                m.ttft.observe(ev.time - t.submitted)
            if ev.finish_reason is not None:
                if t.count > 1:
                    m.tpot.observe((ev.time - t.first) / (t.count - 1))
                m.e2e.observe(ev.time - t.submitted)
                self._finish(self._by_seq.pop(ev.seq_id))
        if pairs:
            m.generation_tokens.inc(len(pairs))
        return pairs

    def _finish(self, t: Ticket) -> None:
        if t.done:
            return
        t.done = True
        self.metrics.running.dec()
        if t.first is None:
            self.metrics.waiting.dec()


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
