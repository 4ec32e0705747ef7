"""deploy/ray/rayjob.yaml, the RayJob that runs a kiln search on its own KubeRay cluster, against
KubeRay's RayJob CRD (v1.7.0's openAPIV3Schema for ray.io/v1, stored under tests/deploy/kuberay/ with
its source), checked as the API server checks a custom resource with strict field validation: an
unknown field is an error. (The CRD's CEL rules, x-kubernetes-validations, are not evaluated here.)
And what the job runs is what kiln accepts: its recipe with `search.executor: ray`, nodes that declare
the resource timed stages take and have the CPUs the recipe's engines ask for."""

from __future__ import annotations

import copy
import json
import shlex
from pathlib import Path

import jsonschema
import pytest
import yaml

from kiln.pipeline.search.ray_executor import TIMED
from kiln.pipeline.recipe.schema import load_recipe

REPO = Path(__file__).resolve().parents[2]
MANIFEST = REPO / "deploy" / "ray" / "rayjob.yaml"
SCHEMA = REPO / "tests" / "deploy" / "kuberay" / "ray.io_rayjobs.v1.schema.json"


def _strict(node):
    """The schema with every object that lists its properties closed to others (kubectl --validate=strict)."""
    if isinstance(node, dict):
        node = {k: _strict(v) for k, v in node.items()}
        if "properties" in node and "additionalProperties" not in node:
            node["additionalProperties"] = False
    elif isinstance(node, list):
        node = [_strict(v) for v in node]
    return node


@pytest.fixture(scope="module")
def validator():
    schema = json.loads(SCHEMA.read_text())
    assert "ray.io_rayjobs.yaml" in schema["$comment"] and "v1.7.0" in schema["$comment"]
    return jsonschema.Draft7Validator(_strict(schema))


def _errors(validator, doc) -> list[str]:
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]


def test_the_rayjob_validates_against_kuberays_crd(validator):
    doc = yaml.safe_load(MANIFEST.read_text())
    assert (doc["apiVersion"], doc["kind"]) == ("ray.io/v1", "RayJob")
    assert _errors(validator, doc) == []


def test_the_check_catches_typos_and_wrong_types(validator):
    doc = yaml.safe_load(MANIFEST.read_text())
    bad = copy.deepcopy(doc)
    bad["spec"]["entrypont"] = bad["spec"].pop("entrypoint")
    bad["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["replicas"] = "eight"
    bad["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["rayStartParams"]["num-cpus"] = 2
    text = "\n".join(_errors(validator, bad))
    assert "entrypont" in text and "'eight' is not of type 'integer'" in text and "2 is not of type 'string'" in text


def test_the_job_runs_a_recipe_kiln_accepts_on_nodes_that_fit_it():
    doc = yaml.safe_load(MANIFEST.read_text())
    argv = shlex.split(doc["spec"]["entrypoint"])
    assert argv[:2] == ["kiln", "run"]
    recipe_path = REPO / Path(argv[2]).relative_to("/app")  # the image holds the repository at /app
    overrides = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
    recipe = load_recipe(recipe_path, overrides)
    assert recipe.search.executor == "ray" and recipe.search.ray.address == "auto"  # the head the job runs on
    cluster = doc["spec"]["rayClusterSpec"]
    assert cluster["rayVersion"] == __import__("ray").__version__
    threads = max(recipe.engine_for("baseline").threads, *(c.engine.threads for c in recipe.candidates))
    for group in cluster["workerGroupSpecs"]:
        params = group["rayStartParams"]
        assert json.loads(json.loads(params["resources"])) == {TIMED: 1}  # as `ray start --resources` reads it
        assert float(params["num-cpus"]) >= threads
        env = {e["name"]: e.get("value") for e in group["template"]["spec"]["containers"][0]["env"]}
        assert env["KILN_CACHE"]  # the node's own cache
