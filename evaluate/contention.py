"""How busy the machine was while a speed measurement ran: CPU pressure, steal time, load.

Interleaving the arms cancels slow drift, but two engines do not suffer contention equally (one
uses more threads, one is more memory-bound), so a ratio measured on a crowded machine can be
wrong either way: the same cached demo gave 1.19x on a quiet machine and 0.57x with a load
average near 15 on 2 cores. The gate turns a speed check measured under heavy contention, or on
a VM whose hypervisor took much of the CPU, into Inconclusive, with these numbers as the reason.

- cpu_pressure: the share of wall time runnable tasks waited for a CPU (PSI's "some", which the
  kernel takes per CPU and averages over the CPUs), from the first of two signals the machine has
  (`signal` names it):
  - "PSI": Linux pressure stall information (`/proc/pressure/cpu`, "some"). The benchmark's own
    threads add a little; other jobs add most.
  - "run queue": where PSI is missing (a kernel built without it, or booted with psi=0), the
    run queue sampled every SAMPLE_S while measuring (`procs_running` in `/proc/stat`, less the
    thread that reads it): the runnable tasks beyond the CPUs this process may run on, per CPU
    (at most 1), averaged over the samples. That is PSI's "some" as the kernel sums it over the
    CPUs (3 busy tasks on 2 CPUs: one of the two has a task waiting, 50%), so one bound fits
    both. Measured side by side on a 2-vCPU KVM guest, 10 s each, PSI / run queue: torch's own
    2 threads 0.5-11% / 0-12%, one busy process beside them 50-51% / 49-50%, two 100% / 98.5%
    (the share of samples with any task waiting, tried first, read 98% for one busy process).
    The count is system-wide: with the benchmark pinned to a few of many CPUs it over-states
    the pressure (Inconclusive, never a wrong pass).
- cpu_steal: the share of CPU time the hypervisor gave to other guests (`/proc/stat`).
- load_per_core: the 1-minute load average at the end over the number of cores.
Where a file is missing (not Linux) that figure is None, and with no pressure signal `signal` is
None: the gate names the guard as unable to watch, it does not pass in silence.

A whole-run figure cannot tell steady load, which a pair's two arms share, from load that came or
went between them. So the decode benchmark also takes these figures over each arm's half of every
pair (`Watch.read` before and after each request, `Watch.over` between: two /proc reads, ~0.1 ms),
and the gate drops the pairs whose halves differ (kiln.core.gate.performance).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROC = Path("/proc")
PSI, RUN_QUEUE = "PSI", "run queue"
SAMPLE_S = 0.1  # a read of /proc/stat costs ~50 us: 0.05% of a CPU at this rate


@dataclass(frozen=True)
class Reading:
    wall_s: float
    psi_some_us: int | None
    steal: int | None
    jiffies: int | None
    runnable: int | None = None  # procs_running at this moment, the reading thread included


def read(proc: Path = PROC) -> Reading:
    psi = steal = jiffies = runnable = None
    try:
        some = (proc / "pressure" / "cpu").read_text().splitlines()[0]
        psi = int(some.rsplit("total=", 1)[1])
    except (OSError, IndexError, ValueError):
        pass
    try:
        lines = (proc / "stat").read_text().splitlines()
        fields = [int(v) for v in lines[0].split()[1:]]
        steal, jiffies = (fields[7] if len(fields) > 7 else 0), sum(fields[:8])
        runnable = next((int(line.split()[1]) for line in lines if line.startswith("procs_running ")), None)
    except (OSError, IndexError, ValueError):
        pass
    return Reading(time.monotonic(), psi, steal, jiffies, runnable)


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity), not every CPU of the machine."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def between(start: Reading, end: Reading, runnable: Sequence[int] = ()) -> dict[str, Any]:
    """The figures over [start, end]; `runnable`: run-queue samples taken in between (see Watch)."""
    wall = max(end.wall_s - start.wall_s, 1e-9)
    signal, pressure = None, None
    if start.psi_some_us is not None and end.psi_some_us is not None:
        signal, pressure = PSI, min(1.0, (end.psi_some_us - start.psi_some_us) / 1e6 / wall)
    elif queue := [n for n in (start.runnable, *runnable, end.runnable) if n is not None]:
        cpus = usable_cpus()
        signal, pressure = RUN_QUEUE, sum(min(1.0, max(0, n - 1 - cpus) / cpus) for n in queue) / len(queue)
    steal = None
    if None not in (start.steal, end.steal, start.jiffies, end.jiffies) and end.jiffies > start.jiffies:
        steal = (end.steal - start.steal) / (end.jiffies - start.jiffies)
    try:
        load = os.getloadavg()[0] / (os.cpu_count() or 1)
    except OSError:
        load = None
    return {"signal": signal, "cpu_pressure": pressure, "cpu_steal": steal, "load_per_core": load}


class Watch:
    """The machine from now on. With PSI two readings say it all; without, a daemon thread samples
    the run queue every `every_s` until `close`, so the share is taken over many moments, not two."""

    def __init__(self, proc: Path = PROC, every_s: float = SAMPLE_S):
        self.proc, self.start = proc, read(proc)
        self.samples: list[tuple[float, int]] = []  # (monotonic time, procs_running)
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        if self.start.psi_some_us is None and self.start.runnable is not None:
            self._thread = threading.Thread(target=self._sample, args=(every_s,), name="kiln-contention", daemon=True)
            self._thread.start()

    def _sample(self, every_s: float) -> None:
        while not self._done.wait(every_s):
            if (r := read(self.proc)).runnable is not None:
                self.samples.append((r.wall_s, r.runnable))

    def read(self) -> Reading:
        return read(self.proc)

    def over(self, start: Reading, end: Reading) -> dict[str, Any]:
        """The figures over [start, end] (two of this watch's readings): one arm's half of a pair."""
        return between(start, end, [n for t, n in list(self.samples) if start.wall_s <= t <= end.wall_s])

    def figures(self) -> dict[str, Any]:
        """The figures from the watch's start until now: the whole benchmark."""
        return self.over(self.start, read(self.proc))

    def close(self) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def as_metrics(machine: dict[str, Any]) -> dict[str, float]:
    """The figures the gate reads, as the candidate's (and baseline's) metrics: the pressure under
    the name of the signal that measured it, and the steal."""
    from kiln.core.metrics import BENCH_STEAL, PRESSURE_BY_SIGNAL

    out = {}
    if machine.get("signal") in PRESSURE_BY_SIGNAL and machine["cpu_pressure"] is not None:
        out[PRESSURE_BY_SIGNAL[machine["signal"]]] = machine["cpu_pressure"]
    if machine.get("cpu_steal") is not None:
        out[BENCH_STEAL] = machine["cpu_steal"]
    return out
