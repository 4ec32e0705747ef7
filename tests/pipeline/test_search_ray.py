"""The search on a real Ray cluster (`search.executor: ray`): a head and a worker node on this host
(one CPU each, each its own kiln cache), the real `mlflow server` on PostgreSQL with S3 artifacts
(SeaweedFS) as the only thing they share. A three-candidate search across it ends as the same search
run here does (winner, verdict, exit code, stage keys); a worker node killed in the middle of a stage
costs a rerun elsewhere, not the verdict; an address nothing answers on fails in seconds (exit 2)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from tests.pipeline.conftest import TINY_RECIPE, fresh_cache, kiln
from tests.pipeline.test_search import CANDIDATES, CHECKS
from tests.ray_cluster import ray_cluster
from tests.tracking_servers import free_port, tracking_setup

# One thread each: every node has one CPU, and a stage asks Ray for the CPUs its engine's threads use.
ONE_THREAD = [{**c, "engine": {**c["engine"], "threads": 1}} for c in CANDIDATES]
WINNER = "fp32-copy"


def _recipe(path: Path, model_dir: Path, address: str, experiment: str) -> Path:
    raw = yaml.safe_load(yaml.safe_dump(TINY_RECIPE))
    del raw["optimize"], raw["engine"]
    raw.update(name="ray-search", model={"path": str(model_dir)}, candidates=ONE_THREAD,
               search={"executor": "ray", "ray": {"address": address}},
               baseline={"engine": {"backend": "torch", "threads": 1}})
    raw["evaluate"]["quality"]["lmeval"] = None
    raw["evaluate"]["quality"]["served"] = {"num_prompts": 4, "max_new_tokens": 6, "concurrency": 2}
    raw["evaluate"]["quality"]["perplexity"]["max_documents"] = 24
    raw["tracking"]["experiment"] = experiment
    raw["gate"]["checks"] = CHECKS
    path.write_text(yaml.safe_dump(raw))
    return path


def _outcome(work: Path, proc) -> dict:
    run_dir = max((work / "runs").iterdir(), key=lambda p: p.stat().st_mtime)
    record = json.loads((run_dir / "search.json").read_text())
    keys = {c.name: {p.stem: json.loads(p.read_text())["key"] for p in (c / "stages").glob("*.json")}
            for c in (run_dir / "candidates").iterdir()}
    # The winner's benchmark record is its confirmation's: keyed by this run, measured afresh by every run.
    keys.get(record["winner"], {}).pop("benchmark-pair", None)
    verdict = json.loads((run_dir / "verdict.json").read_text())
    return {"exit": proc.returncode, "winner": record["winner"], "verdict": verdict["verdict"], "keys": keys,
            "eliminated": {c["name"]: (c["eliminated"] or "").split(":")[0] for c in record["candidates"]},
            "run_dir": run_dir, "record": record}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    from kiln.core.signing import SIGNING_KEY_ENV, new_key

    work = tmp_path_factory.mktemp("ray-store")
    with tracking_setup("postgres-s3", work) as setup:
        # A team's machines sign with one key (docs/security.md): the driver, every node and the local reference
        # trust each other's stages and the registered model's policy pin.
        new_key(work / "team.pem")
        setup.env[SIGNING_KEY_ENV] = str(work / "team.pem")
        yield setup


@pytest.fixture(scope="module")
def local_search(tmp_path_factory, tiny_model_dir, store):
    """The same recipe with search.executor local: the reference every cluster run must match."""
    work = tmp_path_factory.mktemp("local")
    recipe = _recipe(work / "search.yaml", tiny_model_dir, "auto", "ray-local")
    proc = kiln("run", str(recipe), "--set", "search.executor=local", cwd=work,
                env={**store.env, "MLFLOW_TRACKING_URI": store.uri, "KILN_CACHE": str(fresh_cache(work / "cache"))})
    assert proc.returncode in (0, 1, 3), proc.stdout[-3000:] + proc.stderr[-3000:]
    return _outcome(work, proc)


def _cluster_run(work: Path, model_dir: Path, store, address: str, experiment: str, **popen):
    recipe = _recipe(work / "search.yaml", model_dir, address, experiment)
    cache = work / "driver-cache"  # the driver's machine: a rerun there finds it again
    env = {**store.env, "MLFLOW_TRACKING_URI": store.uri, "KILN_CACHE": str(cache if cache.exists() else fresh_cache(cache))}
    return subprocess.Popen([sys.executable, "-m", "kiln.pipeline", "run", str(recipe)], cwd=work, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**__import__("os").environ, **env},
                            **popen)


def test_a_search_across_two_nodes_ends_as_the_local_one(tmp_path, tiny_model_dir, store, local_search):
    with ray_cluster(tmp_path / "cluster", 2, store.env) as cluster:
        proc = _cluster_run(tmp_path, tiny_model_dir, store, cluster.address, "ray-cluster")
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode in (0, 1, 3), out[-4000:]
        ray_run = _outcome(tmp_path, proc)
        # Nothing was computed on the driver: its cache holds no stage, every stage came back through MLflow.
        assert not (tmp_path / "driver-cache" / "stages").exists()
        computed = {node: list((cache / "stages").glob("*/*")) for node, cache in cluster.caches.items()}
    assert {k: ray_run[k] for k in ("exit", "winner", "verdict", "eliminated", "keys")} == \
        {k: local_search[k] for k in ("exit", "winner", "verdict", "eliminated", "keys")}, out[-4000:]
    assert ray_run["winner"] == WINNER
    assert all(computed.values()), computed  # both nodes ran stages
    # Each speed figure names the node it came from, one of the cluster's; MLflow's stage runs say the same.
    client = MlflowClient(store.uri)
    arm_runs = client.search_runs([client.get_experiment_by_name("ray-cluster").experiment_id],
                                  "tags.`kiln.stage` = 'candidate'")
    nodes = {r.data.tags["kiln.candidate"]: r.data.tags.get("kiln.node.benchmark") for r in arm_runs}
    assert nodes[WINNER] and any(nodes[WINNER].endswith(f"({n[:8]})") for n in computed), nodes
    row = next(c for c in ray_run["record"]["candidates"] if c["name"] == WINNER)
    assert row["nodes"]["confirmation"] and row["nodes"]["benchmark"] == nodes[WINNER], row  # search.json too
    assert f"on {row['nodes']['confirmation']}" in (ray_run["run_dir"] / "report.md").read_text()


def _wait_for_stage_on(cache: Path, proc, timeout_s: float = 400) -> str:
    """The first stage the node starts computing after its build: a `.partial` folder under its cache."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        for partial in (cache / "stages").glob("*/*.partial"):
            if partial.parent.name in ("quality", "agreement", "benchmark", "served"):
                return f"{partial.parent.name}/{partial.name.removesuffix('.partial')}"
        time.sleep(0.2)
    raise AssertionError(f"no evaluation stage started on the worker node (kiln exit {proc.poll()})")


def test_a_worker_killed_mid_stage_costs_a_rerun_not_the_verdict(tmp_path, tiny_model_dir, store, local_search):
    with ray_cluster(tmp_path / "cluster", 2, store.env) as cluster:
        worker = list(cluster.caches)[1]
        proc = _cluster_run(tmp_path, tiny_model_dir, store, cluster.address, "ray-kill")
        stage, key = _wait_for_stage_on(cluster.caches[worker], proc).split("/")
        cluster.kill(worker)
        out, _ = proc.communicate(timeout=600)
        head_cache = next(iter(cluster.caches.values()))
        assert proc.returncode in (0, 1, 3), out[-4000:]
        killed_run = _outcome(tmp_path, proc)
        rerun_here = (head_cache / "stages" / stage / key / "result.json").exists()
    assert {k: killed_run[k] for k in ("exit", "winner", "verdict", "eliminated")} == \
        {k: local_search[k] for k in ("exit", "winner", "verdict", "eliminated")}, out[-4000:]
    # The stage the dead node was computing was computed again, whole, on the node left; the dead node's
    # MLflow run of it never finished, so no half result can be found by its key.
    assert rerun_here, (stage, key)
    client = MlflowClient(store.uri)
    runs = client.search_runs([client.get_experiment_by_name("ray-kill").experiment_id],
                              f"tags.`kiln.stage_key` = '{key}' and tags.`kiln.reused` = 'false'")
    finished = [r for r in runs if r.info.status == "FINISHED"]
    assert finished and all(not r.data.tags.get("kiln.node", "").endswith(f"({worker[:8]})") for r in finished)


def test_a_killed_driver_is_resumed_by_running_again_reusing_finished_stages(tmp_path, tiny_model_dir, store,
                                                                              local_search):
    with ray_cluster(tmp_path / "cluster", 2, store.env) as cluster:
        first = _cluster_run(tmp_path, tiny_model_dir, store, cluster.address, "ray-resume")
        judged = 0
        for line in first.stdout:  # every build judged, then the first candidate's perplexity: kill the driver
            # a judgment ("  name: passes every check up to …"), not the plan's "  name: to run: …" nor a
            # stage's progress line ("  name: engine[candidate]: 3/8 …")
            judged += line.startswith(tuple(f"  {c['name']}: " for c in ONE_THREAD)) \
                and ": to run: " not in line and not re.match(r"  \S+: \w+\[\w+\]: ", line)
            if judged == len(ONE_THREAD) + 1:
                first.kill()
                break
        first.wait(30)
        assert judged == len(ONE_THREAD) + 1 and first.returncode == -9, judged
        again = _cluster_run(tmp_path, tiny_model_dir, store, cluster.address, "ray-resume")
        out, _ = again.communicate(timeout=600)
        assert again.returncode in (0, 1, 3), out[-4000:]
        resumed = _outcome(tmp_path, again)
    assert {k: resumed[k] for k in ("exit", "winner", "verdict", "eliminated", "keys")} == \
        {k: local_search[k] for k in ("exit", "winner", "verdict", "eliminated", "keys")}, out[-4000:]
    records = {c.name: {p.stem: json.loads(p.read_text()) for p in (c / "stages").glob("*.json")}
               for c in (resumed["run_dir"] / "candidates").iterdir()}
    # What finished before the kill was not computed again: every build, and the perplexity judged.
    assert all(r[s]["reused"] for r in records.values() for s in ("optimize-candidate", "engine-candidate")), records
    assert any(r["quality-candidate"]["reused"] for r in records.values()), records


def test_a_rerun_finds_the_node_that_built_each_candidate(tmp_path):
    """A rerun's driver does not know where the killed one's builds ran; the tracking server does. The
    newest engine build a node computed for this recipe's candidate, on a node still in the cluster."""
    from kiln.pipeline.search.ray_executor import NODE_TAG, Node, built_on
    from kiln.pipeline.tracking.runs import Tracker

    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "resume")
    head, worker, gone = (Node(i * 16, f"192.0.2.{n}", 1.0, True) for n, i in ((1, "a"), (2, "b"), (3, "c")))
    nodes = {n.id: n for n in (head, worker)}

    def build(candidate: str, node: Node, reused: bool = False, status: str = "FINISHED",
              recipe: str = "ray-search", stage: str = "engine") -> None:
        run = tracker.start("build", {"kiln.recipe": recipe, "kiln.candidate": candidate, "kiln.stage": stage,
                                      "kiln.role": "candidate", "kiln.reused": str(reused).lower()})
        tracker.log(run, tags={} if reused else {NODE_TAG: node.name})
        tracker.end(run, status)
        time.sleep(0.01)  # start times apart: newest first

    assert built_on(tracker, "ray-search", "fp32-copy", nodes) is None  # nothing built yet: Ray places it
    build("fp32-copy", head)
    build("fp32-copy", worker, reused=True)  # a reuse holds nothing new
    build("fp32-copy", worker, stage="optimize")  # the engine is what takes minutes and is node-bound
    build("fp32-copy", worker, recipe="other")
    build("ct2-int8", worker)
    build("fp32-copy", worker, status="KILLED")  # a build the kill cut short left nothing there
    assert built_on(tracker, "ray-search", "fp32-copy", nodes) == head.id
    assert built_on(tracker, "ray-search", "ct2-int8", nodes) == worker.id
    build("ct2-int8", gone)  # its newest build's node left the cluster
    assert built_on(tracker, "ray-search", "ct2-int8", nodes) is None


def test_an_unreachable_cluster_fails_in_seconds_naming_the_address(tmp_path, tiny_model_dir, store):
    address = f"127.0.0.1:{free_port()}"
    recipe = _recipe(tmp_path / "search.yaml", tiny_model_dir, address, "ray-unreachable")
    started = time.monotonic()
    proc = kiln("run", str(recipe), cwd=tmp_path, env={**store.env, "MLFLOW_TRACKING_URI": store.uri})
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"cannot reach the Ray cluster at {address}" in proc.stdout + proc.stderr
    assert "search.ray.address" in proc.stdout + proc.stderr
    assert time.monotonic() - started < 60


# --- the executor's rules, without a cluster ---


def _nodes(*specs):
    from kiln.pipeline.search.ray_executor import Node

    return {f"n{i}": Node(f"n{i}" + "0" * 20, "10.0.0.%d" % i, cpus, timed, hardware)
            for i, (cpus, timed, hardware) in enumerate(specs)}


def test_timed_stages_go_only_to_nodes_with_the_resource_and_the_target_hardware():
    from kiln.core.errors import BadInput
    from kiln.pipeline.search.ray_executor import timed_nodes

    nodes = _nodes((2, True, "aaaa1111" * 8), (2, True, "bbbb2222" * 8), (2, False, "aaaa1111" * 8))
    assert timed_nodes(nodes, None, "auto") == [nodes["n0"].id, nodes["n1"].id]
    assert timed_nodes(nodes, "aaaa1111aaaa", "auto") == [nodes["n0"].id]  # n2 has no kiln_timed unit
    with pytest.raises(BadInput, match="search.ray.hardware: no node with kiln_timed has hardware cccc"):
        timed_nodes(nodes, "cccc3333cccc", "auto")
    with pytest.raises(BadInput, match="declares the resource kiln_timed"):
        timed_nodes(_nodes((2, False, "aaaa1111" * 8)), None, "ray://head:10001")


def test_a_phase_asks_for_the_cpus_its_engines_threads_use(tiny_model_dir, tmp_path):
    from kiln.pipeline.search.ray_executor import engine_resources
    from kiln.pipeline.recipe.schema import load_recipe

    recipe = load_recipe(_recipe(tmp_path / "r.yaml", tiny_model_dir, "auto", "x"))
    views = dict(recipe.arms())
    nodes = _nodes((4, True, "a" * 64), (8, True, "a" * 64)).values()
    assert engine_resources(views["ct2-int8"], nodes) == (1.0, 0.0)
    more = load_recipe(tmp_path / "r.yaml", ["baseline.engine.threads=3"])
    assert engine_resources(dict(more.arms())["ct2-int8"], nodes) == (3.0, 0.0)
    unset = load_recipe(tmp_path / "r.yaml", ["baseline.engine.threads=null"])  # all cores: the smallest node's
    assert engine_resources(dict(unset.arms())["ct2-int8"], nodes) == (4.0, 0.0)
