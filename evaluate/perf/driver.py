"""Run one stage of load: send on schedule (open loop) or as users free up (closed loop).

Open loop: each request's body is built before its send time, the sender sleeps to the absolute
send time (never accumulating sleeps, so drift cannot build up), then hands the request to its
own task. When its bytes really went to the socket is recorded in the request, so how late each
send was (send lag) is measured, not hidden.

Bounds: the stage sends for `duration_s` or `max_requests`, whichever comes first, then waits up
to `drain_timeout_s` for requests in flight (they are not cancelled: cancelling them is what
makes other generators under-count throughput). An open-loop stage stops early under
`SaturationRule` (see rules.py); its in-flight requests are then cancelled and the summary says
why it stopped and whom that blames: the server (in flight grew while sends were on time) or the
client (sends fell behind).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field

from kiln.evaluate.perf.base import Stage
from kiln.evaluate.perf.client import RequestRecord, StreamClient
from kiln.evaluate.perf.config import PerformanceConfig, Trim
from kiln.evaluate.perf.rules import SaturationRule
from kiln.evaluate.perf.metrics import CLIENT_LIMITED, OVER_SATURATED, Summary, summarize
from kiln.evaluate.perf.workload import Workload


@dataclass(repr=False)
class StageResult:
    label: str
    t0: float  # perf_counter at the stage start; record times are relative to it in JSONL
    window: tuple[float, float]
    records: list[RequestRecord]
    summary: Summary

    def __repr__(self) -> str:  # the default would print every record
        return f"StageResult({self.label!r}, {len(self.records)} requests)"


@dataclass
class _State:
    in_flight: set[asyncio.Task] = field(default_factory=set)
    stop_reason: str | None = None
    checked: int = 0  # records before this index have been sent (or given up) and their lag seen
    next_due: float | None = None  # when the request the open-loop sender is building or awaiting is due


def _lag_since_last_check(records: list[RequestRecord], state: _State) -> float:
    """The largest send lag since the last check, in seconds. A request not yet sent counts as
    late as it is now: a client too busy to send never reports a late send otherwise."""
    now, lag = time.perf_counter(), 0.0
    while state.checked < len(records):
        rec = records[state.checked]
        if not rec.sent and rec.done is None:
            return max(lag, now - rec.scheduled)
        lag = max(lag, (rec.sent or rec.done or now) - rec.scheduled)
        state.checked += 1
    return lag


def _behind_now(records: list[RequestRecord], state: _State) -> float:
    """How far behind schedule the client is at this moment, in seconds (0 when on time): the
    request the sender has yet to launch, or the oldest launched one whose bytes are not out.
    Call after `_lag_since_last_check`, which leaves `state.checked` at that oldest one."""
    now, behind = time.perf_counter(), 0.0
    if state.next_due is not None:
        behind = now - state.next_due
    if state.checked < len(records):
        behind = max(behind, now - records[state.checked].scheduled)
    return max(behind, 0.0)


async def _sleep_until(target: float) -> None:
    # Loop timers have ~1 ms granularity and can fire early: re-check against the clock.
    # A sender that is already late still yields once, or it would starve the watcher and the
    # response readers exactly when they matter.
    if target - time.perf_counter() <= 0.0002:
        await asyncio.sleep(0)
    while (left := target - time.perf_counter()) > 0.0002:
        await asyncio.sleep(left)


def _launch(client: StreamClient, rec: RequestRecord, body: dict, state: _State) -> None:
    task = asyncio.get_running_loop().create_task(client.send(rec, body))
    state.in_flight.add(task)
    task.add_done_callback(state.in_flight.discard)


@dataclass
class _Drive:
    """One stage being driven: who sends, the stage and its requests, what was sent so far."""

    client: StreamClient
    stage: Stage
    work: Workload
    cfg: PerformanceConfig
    salt: str
    t0: float
    records: list[RequestRecord]
    state: _State


async def _open_loop(d: _Drive) -> float:
    """Send on schedule; returns when sending ended (perf_counter)."""
    cfg, records, t0 = d.cfg, d.records, d.t0
    assert d.stage.arrivals is not None
    try:
        for i, offset in enumerate(d.stage.arrivals):
            if offset >= cfg.duration_s or (cfg.max_requests and i >= cfg.max_requests):
                return t0 + cfg.duration_s if offset >= cfg.duration_s else records[-1].scheduled
            d.state.next_due = t0 + offset
            body, n_in = d.work.request(i, d.salt)
            await _sleep_until(t0 + offset)
            if d.state.stop_reason:
                return time.perf_counter()
            rec = RequestRecord(f"{d.salt}-{i}", scheduled=t0 + offset, input_tokens=n_in)
            records.append(rec)
            _launch(d.client, rec, body, d.state)
    finally:  # nothing is due once sending ended: the drain must not read as the client falling behind
        d.state.next_due = None
    raise RuntimeError("arrivals ran out before the stage ended")  # shapes yield endless arrivals


async def _closed_loop(d: _Drive) -> float:
    """`concurrency` users, each sending its next request when the last one ends."""
    cfg, records = d.cfg, d.records
    counter = itertools.count()
    limit = cfg.max_requests or float("inf")

    async def user() -> None:
        while (i := next(counter)) < limit and time.perf_counter() < d.t0 + cfg.duration_s:
            body, n_in = d.work.request(i, d.salt)
            rec = RequestRecord(f"{d.salt}-{i}", scheduled=time.perf_counter(), input_tokens=n_in)
            records.append(rec)
            await d.client.send(rec, body)

    await _sleep_until(d.t0)
    for _ in range(d.stage.concurrency or 1):
        d.state.in_flight.add(asyncio.get_running_loop().create_task(user()))
    done, _ = await asyncio.wait(set(d.state.in_flight), timeout=cfg.duration_s + 0.05)
    sent_until = min(d.t0 + cfg.duration_s, time.perf_counter())
    if cfg.max_requests and len(records) >= cfg.max_requests:
        sent_until = min(sent_until, records[-1].scheduled)
    return sent_until


async def _watch(rule: SaturationRule, warm_until: float, records: list[RequestRecord], state: _State) -> None:
    """The early-stop rule and whom it blames (documented on SaturationRule)."""
    counts: list[int] = []
    lags: list[float] = []  # the largest send lag in each check interval, seconds
    behind: list[float] = []  # how far behind schedule the client was at each check, seconds
    while not state.stop_reason:
        await asyncio.sleep(rule.check_interval_s)
        lags.append(_lag_since_last_check(records, state))
        behind.append(_behind_now(records, state))
        if lags[-1] > rule.max_lateness_s:
            state.stop_reason = (
                f"{CLIENT_LIMITED}: sends fell {lags[-1]:.2f} s behind schedule; "
                "the client could not send the target rate, so this says nothing about the server"
            )
            return
        if time.perf_counter() < warm_until:
            continue
        counts.append(len(state.in_flight))
        recent = counts[-(rule.rising_checks + 1) :]
        rising = len(recent) == rule.rising_checks + 1 and all(b > a for a, b in zip(recent, recent[1:]))
        if rising and recent[-1] >= max(rule.min_in_flight, rule.growth * max(counts[0], 1)):
            state.stop_reason = _blame(rule, counts[0], recent[-1], lags, behind)


def _blame(rule: SaturationRule, first: int, last: int, lags: list[float], behind: list[float]) -> str:
    """Why a stage whose requests in flight kept rising stops. The client is blamed when it was
    behind schedule at each of the last two checks: one that cannot send the rate falls further
    behind at every check, while one that stalled once (a GC pause, a busy core) and caught up is
    on time again at the next, and the growth is the server's."""
    late_ms = 1000 * max(lags[-(rule.rising_checks + 1) :])
    grew = f"requests in flight rose from {first} to {last}, up at each of the last {rule.rising_checks} checks"
    then_ms, now_ms = (1000 * b for b in behind[-2:])
    if min(then_ms, now_ms) > rule.send_lag_tolerance_ms:
        return (
            f"{CLIENT_LIMITED}: sends were {then_ms:.0f} and {now_ms:.0f} ms behind schedule at the last two "
            f"checks (up to {late_ms:.0f} ms) while {grew}; "
            "the client could not send the target rate, so this says nothing about the server"
        )
    return (
        f"{OVER_SATURATED}: {grew}, while sends were on time ({now_ms:.0f} ms behind at the last check, "
        f"at most {late_ms:.0f} ms late in between)"
    )


def measurement_window(
    records: list[RequestRecord], t0: float, end: float, warmup: Trim, cooldown: Trim
) -> tuple[float, float]:
    """[start, end) of the measured stretch: the later warm-up bound, the earlier cool-down bound."""
    times = sorted(r.scheduled for r in records)
    w0, w1 = t0 + warmup.seconds, end - cooldown.seconds
    if warmup.requests:
        w0 = max(w0, times[warmup.requests] if warmup.requests < len(times) else end)
    if cooldown.requests:
        w1 = min(w1, times[-cooldown.requests] if cooldown.requests <= len(times) else t0)
    return w0, max(w0, w1)


async def run_stage(
    client: StreamClient, stage: Stage, work: Workload, cfg: PerformanceConfig, salt: str
) -> StageResult:
    state = _State()
    records: list[RequestRecord] = []
    t0 = time.perf_counter() + 0.01
    watcher = None
    if stage.open_loop and cfg.saturation.enabled:
        watcher = asyncio.get_running_loop().create_task(
            _watch(cfg.saturation, t0 + cfg.warmup.seconds, records, state)
        )
    drive = _open_loop if stage.open_loop else _closed_loop
    end = await drive(_Drive(client, stage, work, cfg, salt, t0, records, state))
    if state.stop_reason:
        end = time.perf_counter()
        for task in list(state.in_flight):
            task.cancel()
    if state.in_flight:
        _, late = await asyncio.wait(set(state.in_flight), timeout=cfg.drain_timeout_s)
        for task in late:
            task.cancel()
        await asyncio.gather(*late, return_exceptions=True)
    if watcher:
        watcher.cancel()
    window = measurement_window(records, t0, end, cfg.warmup, cfg.cooldown)
    summary = summarize(
        records,
        window,
        cfg.slo,
        label=stage.label,
        target_rate=stage.target_rate,
        concurrency=stage.concurrency,
        price_per_hour=cfg.price_per_hour,
        stopped_early=state.stop_reason,
        saturation=cfg.saturation,
    )
    return StageResult(stage.label, t0, window, records, summary)
