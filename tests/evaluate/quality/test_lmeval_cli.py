"""lm-eval's own CLI with `--model kiln` on a built engine folder gives the in-process numbers.

Slow: the CLI always indexes lm-eval's built-in tasks (~14 s idle, minutes on a busy machine)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kiln.engine.cache import build_engine
from kiln.engine.hf_torch import TorchEngineConfig
from kiln.evaluate.quality.lmeval import prepare_tasks, run_lmeval

pytestmark = pytest.mark.slow


def test_cli_model_kiln_from_an_engine_folder(engine, tiny_model_dir, data, tmp_path):
    engine_dir = build_engine(TorchEngineConfig(threads=1), tiny_model_dir, "tiny-sha", tmp_path / "engines")
    tasks = prepare_tasks(["word_swap"], tmp_path / "tasks", data)
    proc = subprocess.run(
        [sys.executable, "-m", "kiln.evaluate.quality.lmeval_adapter", "run", "--model", "kiln",
         "--model_args", f"engine_dir={engine_dir}", "--batch_size", "4", "--tasks", "word_swap",
         "--include_path", str(tasks.include_paths[0]), "--limit", "6", "--output_path", str(tmp_path / "cli")],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (results_file,) = (tmp_path / "cli").rglob("results_*.json")
    cli = json.loads(results_file.read_text())["results"]["word_swap"]["acc,none"]
    (ours,) = run_lmeval(engine, ["word_swap"], tasks.include_paths, 6, tmp_path / "ours")
    assert cli == pytest.approx(ours.metrics["word_swap_acc"])
