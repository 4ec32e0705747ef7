"""Progress of a long loop, told to whoever listens: the ground every stage's loop reports to.

A stage runner opens a task (`with progress.task("quality[baseline]", display=...)`); the loop inside,
which knows its work but not who shows it, says how much there is and how far it got
(`progress.total(400, "documents")`, `progress.advance()`). With no task open both are no-ops, so an
evaluator called from a test or a bench prints nothing. One task is open at a time in a process (kiln
runs one stage at a time) and it is module-level, not a contextvar: the loops that advance it run on
the stage's own thread, on a server's thread or in an asyncio loop, and each must reach the same task.

Two displays: `Bar` (rich progress on a terminal: done of total, rate, ETA) and `Lines` (one plain line
every `every_s` seconds, for a CI log or a file, and for the run's kiln.log through logging).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

EVERY_S = 10.0  # between two plain lines: often enough to show a run is alive, rare enough to read a log
EVERY_ENV = "KILN_PROGRESS_EVERY_S"  # overrides EVERY_S (a test's short stage, a terse CI log)

log = logging.getLogger("kiln")


class Display(Protocol):
    def start(self, task: Task) -> None: ...
    def update(self, task: Task) -> None: ...
    def finish(self, task: Task) -> None: ...


class Task:
    """One loop's count: `done` of `total` `unit` (total None: not known yet), since `started`."""

    def __init__(self, name: str, total: int | None = None, unit: str = "items",
                 clock: Callable[[], float] = time.monotonic):
        self.name, self.total, self.unit, self.clock = name, total, unit, clock
        self.done = 0
        self.started = clock()

    def rate(self, now: float | None = None) -> float | None:
        """Items a second since the start; None before any is done."""
        elapsed = (self.clock() if now is None else now) - self.started
        return self.done / elapsed if self.done and elapsed > 0 else None

    def text(self, now: float | None = None) -> str:
        """ "120/400 windows, 3.1/s, ETA 1m30s" (no total: "120 windows, 3.1/s")."""
        rate = self.rate(now)
        count = f"{self.done}/{self.total}" if self.total is not None else f"{self.done}"
        parts = [f"{count} {self.unit}"]
        if rate is not None:
            parts.append(f"{_rate(rate)}/s")
            if self.total is not None:
                parts.append(f"ETA {duration(max(self.total - self.done, 0) / rate)}")
        return ", ".join(parts)


def duration(seconds: float) -> str:
    """45s, 1m30s, 2h05m: the width of an ETA, not its decimals."""
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _rate(per_s: float) -> str:
    return f"{per_s:.0f}" if per_s >= 10 else f"{per_s:.1f}" if per_s >= 1 else f"{per_s:.2g}"


_lock = threading.Lock()  # advance() comes from several threads at once (a server's, the client's)
_current: tuple[Task, list[Display]] | None = None


@contextlib.contextmanager
def task(name: str, total: int | None = None, unit: str = "items", displays: list[Display] = (),
         clock: Callable[[], float] = time.monotonic) -> Iterator[Task]:
    """Open `name` as the task the loops inside report to, shown by `displays`; the one before it,
    if any, is current again on the way out."""
    global _current
    t = Task(name, total, unit, clock)
    with _lock:
        before, _current = _current, (t, list(displays))
    for d in displays:
        d.start(t)
    try:
        yield t
    finally:
        with _lock:
            _current = before
        for d in displays:
            d.finish(t)


def total(n: int | None, unit: str | None = None) -> None:
    """The open task has `n` items (None: not known, e.g. a load test bounded by time; `unit`: what
    they are); a no-op with no task open."""
    _change(lambda t: (setattr(t, "total", None if n is None else int(n)), unit and setattr(t, "unit", unit)))


def more(n: int, unit: str | None = None) -> None:
    """The open task has `n` more items than it was told (lm-eval asks for one request type after
    another); a no-op with no task open."""
    _change(lambda t: (setattr(t, "total", (t.total or 0) + int(n)), unit and setattr(t, "unit", unit)))


def advance(n: int = 1) -> None:
    """`n` more items of the open task are done; a no-op with no task open."""
    _change(lambda t: setattr(t, "done", t.done + n))


def shown() -> bool:
    """Whether a task with a display is open: a loop's own progress bar (tqdm's) would draw over it."""
    return _current is not None and bool(_current[1])


def _change(how: Callable[[Task], Any]) -> None:
    with _lock:
        if _current is None:
            return
        t, displays = _current
        how(t)
        for d in displays:  # under the lock: a display's throttle is read and set by one thread at a time
            d.update(t)


class Lines:
    """One line per task every `every_s` seconds while it runs, through `write`; none for a task
    that ends sooner (its stage's "done in" line says all)."""

    def __init__(self, write: Callable[[str], None], every_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.write, self.clock = write, clock
        self.every_s = every_s if every_s is not None else float(os.environ.get(EVERY_ENV, EVERY_S))
        self.last: float | None = None

    def start(self, task: Task) -> None:
        self.last = self.clock()

    def update(self, task: Task) -> None:
        now = self.clock()
        if self.last is None or now - self.last >= self.every_s:
            self.last = now
            self.write(f"  {task.name}: {task.text(now)}")

    def finish(self, task: Task) -> None:
        self.last = None


class Bar:
    """Rich progress on a terminal: a bar, done of total, rate and ETA, gone when the task ends."""

    def __init__(self, console: Any):
        self.console = console
        self.progress: Any = None

    def start(self, task: Task) -> None:
        from rich.progress import BarColumn, Progress, TextColumn

        # markup off: a stage's label is "quality[baseline]", which rich would read as a style tag
        self.progress = Progress(TextColumn("  {task.description}", markup=False), BarColumn(),
                                 TextColumn("{task.fields[text]}", markup=False), console=self.console, transient=True)
        self.id = self.progress.add_task(task.name, total=task.total, text="")
        self.progress.start()

    def update(self, task: Task) -> None:
        if self.progress is not None:
            self.progress.update(self.id, total=task.total, completed=task.done, text=task.text())

    def finish(self, task: Task) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


def displays_for(console: Any) -> list[Display]:
    """What shows a stage's progress on `console`: a rich bar on a terminal, else plain lines every
    EVERY_S seconds; and the same lines in the run's kiln.log (logger "kiln") either way."""
    to_log = Lines(lambda line: log.info("progress %s", line.strip()))
    if getattr(console, "is_terminal", False):
        return [Bar(console), to_log]
    return [Lines(lambda line: console.print(line, markup=False, highlight=False, soft_wrap=True)), to_log]
