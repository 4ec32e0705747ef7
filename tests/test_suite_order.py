"""The suite's own schedule (tests/conftest.py): the slowest files go out to the test workers first,
each file's tests kept together and in their order; a renamed slow file is named here, not dropped
silently to the end of the run."""

from __future__ import annotations

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
