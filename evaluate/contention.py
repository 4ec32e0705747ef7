"""How busy the machine was while a speed measurement ran: CPU pressure, steal time, load.

Interleaving the arms cancels slow drift, but two engines do not suffer contention equally (one
uses more threads, one is more memory-bound), so a ratio measured on a crowded machine can be
wrong either way: the same cached demo gave 1.19x on a quiet machine and 0.57x with a load
average near 15 on 2 cores. The gate turns a speed check measured under heavy contention into
Inconclusive, with these numbers as the reason.

- cpu_pressure: Linux PSI (`/proc/pressure/cpu`, "some"): the share of wall time at least one
  runnable task waited for a CPU. The benchmark's own threads add a little; other jobs add most.
- cpu_steal: the share of CPU time the hypervisor gave to other guests (`/proc/stat`).
- load_per_core: the 1-minute load average at the end over the number of cores.
Where a file is missing (not Linux, PSI off) that figure is None.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Reading:
    wall_s: float
    psi_some_us: int | None
    steal: int | None
    jiffies: int | None


def read() -> Reading:
    psi = steal = jiffies = None
    try:
        some = Path("/proc/pressure/cpu").read_text().splitlines()[0]
        psi = int(some.rsplit("total=", 1)[1])
    except (OSError, IndexError, ValueError):
        pass
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        steal, jiffies = (fields[7] if len(fields) > 7 else 0), sum(fields[:8])
    except (OSError, IndexError, ValueError):
        pass
    return Reading(time.monotonic(), psi, steal, jiffies)


def between(start: Reading, end: Reading) -> dict[str, float | None]:
    wall = max(end.wall_s - start.wall_s, 1e-9)
    pressure = None if start.psi_some_us is None or end.psi_some_us is None else \
        min(1.0, (end.psi_some_us - start.psi_some_us) / 1e6 / wall)
    steal = None
    if None not in (start.steal, end.steal, start.jiffies, end.jiffies) and end.jiffies > start.jiffies:
        steal = (end.steal - start.steal) / (end.jiffies - start.jiffies)
    try:
        load = os.getloadavg()[0] / (os.cpu_count() or 1)
    except OSError:
        load = None
    return {"cpu_pressure": pressure, "cpu_steal": steal, "load_per_core": load}
