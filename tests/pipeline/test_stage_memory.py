"""Each stage records its own peak resident memory: kiln's process and the processes it started."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

from rich.console import Console

from kiln.pipeline.stages.base import MANIFEST, RESULT, _compute

MB = 2**20
# A child that holds `mb` MB, frees it when told to (a line on stdin), then waits to be closed.
CHILD = ("import sys; block = bytearray({mb} * 2**20); block[::4096] = b'\\1' * len(block[::4096]); "
         "print('holding', flush=True); sys.stdin.readline(); del block; print('freed', flush=True); "
         "sys.stdin.readline()")


def _child(mb: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", CHILD.format(mb=mb)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "holding"
    return proc


def _release(proc: subprocess.Popen) -> None:
    proc.stdin.write("\n")
    proc.stdin.flush()
    assert proc.stdout.readline().strip() == "freed"


def _rss() -> int:
    """This process's resident memory now."""
    status = Path("/proc/self/status").read_text()
    return next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmRSS:"))


def _run(tmp_path: Path, stage: str, compute) -> tuple[dict, dict]:
    ctx = SimpleNamespace(console=Console(quiet=True))
    path = tmp_path / "stages" / stage / "key"  # where run_stage puts it: the folder names the stage
    _compute(ctx, f"{stage}[candidate]", "key", {}, compute, path)
    return json.loads((path / RESULT).read_text()), json.loads((path / MANIFEST).read_text())


def test_a_stage_counts_the_server_it_starts(tmp_path):
    procs = []

    def compute(out: Path) -> dict:
        procs.append(_child(300))  # like llama-server: started by the stage, alive while it measures
        return {"metrics": {"x": 1.0}}

    before = _rss()
    try:
        result, manifest = _run(tmp_path, "served", compute)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    children = manifest["children_peak_pss_bytes"]
    assert children > 290 * MB, children / MB
    # kiln itself did not hold the 300 MB: its peak is what it held when the stage began (a pytest
    # worker that ran other tests may hold a GB or more), not that plus the child's
    assert manifest["peak_rss_bytes"] < before + 200 * MB, (manifest["peak_rss_bytes"] - before) / MB
    assert [c["pid"] for c in manifest["children"]] == [procs[0].pid]
    # In the result's metrics under the stage's name (MLflow, the report), beside the stage's own.
    assert result["metrics"]["x"] == 1.0
    assert result["metrics"]["served_children_peak_pss_bytes"] == children
    assert result["metrics"]["served_peak_rss_bytes"] == manifest["peak_rss_bytes"]


def test_a_server_from_an_earlier_stage_counts_from_this_stage_on(tmp_path):
    # A server an earlier stage started and this one keeps using: its 300 MB peak came before.
    server = _child(300)
    try:
        _release(server)
        _, manifest = _run(tmp_path, "benchmark", lambda out: {"metrics": {}})
    finally:
        server.kill()
        server.wait()
    (child,) = manifest["children"]
    assert child["pid"] == server.pid
    assert child["peak_rss_bytes"] < 100 * MB, child["peak_rss_bytes"] / MB


def test_kiln_process_peak_is_the_stage_s_own(tmp_path):
    def big(out: Path) -> dict:
        block = bytearray(400 * MB)
        block[::4096] = b"\1" * len(block[::4096])
        return {"metrics": {}}

    large = _run(tmp_path, "quality", big)[1]
    small_result, small = _run(tmp_path, "agreement", lambda out: {"metrics": {}})
    assert large["peak_rss_bytes"] - small["peak_rss_bytes"] > 300 * MB
    assert small["peak_rss_reset"] is True  # this kernel resets VmHWM; where not, the manifest says so
    assert small_result["metrics"]["agreement_peak_rss_bytes"] == small["peak_rss_bytes"]
    assert small["children"] == [] and small["children_peak_pss_bytes"] == 0
