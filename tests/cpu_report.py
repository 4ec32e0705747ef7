"""CPU seconds by test file, printed at the end of a run (hooks that tests/conftest.py takes in).

`make test` runs on a 2-core machine with two workers, so the suite is bound by CPU, not by any one
test's wall time: `--durations` shows a test's wall under the other worker's load (the action-runner
demo test: 197 s in CI, 67 s alone), not what it costs the run. This counts what each file costs: the
test process's own CPU and that of the subprocesses it waited for (kiln runs, servers stopped in the
test), setup and teardown included. A lower bound: a daemon that detaches (PostgreSQL's pg_ctl) or a
process nobody waits for is not counted.
"""

from __future__ import annotations

import resource
from collections import defaultdict

import pytest

TOP = 25
KEY = "kiln_cpu_by_file"
_cpu: dict[str, float] = defaultdict(float)


def _cpu_now() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    start = _cpu_now()
    yield
    _cpu[item.nodeid.split("::")[0]] += _cpu_now() - start


def pytest_sessionfinish(session: pytest.Session) -> None:
    """On an xdist worker: hand this worker's counts to the controller."""
    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput[KEY] = dict(_cpu)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    """On the xdist controller: a worker's counts, added to the run's."""
    for path, seconds in getattr(node, "workeroutput", {}).get(KEY, {}).items():
        _cpu[path] += seconds


def pytest_terminal_summary(terminalreporter) -> None:
    if len(_cpu) < 2 or hasattr(terminalreporter.config, "workerinput"):  # one file: its line says nothing new
        return
    total = sum(_cpu.values())
    terminalreporter.write_sep("=", f"CPU seconds by test file: {total:.0f} s in all, the {TOP} largest")
    for path, seconds in sorted(_cpu.items(), key=lambda kv: -kv[1])[:TOP]:
        terminalreporter.write_line(f"{seconds:8.1f}s {100 * seconds / total:5.1f}%  {path}")
