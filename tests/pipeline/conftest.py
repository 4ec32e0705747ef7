"""A real pipeline run on a tiny model, shared by the end-to-end, CI and browser tests."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

TINY_RECIPE = {
    "name": "tiny",
    "optimize": {"method": "int8_weight_only"},
    "engine": {"backend": "torch", "threads": 2},
    "evaluate": {
        "quality": {"perplexity": {"text": "demo", "max_documents": 12, "seq_len": 128}, "agreement": True,
                    "lmeval": {"tasks": ["word_swap"], "limit": 40}},
        "benchmark": {"prompts": "demo", "num_prompts": 3, "max_new_tokens": 8, "repeats": 3},
    },
    "gate": {"checks": [
        {"kind": "quality", "metric": "perplexity", "margin": 0.05, "relative": True},
        {"kind": "agreement", "metric": "top1_agreement", "min": 0.5},
        {"kind": "size", "max_ratio": 1.0},
        {"kind": "quality", "metric": "word_swap_acc", "margin": 0.1},
    ]},
    "tracking": {"experiment": "kiln-test"},
}


def write_recipe(path: Path, model_dir: Path, **changes) -> Path:
    recipe = yaml.safe_load(yaml.safe_dump(TINY_RECIPE))
    recipe["model"] = {"path": str(model_dir)}
    for dotted, value in changes.items():
        node = recipe
        *head, last = dotted.split("__")
        for part in head:
            node = node.setdefault(part, {})
        node[last] = value
    path.write_text(yaml.safe_dump(recipe))
    return path


def quick_recipe(path: Path, model_dir: Path, name: str) -> Path:
    """The tiny recipe cut to what a test of the run's plumbing needs: two perplexity documents, a
    two-prompt benchmark of one round and one size check."""
    return write_recipe(path, model_dir, name=name,
                        evaluate__quality={"perplexity": {"text": "demo", "max_documents": 2, "seq_len": 64},
                                           "agreement": False},
                        evaluate__benchmark={"prompts": "demo", "num_prompts": 2, "max_new_tokens": 4, "repeats": 1},
                        gate={"checks": [{"kind": "size", "max_ratio": 1.0}]})


def fresh_cache(path: Path) -> Path:
    """An empty kiln cache (no stage, no engine, no hash) as a new machine has, but for the demo data,
    linked from the shared test cache: a new machine runs `kiln prepare-demo` once, not per test."""
    path.mkdir(parents=True)
    (path / "data").symlink_to(Path(os.environ["KILN_CACHE"]) / "data", target_is_directory=True)
    return path


def kiln(*args, cwd: Path, env: dict | None = None, check: bool = False, **kw) -> subprocess.CompletedProcess:
    """`kiln ARGS` in `cwd`, whose kiln home is `cwd` unless `env` names one: the tests that read
    cwd/runs and cwd/mlflow.db were written when runs landed in the current folder (tests/pipeline/
    test_home.py checks that they no longer do)."""
    full_env = {**os.environ, "KILN_HOME": str(cwd), **(env or {})}
    return subprocess.run([sys.executable, "-m", "kiln.pipeline", *args], cwd=cwd, env=full_env,
                          capture_output=True, text=True, check=check, **kw)


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory, tiny_model_dir):
    """`kiln run` on the tiny recipe in its own working directory (its own mlflow.db)."""
    work = tmp_path_factory.mktemp("tiny-run")
    recipe = write_recipe(work / "tiny.yaml", tiny_model_dir)
    proc = kiln("run", str(recipe), cwd=work)
    assert proc.returncode in (0, 1, 3), proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = next((work / "runs").iterdir())
    return {"work": work, "recipe": recipe, "run_dir": run_dir, "proc": proc}
