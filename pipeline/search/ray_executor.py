"""`search.executor: ray`: each candidate's stages of a phase run as a Ray task on a node of a cluster.

On its node a task opens the same tracking server, takes that node's own kiln cache ($KILN_CACHE
there: nodes share nothing but the tracking server), runs the candidate's build stages again (reused
where the node has them, rebuilt content-addressed where it has not: the same keys) and then the
phase's stages, which log their results and files to the tracking server as every stage does. The
driver reads each stage back from there into its run folder: the search then judges exactly what a
local run would, with no shared filesystem. What it reads back is checked against the stage's seal
(kiln.pipeline.provenance.stage_evidence) under the driver's trusted keys and those the node reports over Ray
(the driver already trusts the node it dispatched to compute), then sealed again by the driver over
the files it brought back, so the gate checks them as it checks its own.

Ray's resource counts are bookkeeping only. A task asks for the CPUs its engines' threads use (a GPU
where the engine runs on one); a timed phase (the decode benchmark, its confirmation, a load stage)
also takes the one unit of `kiln_timed` every node declares, so no two timed stages share a node,
and runs only on nodes whose hardware fingerprint (the one engines are keyed on) is the search's
target: `search.ray.hardware`, else the node the first candidate's build ran on. A paired benchmark
is one stage: both arms on one node. A task whose node dies is retried on another (Ray's retries;
a stage's folder becomes final only once written whole, so a half stage is never read).
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.core.errors import BadInput, KilnError
from kiln.core.files import atomic_dir, atomic_write_json, hash_of, read_json
from kiln.core.signing import key_id, public_pem, trusted_keys
from kiln.optimize.base import ModelArtifact
from kiln.pipeline.search.executor import CONFIRM
from kiln.pipeline.github.changes import GPU_BACKENDS
from kiln.pipeline.provenance.stage_evidence import ENVELOPE, check, seal
from kiln.pipeline.stages.base import RESULT, RunContext, StageOutcome
from kiln.pipeline.tracking.runs import CANDIDATE_TAG, REUSED, STAGE_KEY, Tracker, redact_uri

TIMED = "kiln_timed"  # the custom resource every node declares once: {"kiln_timed": 1}
NODE_TAG, HARDWARE_TAG = "kiln.node", "kiln.hardware"  # on every stage run a node computed
UPLOAD = "upload"  # a task's last step that sends the candidate's artifact to its MLflow run
RETRIES = 3  # a task whose node or worker dies runs again elsewhere, up to this many times
PROBE_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Node:
    """A node of the cluster, as the report names it."""

    id: str
    address: str
    cpus: float
    timed: bool
    hardware: str = ""  # hash of engine.cache.hardware_fingerprint() there

    @property
    def name(self) -> str:
        return f"{self.address} ({self.id[:8]})"


@dataclass(frozen=True)
class Task:
    """What a node needs to run one candidate's phases: sent to it by Ray, so nothing here is live."""

    phases: tuple[str, ...]
    arm: str
    mlflow_run: str
    recipe: Any
    recipe_path: str
    gate: Any
    fresh: frozenset[str]
    tracking_uri: str
    experiment: str
    arm_cls: Any  # the search's Arm and the function that runs phases on it, sent by reference
    run: Any
    champion: Any = None
    upload_to: str = ""  # with UPLOAD: the run whose `model/` receives the artifact (the pipeline's run)


@dataclass
class RayExecutor:
    """Connects on creation (an unreachable cluster is exit 2 in seconds) and surveys the nodes."""

    ctx: RunContext
    run_on_node: Any
    nodes: dict[str, Node] = field(default_factory=dict)
    hardware: str | None = None
    home: dict[str, str] = field(default_factory=dict)  # candidate -> the node its build ran on

    def __post_init__(self) -> None:
        section = self.ctx.recipe.search.ray
        self.address = section.address
        self.hardware = section.hardware
        if any(c.champion for c in self.ctx.recipe.candidates or []):
            raise BadInput("search.executor: ray does not yet serve the registry's champion on a node; run a search "
                           "with a `champion: true` candidate with search.executor local")
        connect(self.address)
        self.nodes = survey(self.address)
        self._task = _remote(_on_node)
        shown = ", ".join(f"{n.name}: {n.cpus:g} CPU, hardware {n.hardware[:12]}" + ("" if n.timed else ", untimed")
                          for n in self.nodes.values())
        self.ctx.console.print(f"[bold]ray[/bold]: {len(self.nodes)} nodes at {redact_uri(self.address)} ({shown})",
                               markup=True)

    def start(self, arm: Any, phase: str) -> Any:
        phases = ("build",) if phase == "build" else ("build", phase)
        task = Task(phases, arm.name, arm.mlflow_run, arm.ctx.recipe, str(arm.ctx.recipe_path), arm.ctx.gate,
                    frozenset(arm.ctx.fresh), self.ctx.tracker.uri, self.ctx.recipe.tracking.experiment,
                    type(arm), self.run_on_node, arm.champion)
        return phase, task, self._task.options(**self.options(arm, phase)).remote(task)

    def options(self, arm: Any, phase: str, strict: bool = False) -> dict[str, Any]:
        """Ray's resource request for `arm`'s `phase` (see the module's docstring). Each phase goes
        back to the node the candidate's build ran on, where it is (another node would first build it
        again: minutes for a real checkpoint), unless a timed phase may not run there; `strict`: a
        timed phase only on the nodes it may run on, with no preference."""
        cpus, gpus = engine_resources(arm.ctx.recipe, self.nodes.values())
        largest = max(n.cpus for n in self.nodes.values())
        if cpus > largest:
            raise BadInput(f"candidate {arm.name}: its engines use {cpus:g} threads, but no node of the Ray cluster at "
                           f"{redact_uri(self.address)} has more than {largest:g} CPUs; lower its engine.threads")
        opts: dict[str, Any] = {"num_cpus": cpus, "num_gpus": gpus, "max_retries": RETRIES,
                                "name": f"kiln {arm.name} {phase}"}
        timed = phase in timed_phases(arm.ctx.recipe)
        allowed = timed_nodes(self.nodes, self.hardware, self.address) if timed else []
        home = self.home.get(arm.name) or built_on(self.ctx.tracker, arm.ctx.recipe.name, arm.name, self.nodes)
        if timed:
            opts["resources"] = {TIMED: 1}
        if home and not strict and (not timed or home in allowed):
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            # soft: should the node be gone, anywhere else (`finish` checks where a timed phase ran)
            opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(home, soft=True)
        elif timed:
            opts["label_selector"] = {"ray.io/node-id": f"in({','.join(allowed)})"}
        return opts

    def finish(self, arm: Any, job: Any) -> None:
        phase, task, ref = job
        report = wait(ref)
        if phase in timed_phases(arm.ctx.recipe) and not report["node"]["hardware"].startswith(self.hardware or ""):
            # its build's node went away and Ray's fallback took a node of other hardware: measure where it may be
            report = wait(self._task.options(**self.options(arm, phase, strict=True)).remote(task))
        node = Node(**report["node"])
        if self.hardware is None:  # the first candidate's build sets the hardware speed is measured on
            self.hardware = node.hardware
        if phase == "build":
            self.home[arm.name] = node.id
        arm.engines = {role: Path(p) for role, p in report["engines"].items()}
        if report["artifact"]:
            arm.artifact = ModelArtifact(path=Path(report["artifact"]["path"]), manifest=report["artifact"]["manifest"])
        if report["eliminated"] and arm.eliminated is None:
            arm.eliminated = report["eliminated"]
        # the confirmation's figures beside the screening's: the report names the node of each
        arm.nodes.update({("confirmation" if phase == CONFIRM else stage): node for stage, node in report["timed"].items()})
        trusted = node_keys(report.get("keys", {}))
        for record in report["records"]:
            fetch_stage(arm.ctx, record, trusted)

    def bring_back(self, arm: Any) -> None:
        """The arm's artifact where the report registers it from, when it is not on this machine: a
        registry version holding it for this recipe needs nothing (a rerun uploads nothing), else a
        node uploads it to this run's `model/`, where the registry takes it from (issue 35: the
        artifact is stored once per registered version, never per rerun or twice in one run)."""
        from kiln.pipeline.tracking.registry import find, registered_name

        if arm.artifact is None or arm.artifact.path.exists():
            return
        if find(self.ctx.tracker.client, registered_name(arm.ctx.recipe), arm.artifact.manifest["sha256"],
                arm.ctx.recipe.digest()):
            return
        task = Task(("build", UPLOAD), arm.name, arm.mlflow_run, arm.ctx.recipe, str(arm.ctx.recipe_path),
                    arm.ctx.gate, frozenset(arm.ctx.fresh), self.ctx.tracker.uri, self.ctx.recipe.tracking.experiment,
                    type(arm), self.run_on_node, arm.champion, upload_to=self.ctx.parent_run)
        wait(self._task.options(num_cpus=1, max_retries=RETRIES, name=f"kiln {arm.name} upload").remote(task))

    def close(self) -> None:
        import ray

        ray.shutdown()


def _remote(fn: Any) -> Any:
    import ray

    return ray.remote(fn)


def timed_nodes(nodes: dict[str, Node], hardware: str | None, address: str) -> list[str]:
    """The nodes a timed stage may run on: they declare `kiln_timed` and have the target hardware."""
    timed = [n for n in nodes.values() if n.timed]
    if not timed:
        raise BadInput(f"search.ray.address: no node of the Ray cluster at {redact_uri(address)} declares the "
                       f"resource {TIMED}; start each node with --resources '{{\"{TIMED}\": 1}}' (docs/search.md)")
    matching = [n.id for n in timed if hardware is None or n.hardware.startswith(hardware)]
    if not matching:
        raise BadInput(f"search.ray.hardware: no node with {TIMED} has hardware {hardware}; the nodes have "
                       + ", ".join(sorted({n.hardware[:12] for n in timed})))
    return matching


def timed_phases(recipe: Any) -> set[str]:
    """The phases whose stages time something: the decode benchmark and its confirmation, and the
    last phase when it holds a load stage."""
    return {"speed", CONFIRM} | ({"rest"} if recipe.evaluate.load else set())


def engine_resources(recipe: Any, nodes: Any) -> tuple[float, float]:
    """(CPUs, GPUs) a candidate's phase asks for: the most threads either arm's engine uses (an engine
    left to all cores asks for the smallest node's count), and a GPU for an engine that runs on one."""
    cpus, gpus = 1.0, 0.0
    smallest = min((n.cpus for n in nodes), default=1.0)
    for role in ("baseline", "candidate"):
        cfg = recipe.engine_for(role)
        threads = getattr(cfg, "threads", None)
        cpus = max(cpus, float(threads) if threads else smallest)
        if cfg.backend in GPU_BACKENDS or str(getattr(cfg, "device", "") or "").startswith("cuda"):
            gpus = 1.0
    return cpus, gpus


def probe(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Fail in seconds when the cluster's head cannot be reached: ray.init retries an unreachable
    GCS for minutes before it says so. `auto` with nothing to find fails in ray.init at once."""
    target = os.environ.get("RAY_ADDRESS", "") if address == "auto" else address
    if not target or target == "auto":
        return
    parsed = urllib.parse.urlsplit(target if "://" in target else f"gcs://{target}")
    try:
        socket.create_connection((parsed.hostname or "127.0.0.1", parsed.port or 6379), timeout_s).close()
    except (OSError, ValueError) as e:
        raise unreachable(address, e) from None


def unreachable(address: str, e: BaseException) -> BadInput:
    reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e).splitlines()[0] if str(e) else type(e).__name__
    return BadInput(f"search.ray.address: cannot reach the Ray cluster at {redact_uri(address)} ({reason.lower()}). "
                    "Check that its head is running and the address is right (host:port of the head's GCS, "
                    "ray://head:10001, or auto on a node of the cluster), or set search.executor: local.")


def connect(address: str) -> None:
    import ray

    probe(address)
    try:
        ray.init(address=address, namespace="kiln", log_to_driver=True, logging_level="WARNING",
                 configure_logging=True)
    except (ConnectionError, RuntimeError, TimeoutError, ValueError) as e:
        raise unreachable(address, e) from None


def survey(address: str) -> dict[str, Node]:
    """Every alive node with its CPUs, whether it declares `kiln_timed`, and its hardware fingerprint."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    alive = [n for n in ray.nodes() if n.get("Alive")]
    if not alive:
        raise BadInput(f"search.ray.address: the Ray cluster at {redact_uri(address)} has no alive node")
    fingerprint = _remote(_hardware)
    refs = [fingerprint.options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False))
            .remote() for n in alive]
    hashes = ray.get(refs)
    return {n["NodeID"]: Node(n["NodeID"], n["NodeManagerAddress"], float(n["Resources"].get("CPU", 0)),
                              n["Resources"].get(TIMED, 0) >= 1, h) for n, h in zip(alive, hashes, strict=True)}


def _hardware() -> str:
    from kiln.engine.cache import hardware_fingerprint

    return hash_of(hardware_fingerprint())


def wait(job: Any) -> dict[str, Any]:
    """The task's report; a kiln error raised on the node is raised here as itself (its exit code holds)."""
    import ray
    from ray.exceptions import RayTaskError

    try:
        return ray.get(job)
    except RayTaskError as e:
        cause = getattr(e, "cause", None)
        if isinstance(cause, KilnError):
            raise cause from None
        raise
    except ray.exceptions.RayError as e:  # the node died more often than RETRIES allows, the cluster went away
        raise KilnError(f"the Ray cluster lost a candidate's task: {str(e).splitlines()[0]}") from None


def node_keys(reported: dict[str, str]) -> dict[str, Any]:
    """The driver's trusted keys and those a node reported (key id -> PEM public key), each loaded and
    its id recomputed: a node names what it trusts, not what its keys are called."""
    from cryptography.hazmat.primitives import serialization

    keys = trusted_keys()
    for pem in reported.values():
        key = serialization.load_pem_public_key(pem.encode())
        keys[key_id(key)] = key
    return keys


def fetch_stage(ctx: RunContext, record: dict[str, Any], trusted: dict[str, Any] | None = None) -> None:
    """A stage a node ran, read back from the tracking server into this run's folder (never into the
    cache: a build stage's files there would be its result without its model), from the run that
    computed it (a reuse's own run holds no files). Its seal is checked under `trusted` (a build stage
    comes back without its model: the files brought back must match, the rest stays on the node) and
    made again here over what came back; then it is recorded as a stage of `ctx`'s run, as run_stage
    records one it ran here."""
    name = f"{record['stage']}-{record['role']}"
    mine = ctx.run_dir / "stages" / f"{name}.json"
    if mine.exists() and read_json(mine)["key"] == record["key"]:
        return
    local = ctx.run_dir / "from-nodes" / record["stage"] / record["key"]
    if not (local / RESULT).exists():
        source = record.get("computed_by") or ctx.tracker.find_stage(record["key"]) or record["mlflow_run"]
        with atomic_dir(local) as tmp:
            ctx.tracker.download(source, "stage", tmp)
            verified = check(tmp, record["stage"], record["key"], trusted, present_only=True,
                             what=f"{name} from a node (MLflow run {source})")
            (tmp / ENVELOPE).unlink()
            seal(tmp, record["stage"], record["key"], verified.predicate["inputs"],
                 origin={"signed_by": verified.key_id, "mlflow_run": source, "node": record.get("node")})
    result = read_json(local / RESULT)
    ctx.outcomes[f"{record['stage']}:{record['role']}"] = StageOutcome(
        record["stage"], record["role"], record["key"], local, result, record["reused"], record["mlflow_run"])
    atomic_write_json(mine, {**record, "path": str(local), "node": record.get("node")})


# --- on the node ---


def _on_node(task: Task) -> dict[str, Any]:
    """Run `task.phases` of one candidate here; what the driver needs back (small: the files went to
    the tracking server)."""
    from kiln.pipeline.recipe.model_source import resolve_model

    ctx = _node_context(task)
    try:
        model = resolve_model(task.recipe.model.path, ctx.cache)
        arm = task.arm_cls(task.arm, ctx, task.mlflow_run, champion=task.champion)
        task.run(arm, tuple(p for p in task.phases if p != UPLOAD), model)
        if UPLOAD in task.phases and arm.artifact is not None:  # for the driver: the report registers it
            from kiln.pipeline.tracking.registry import upload

            upload(ctx.tracker, task.upload_to, arm.artifact)
        return _node_report(arm, ctx)
    finally:
        shutil.rmtree(ctx.run_dir, ignore_errors=True)


def _node_context(task: Task) -> RunContext:
    from rich.console import Console

    from kiln.core.home import kiln_cache

    cache = kiln_cache()
    (cache / "ray-tasks").mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix=f"{task.arm}-", dir=cache / "ray-tasks"))
    (run_dir / "stages").mkdir()
    return RunContext(recipe=task.recipe, recipe_path=Path(task.recipe_path), run_dir=run_dir, cache=cache,
                      tracker=Tracker(task.tracking_uri, task.experiment), parent_run=task.mlflow_run,
                      console=Console(), fresh=set(task.fresh), arm=task.arm, gate=task.gate)


def this_node() -> Node:
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    return Node(node_id, ray.util.get_node_ip_address(), 0.0, True, _hardware())


def _node_report(arm: Any, ctx: RunContext) -> dict[str, Any]:
    """The stage records of this task, each computed stage's MLflow run tagged with this node, and
    for each timed stage the node its figures came from (where a reused one was computed)."""
    node = this_node()
    records, timed = [], {}
    for path in sorted((ctx.run_dir / "stages").glob("*.json")):
        record = read_json(path)
        if not record["reused"]:
            ctx.tracker.log(record["mlflow_run"], tags={NODE_TAG: node.name, HARDWARE_TAG: node.hardware})
        record["node"] = node.name if not record["reused"] else computed_on(ctx.tracker, record["key"])
        if record["stage"] in ("benchmark", "load"):
            timed[record["stage"]] = record["node"]
        records.append(record)
    keys = {kid: public_pem(key) for kid, key in trusted_keys().items()}  # whose seals this node accepted
    return {"node": node.__dict__, "records": records, "timed": timed, "eliminated": arm.eliminated, "keys": keys,
            "engines": {role: str(p) for role, p in arm.engines.items()},
            "artifact": {"path": str(arm.artifact.path), "manifest": arm.artifact.manifest} if arm.artifact else None}


def built_on(tracker: Tracker, recipe: str, candidate: str, nodes: dict[str, Node]) -> str | None:
    """The id of the node, still in the cluster, that last built `candidate`'s engine for `recipe`:
    where a rerun of a killed search sends the candidate's phases, since that node's cache holds its
    build (a driver knows its own builds' nodes; this is the one it lost)."""
    runs = tracker.client.search_runs(
        [tracker.experiment_id], f"tags.`kiln.recipe` = '{recipe}' and tags.`{CANDIDATE_TAG}` = '{candidate}' and "
        f"tags.`kiln.stage` = 'engine' and tags.`kiln.role` = 'candidate' and tags.`{REUSED}` = 'false' and "
        "attributes.status = 'FINISHED'", max_results=1, order_by=["attributes.start_time DESC"])
    name = runs[0].data.tags.get(NODE_TAG) if runs else None
    return next((n.id for n in nodes.values() if n.name == name), None)


def computed_on(tracker: Tracker, key: str) -> str | None:
    """The node that computed the stage `key` (its first run that was not a reuse), if a node did."""
    runs = tracker.client.search_runs(
        [tracker.experiment_id], f"tags.`{STAGE_KEY}` = '{key}' and tags.`{REUSED}` = 'false'",
        max_results=1, order_by=["attributes.start_time ASC"])
    return runs[0].data.tags.get(NODE_TAG) if runs else None
