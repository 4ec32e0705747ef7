"""Two `kiln run`s of one recipe at once on one cache and one (new) sqlite store — two CI jobs, two
terminals — started 0, 2 and 10 s apart: both finish with the same verdict, in their own run
folders; each stage is computed once and reused by the other run; the store is created once; the
registry holds one version whose artifact hash matches the bytes on disk; no run is left RUNNING."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from kiln.core.files import sha256_tree
from tests.pipeline.conftest import fresh_cache, write_recipe

# What is under test is the locking, not the figures: every stage kind a run computes, each as small as it goes.
SMALL = {"evaluate__quality": {"perplexity": {"text": "demo", "max_documents": 4, "seq_len": 64}, "agreement": True},
         "evaluate__benchmark": {"prompts": "demo", "num_prompts": 2, "max_new_tokens": 4, "repeats": 2},
         "gate": {"checks": [{"kind": "quality", "metric": "perplexity", "margin": 0.05, "relative": True},
                             {"kind": "agreement", "metric": "top1_agreement", "min": 0.5},
                             {"kind": "size", "max_ratio": 1.0}]}}


@pytest.mark.parametrize("delay_s", [0, 2, 10])
def test_two_runs_at_once_agree_and_share_their_stages(delay_s, tmp_path, tiny_model_dir):
    work, cache = tmp_path / "work", fresh_cache(tmp_path / "cache")
    work.mkdir()
    recipe = write_recipe(tmp_path / "small.yaml", tiny_model_dir, name="twice", **SMALL)
    env = {**os.environ, "KILN_CACHE": str(cache), "KILN_HOME": str(work)}  # runs/ and mlflow.db in work
    env.pop("MLFLOW_TRACKING_URI", None)
    procs = []
    for i in range(2):
        if i:
            time.sleep(delay_s)
        log = open(tmp_path / f"run{i}.log", "w")  # noqa: SIM115 - closed below
        procs.append((subprocess.Popen([sys.executable, "-m", "kiln.pipeline", "run", str(recipe)], cwd=work, env=env,
                                       stdout=log, stderr=subprocess.STDOUT), log))
    codes = []
    for proc, log in procs:
        codes.append(proc.wait(timeout=600))
        log.close()
    logs = [(tmp_path / f"run{i}.log").read_text() for i in range(2)]
    assert codes[0] == codes[1] and codes[0] in (0, 1, 3), "\n\n".join(text[-2500:] for text in logs)

    run_dirs = sorted((work / "runs").iterdir())
    assert len(run_dirs) == 2
    verdicts = [json.loads((d / "verdict.json").read_text()) for d in run_dirs]
    assert verdicts[0] == verdicts[1]
    stages = [{p.stem: json.loads(p.read_text()) for p in (d / "stages").glob("*.json")} for d in run_dirs]
    assert set(stages[0]) == set(stages[1])
    for name in stages[0]:
        a, b = stages[0][name], stages[1][name]
        assert a["key"] == b["key"], name
        assert sorted([a["reused"], b["reused"]]) == [False, True], f"{name}: computed by both runs or by neither"

    uri = f"sqlite:///{work / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    versions = client.search_model_versions("name = 'twice'")
    assert len(versions) == 1, [v.version for v in versions]
    on_disk = Path(stages[0]["optimize-candidate"]["path"]) / "model"
    hashed = tmp_path / "hashed"
    hashed.mkdir()
    for f in on_disk.iterdir():
        if f.name != "kiln-artifact.json":  # the manifest is written beside the weights after hashing them
            (hashed / f.name).symlink_to(f)
    assert versions[0].tags["kiln.artifact_sha256"] == sha256_tree(hashed)
    assert versions[0].tags["kiln.registration"] == "complete"
    exp = client.get_experiment_by_name("kiln-test")
    statuses = {r.info.status for r in client.search_runs([exp.experiment_id], max_results=1000)}
    assert statuses == {"FINISHED"}, statuses
    assert len([r for r in client.search_runs([exp.experiment_id], "tags.`kiln.kind` = 'pipeline'")]) == 2
