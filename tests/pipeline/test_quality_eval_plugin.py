"""A quality eval is one file plus its registration: a toy eval registered here, outside kiln, with
its own recipe section and metric, is accepted by the recipe, run by the evaluate stage on each arm
of the tiny model, keyed, recorded and judged by the gate like the evals kiln ships.

The toy registers itself before kiln reads a recipe, as a plugin module would, then the real CLI
runs (`kiln run`); nothing of kiln is replaced.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

from tests.pipeline.conftest import kiln, write_recipe

# The toy: each arm's log-likelihood of every held-out document's second token given its first.
TOY = '''
import sys
from pydantic import BaseModel, ConfigDict, Field
from kiln.core.metrics import declare
from kiln.evaluate.quality.base import QUALITY_EVALS, QualityEval, QualityResult

declare("toy_second_token_logprob", True, "nats", "log-likelihood of a document's second token given its first",
        "quality", "evaluate.quality.toy")


class ToyConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    documents: int = Field(2, ge=1)


@QUALITY_EVALS.register("toy", ToyConfig)
class Toy(QualityEval):
    section = Field(None, description="the toy eval of tests/pipeline/test_quality_eval_plugin.py")
    stage = "toy"

    def inputs(self, given):
        return {**given.documents()[1], "documents": self.config.documents}

    def run(self, given, role, out):
        docs = given.documents()[0][:self.config.documents]
        scores = given.engines[role].score([(d[:1], d[1:2]) for d in docs])
        records = [{"doc_id": i, "toy_second_token_logprob": s.logprob} for i, s in enumerate(scores)]
        mean = sum(r["toy_second_token_logprob"] for r in records) / len(records)
        result = QualityResult("toy", records, {"toy_second_token_logprob": mean})
        return result.stage_result(out, ["toy_second_token_logprob"])


from kiln.pipeline.cli.main import main
main()
'''
CHECK = {"kind": "quality", "metric": "toy_second_token_logprob", "margin": 1.0}


def _toy_recipe(tmp_path: Path, model_dir: Path) -> Path:
    """The tiny recipe cut as `quick_recipe` cuts it (two documents, agreement off), with the toy on and gated."""
    return write_recipe(tmp_path / "toy.yaml", model_dir, name="toy", evaluate__quality__toy={"documents": 2},
                        evaluate__quality__perplexity={"text": "demo", "max_documents": 2, "seq_len": 64},
                        evaluate__quality__agreement=False,
                        evaluate__benchmark={"prompts": "demo", "num_prompts": 2, "max_new_tokens": 4, "repeats": 1},
                        gate={"checks": [{"kind": "size", "max_ratio": 1.0}, CHECK]})


def _with_toy(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """`kiln ARGS` with the toy registered first, in `cwd` (its kiln home, as `kiln` in conftest)."""
    return subprocess.run([sys.executable, "-c", TOY, *args], cwd=cwd, env={**os.environ, "KILN_HOME": str(cwd)},
                          capture_output=True, text=True, timeout=900)


def _stage(run_dir: Path, name: str) -> dict:
    return json.loads((run_dir / "stages" / f"{name}.json").read_text())


def test_a_registered_eval_is_a_recipe_section_a_stage_per_arm_and_a_gated_metric(tmp_path, tiny_model_dir):
    recipe = _toy_recipe(tmp_path, tiny_model_dir)
    unknown = kiln("validate", str(recipe), cwd=tmp_path)  # kiln alone: no such section
    assert unknown.returncode == 2 and "evaluate.quality.toy" in " ".join(unknown.stdout.split() + unknown.stderr.split())

    proc = _with_toy("run", str(recipe), cwd=tmp_path)
    assert proc.returncode in (0, 1, 3), proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = next((tmp_path / "runs").iterdir())
    metrics = {}
    for role in ("baseline", "candidate"):
        record = _stage(run_dir, f"toy-{role}")
        assert record["stage"] == "toy" and not record["reused"]
        lines = (Path(record["path"]) / "toy.jsonl").read_text().splitlines()
        assert [json.loads(line)["doc_id"] for line in lines] == [0, 1]
        metrics[role] = record["metrics"]["toy_second_token_logprob"]
        assert math.isfinite(metrics[role]) and metrics[role] < 0
        assert record["metrics"]["toy_peak_rss_bytes"] > 0  # the stage's memory, as every stage records it
    assert _stage(run_dir, "quality-baseline")["metrics"]["perplexity"] > 1  # the shipped evals still run beside it
    assert not (run_dir / "stages" / "agreement-candidate.json").exists()  # and one the recipe turns off does not
    verdict = json.loads((run_dir / "verdict.json").read_text())
    [toy] = [c for c in verdict["checks"] if c["name"] == "quality:toy_second_token_logprob"]
    assert toy["verdict"] != "Error" and toy["observed"] == metrics["candidate"]  # the gate read its records

    again = _with_toy("run", str(recipe), cwd=tmp_path)  # its stage key is stable: the second run reuses it
    assert again.returncode == proc.returncode, again.stdout[-3000:] + again.stderr[-3000:]
    newest = max((tmp_path / "runs").iterdir(), key=lambda p: p.stat().st_mtime)
    assert newest != run_dir and _stage(newest, "toy-candidate")["reused"]
    assert _stage(newest, "toy-candidate")["key"] == _stage(run_dir, "toy-candidate")["key"]
