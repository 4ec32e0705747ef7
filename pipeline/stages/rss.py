"""Peak resident memory of one stage: kiln's own process and the processes it started.

Stages run one after another in one `kiln run` process, and a process's peak (getrusage's
ru_maxrss, or VmHWM) only ever grows, so a stage's own peak needs a fresh start:

- kiln's process: its VmHWM, reset when the stage starts by writing "5" to /proc/self/clear_refs
  (Linux). Exact, threads included. Where the kernel refuses the reset, the figure is the
  process's peak since it started, and the manifest says so (`peak_rss_reset: false`).
- child processes (llama-server, llama.cpp's converter and quantizer, a `kiln serve`, their own
  children): each one's VmHWM, read by a thread every `interval_s` while the stage runs, and reset
  at the start for a child an earlier stage started (a server kept between stages). VmHWM is a
  high-water mark, so only growth in a child's last `interval_s` before it exits is missed, and a
  child that lives less than `interval_s` is not seen at all. ru_maxrss of children is not used:
  Linux carries the parent's peak into a child across fork and exec.

Resident memory counts pages a process shares with others (its mapped files, copy-on-write pages
after a fork) in each of them: a forked Python worker of a 2 GB kiln shows 2 GB resident though
it holds almost nothing of its own. So the children's figure is not a sum of their RSS peaks but
the peak, over the samples, of their summed proportional set size (PSS, /proc/PID/smaps_rollup:
each shared page divided among the processes that map it): what the children held together at
one moment, shared pages counted once across everyone who maps them. Each child's own VmHWM is
kept in the manifest beside it.
"""

from __future__ import annotations

import ctypes
import gc
import glob
import os
import resource
import threading
from pathlib import Path
from typing import Any


def settle() -> None:
    """Collect, then move what survived to the permanent generation (`gc.freeze`), where later full
    collections do not walk it: imported modules and classes, the run's long-lived objects. `kiln run`
    calls it once, before its first stage, when no model is loaded yet. Each stage's collection (its
    memory figures start from what is held, not from garbage) then walks only what was made since:
    a walk of the ~2-3M objects torch, transformers and MLflow leave behind cost ~0.35 s of CPU, 12-15
    times in a two-arm run (5 of a tiny run's 36 s). The cost: a frozen object that later becomes
    garbage in a reference cycle is never collected; one whose references drop to zero still frees
    at once, and the models and engines the stages load come after the freeze."""
    gc.collect()
    gc.freeze()


def return_freed_memory() -> None:
    """Hand what this process freed back to the kernel: a collection, then glibc's malloc_trim(0),
    which releases the free pages inside the C heap (an earlier stage's freed buffers, kept by the
    allocator for reuse). A no-op where the C library has no malloc_trim (musl, macOS)."""
    gc.collect()
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)


def reset_peak_rss(pid: int | str = "self") -> bool:
    """Start a new peak for `peak_rss_bytes(pid)`; False where the kernel does not allow it."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:  # not Linux, a kernel without it, or a process that is not ours
        return False
    return True


def peak_rss_bytes(pid: int | str = "self") -> int:
    """Peak resident memory of a process (this one by default) since its last `reset_peak_rss` or
    its start: VmHWM, not getrusage's ru_maxrss, which Linux carries across fork and exec (a child
    of a 2 GB parent reports 2 GB)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        if pid != "self":
            raise
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # no /proc: KiB on Linux
    return next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmHWM:"))


def rss_bytes(pid: int | str = "self") -> int:
    """A process's resident memory now (VmRSS); 0 where /proc cannot say."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    return next((int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmRSS:")), 0)


def pss_bytes(pid: int) -> int:
    """A process's proportional set size now (shared pages divided among their mappers)."""
    rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
    return next(int(line.split()[1]) * 1024 for line in rollup.splitlines() if line.startswith("Pss:"))


def descendants(pid: int | str = "self") -> list[int]:
    """Every live process below `pid` (children, their children, ...)."""
    if not _PROC_CHILDREN:  # a kernel without CONFIG_PROC_CHILDREN, or no /proc
        import psutil

        try:
            return [p.pid for p in psutil.Process(None if pid == "self" else int(pid)).children(recursive=True)]
        except psutil.Error:
            return []
    out: list[int] = []
    for f in glob.glob(f"/proc/{pid}/task/*/children"):
        try:
            kids = [int(k) for k in Path(f).read_text().split()]
        except OSError:  # the thread or process ended meanwhile
            continue
        for kid in kids:
            out += [kid, *descendants(kid)]
    return out


_PROC_CHILDREN = Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").exists()


class StageMemory:
    """`with StageMemory() as m: ...` then `m.figures()`: the block's peaks (see the module doc)."""

    def __init__(self, interval_s: float = 0.25):
        self.interval_s = interval_s
        self.children: dict[int, dict[str, Any]] = {}  # pid -> {"name", "peak_rss_bytes"}
        self.reset = False
        self.own = 0
        self.start = 0  # kiln's resident memory when the stage began: what earlier stages left it holding
        self.children_pss = 0  # the peak of the children's summed PSS over the samples
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="kiln-stage-memory", daemon=True)

    def __enter__(self) -> StageMemory:
        return_freed_memory()  # the peak starts from what is held, not from an earlier stage's garbage
        self.reset = reset_peak_rss()
        self.start = rss_bytes()
        for pid in descendants():  # started by an earlier stage: count from now on
            reset_peak_rss(pid)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
        self.own = peak_rss_bytes()

    def _watch(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def _sample(self) -> None:
        together = 0
        for pid in descendants():
            try:
                peak, pss = peak_rss_bytes(pid), pss_bytes(pid)
                name = Path(f"/proc/{pid}/comm").read_text().strip()
            except (OSError, StopIteration):  # it exited meanwhile (or is a zombie: no VmHWM)
                continue
            seen = self.children.setdefault(pid, {"name": name, "peak_rss_bytes": 0})
            seen["peak_rss_bytes"] = max(seen["peak_rss_bytes"], peak)
            together += pss
        self.children_pss = max(self.children_pss, together)

    def figures(self) -> dict[str, Any]:
        """For the stage's manifest: both peaks, each child's, and how they were measured."""
        return {"peak_rss_bytes": self.own, "peak_rss_reset": self.reset, "start_rss_bytes": self.start,
                "children_peak_pss_bytes": self.children_pss,
                "children": [{"pid": pid, **c} for pid, c in sorted(self.children.items())],
                "children_sampled_every_s": self.interval_s}

    def metrics(self, stage: str) -> dict[str, int]:
        """For the stage's result metrics (MLflow, the report): named for the stage, so the
        stages of one arm do not overwrite each other's in its evidence."""
        return {f"{stage}_peak_rss_bytes": self.own, f"{stage}_children_peak_pss_bytes": self.children_pss}
