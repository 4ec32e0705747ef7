"""What a stage's manifest says about the stage alone."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from rich.console import Console

from kiln.pipeline.stages.base import MANIFEST, _compute

MB = 2**20


def _stage(tmp_path: Path, name: str, allocate_mb: int) -> dict:
    def compute(out: Path) -> dict:
        block = bytearray(allocate_mb * MB)
        block[::4096] = b"\1" * len(block[::4096])  # touch every page: resident, not just reserved
        del block
        return {"metrics": {}}

    ctx = SimpleNamespace(console=Console(quiet=True))
    _compute(ctx, name, name, {}, compute, tmp_path / name)
    return json.loads((tmp_path / name / MANIFEST).read_text())


def test_each_stage_records_its_own_peak_memory_not_the_process_peak_so_far(tmp_path):
    # Stages run one after another in one `kiln run` process: a small stage after a large one
    # must not report the large one's peak (getrusage's ru_maxrss only ever grows).
    large = _stage(tmp_path, "large", 400)["peak_rss_bytes"]
    small = _stage(tmp_path, "small", 8)["peak_rss_bytes"]
    assert large - small > 300 * MB, (large / MB, small / MB)
    assert small > 8 * MB
