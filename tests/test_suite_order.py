"""The suite's own schedule (tests/conftest.py): the slowest files go out to the test workers first,
each file's tests kept together and in their order, and a renamed slow file is named here, not dropped
silently to the end of the run; and its report of CPU seconds by file (tests/cpu_report.py)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from types import SimpleNamespace

from tests.conftest import SLOWEST_FILES, pytest_collection_modifyitems

ROOT = Path(__file__).resolve().parent.parent


def test_every_slowest_file_exists() -> None:
    missing = [f for f in SLOWEST_FILES if not (ROOT / f).is_file()]
    assert not missing, f"tests/conftest.py SLOWEST_FILES names files that are gone: {missing}"


def test_the_slowest_files_go_first_then_the_others_by_test_count() -> None:
    ids = ["tests/a/test_one.py::t1",
           "tests/b/test_many.py::t1", "tests/b/test_many.py::t2", "tests/b/test_many.py::t3",
           f"{SLOWEST_FILES[1]}::second[x]", f"{SLOWEST_FILES[1]}::first",
           f"{SLOWEST_FILES[0]}::only"]
    items = [SimpleNamespace(nodeid=i) for i in ids]
    pytest_collection_modifyitems(items)
    assert [i.nodeid for i in items] == [
        f"{SLOWEST_FILES[0]}::only", f"{SLOWEST_FILES[1]}::second[x]", f"{SLOWEST_FILES[1]}::first",
        "tests/b/test_many.py::t1", "tests/b/test_many.py::t2", "tests/b/test_many.py::t3",
        "tests/a/test_one.py::t1"]


def test_a_files_cpu_counts_the_subprocesses_its_tests_waited_for() -> None:
    """What `make test` prints as CPU seconds by file: a kiln run is a subprocess, so its CPU must count."""
    import subprocess
    import sys

    from tests import cpu_report

    path = "tests/x/test_burn.py"
    protocol = cpu_report.pytest_runtest_protocol(SimpleNamespace(nodeid=f"{path}::t"), None)
    next(protocol)
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5: pass"
    subprocess.run([sys.executable, "-c", burn], check=True)  # half a CPU-second in a child the test waits for
    with contextlib.suppress(StopIteration):
        next(protocol)
    try:
        assert cpu_report._cpu[path] >= 0.45, dict(cpu_report._cpu)
    finally:
        cpu_report._cpu.pop(path, None)
