"""Evidence is content-addressed and verified (issue 52, point 1), tried as an attacker would.

A stage's folder is sealed when it is computed (kiln.pipeline.provenance.stage_evidence): the digests of what it read
and of every file it wrote, signed. Whoever can write the cache or the tracking server can edit a result
or a samples file, add a run tagged with a stage's key, or re-sign a folder with a key of their own; each
is caught on reuse and computed again (said so), or refused by the gate (exit 5), never trusted. A reuse
uploads nothing, so a forgery cannot spread by being reused.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
from rich.console import Console

from kiln.core import signing
from kiln.core.errors import NotVerified
from kiln.pipeline.provenance import stage_evidence
from kiln.pipeline.provenance.evidence import evidence_from_run
from kiln.pipeline.provenance.stage_evidence import ENVELOPE, check, seal, stage_key
from kiln.pipeline.stages.base import RunContext, run_stage
from tests.pipeline.conftest import fresh_cache, kiln, write_recipe
from tests.tracking_servers import tracking_setup

FORGED = 1000.0  # the forgery: the candidate 1000x as fast as it is


# --- the seal itself ---


def _sealed(tmp_path: Path, stage: str = "quality", inputs: dict | None = None) -> tuple[Path, str]:
    inputs = inputs or {"engine": "e1"}
    key = stage_key(stage, inputs)
    folder = tmp_path / stage / key
    (folder / "sub").mkdir(parents=True)
    (folder / "result.json").write_text(json.dumps({"metrics": {"perplexity": 12.5}}))
    (folder / "sub" / "samples.jsonl").write_text('{"doc_id": 0, "nll": 1.5}\n')
    seal(folder, stage, key, inputs)
    return folder, key


def test_a_sealed_stage_checks_and_every_change_is_named(tmp_path):
    folder, key = _sealed(tmp_path)
    verified = check(folder, "quality", key)
    assert set(verified.subjects()) == {"result.json", "sub/samples.jsonl"}
    assert verified.predicate["inputs"] == {"engine": "e1"} and verified.predicate["key"] == key
    cases = [
        (lambda: (folder / "sub" / "samples.jsonl").write_text('{"doc_id": 0, "nll": 0.1}\n'),
         "sub/samples.jsonl has changed since the stage sealed it"),
        (lambda: (folder / "extra.json").write_text("{}"), "extra.json was not written by the stage"),
        (lambda: (folder / "result.json").unlink(), "result.json is missing"),
    ]
    for edit, said in cases:
        folder, key = _sealed(tmp_path / said.split()[0])
        edit()
        with pytest.raises(NotVerified, match=said):
            check(folder, "quality", key)
    with pytest.raises(NotVerified, match="not benchmark key"):
        check(folder, "benchmark", key)  # a folder moved under another stage's key
    (folder / ENVELOPE).unlink()
    with pytest.raises(NotVerified, match="no sealed evidence"):
        check(folder, "quality", key)


def test_a_seal_made_with_a_key_nobody_trusts_or_edited_after_signing_is_refused(tmp_path, monkeypatch):
    signing.new_key(tmp_path / "mallory.pem")
    monkeypatch.setenv(signing.SIGNING_KEY_ENV, str(tmp_path / "mallory.pem"))
    folder, key = _sealed(tmp_path / "mallory")  # a whole consistent folder, signed by the attacker
    monkeypatch.delenv(signing.SIGNING_KEY_ENV)
    with pytest.raises(NotVerified, match="which this machine does not trust"):
        check(folder, "quality", key)
    # The attacker edits the result and rewrites the digest in the statement, but cannot sign it.
    folder, key = _sealed(tmp_path / "edited")
    (folder / "result.json").write_text(json.dumps({"metrics": {"perplexity": 1.0}}))
    envelope = json.loads((folder / ENVELOPE).read_text())
    statement = json.loads(signing.base64.b64decode(envelope["payload"]))
    for s in statement["subject"]:
        if s["name"] == "result.json":
            s["digest"]["sha256"] = signing.sha256_bytes((folder / "result.json").read_bytes())
    envelope["payload"] = signing.base64.b64encode(json.dumps(statement).encode()).decode()
    (folder / ENVELOPE).write_text(json.dumps(envelope))
    with pytest.raises(NotVerified, match="does not match its content"):
        check(folder, "quality", key)


def test_a_file_rewritten_in_place_with_its_mtime_restored_is_hashed_again(tmp_path, monkeypatch):
    """The stat cache skips rehashing an unchanged file, and only that: `cp -p` or `rsync -a` of other
    bytes of the same size, mtime put back, changes the ctime, which no user tool can set."""
    folder, key = _sealed(tmp_path)
    samples = folder / "sub" / "samples.jsonl"
    hashed = []
    real = stage_evidence.sha256_file
    monkeypatch.setattr(stage_evidence, "sha256_file", lambda p: hashed.append(Path(p).name) or real(p))
    check(folder, "quality", key)
    assert hashed == []  # sealed a moment ago: nothing to rehash
    before = samples.stat()
    samples.write_text('{"doc_id": 0, "nll": 0.5}\n')  # the same size
    os.utime(samples, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert samples.stat().st_size == before.st_size and samples.stat().st_mtime_ns == before.st_mtime_ns
    with pytest.raises(NotVerified, match="sub/samples.jsonl has changed"):
        check(folder, "quality", key)
    assert hashed == ["samples.jsonl"]


# --- reuse from the cache ---


class _Tracker(SimpleNamespace):
    """What a stage logs, recorded: which runs got files, and their tags."""

    def __init__(self) -> None:
        super().__init__(runs=0, artifacts=[], tags={})

    def start(self, *a, **k) -> str:
        self.runs += 1
        return f"run{self.runs}"

    def log(self, run_id, metrics={}, params={}, tags={}) -> None:
        self.tags.setdefault(run_id, {}).update(tags)

    def log_artifacts(self, run_id, path, artifact_path=None) -> None:
        self.artifacts.append(run_id)

    def end(self, *a, **k) -> None:
        pass

    def find_stage(self, key) -> None:
        return None


def _ctx(tmp_path: Path, console: Console, tracker: _Tracker | None = None, run: str = "run") -> RunContext:
    recipe = SimpleNamespace(name="r", digest=lambda: "d")
    (tmp_path / run / "stages").mkdir(parents=True, exist_ok=True)
    return RunContext(recipe, tmp_path / "r.yaml", tmp_path / run, tmp_path / "cache", tracker or _Tracker(),
                      "parent", console)


def _quality(calls: list) -> callable:
    """A quality stage's shape: a result naming a per-document samples file it wrote beside it."""
    def compute(out: Path) -> dict:
        calls.append(out)
        (out / "samples.jsonl").write_text("".join(json.dumps({"doc_id": i, "nll": 2.0}) + "\n" for i in range(4)))
        return {"metrics": {"perplexity": 7.4}, "samples": {"file": "samples.jsonl", "columns": ["nll"]}}
    return compute


def _build(out: Path) -> dict:
    """An optimize stage's shape: a model folder, its manifest beside the weights."""
    (out / "model").mkdir()
    (out / "model" / "weights.bin").write_bytes(b"w" * 1024)
    (out / "model" / "kiln-artifact.json").write_text(json.dumps({"sha256": "a" * 64}))
    return {"metrics": {"size_bytes": 1024}}


def _said(console: Console) -> str:
    return " ".join(console.export_text(clear=False).split())


def test_a_doctored_result_in_the_cache_is_computed_again_and_said_so(tmp_path):
    console, calls = Console(record=True, width=200), []
    first = run_stage(_ctx(tmp_path, console), "quality", "candidate", {"x": 1}, _quality(calls))
    forged = json.loads((first.path / "result.json").read_text())
    forged["metrics"]["perplexity"] = 1.0  # "the candidate is as good as it gets"
    (first.path / "result.json").write_text(json.dumps(forged))
    again = run_stage(_ctx(tmp_path, console), "quality", "candidate", {"x": 1}, _quality(calls))
    assert not again.reused and len(calls) == 2 and again.result["metrics"]["perplexity"] == 7.4
    assert "! quality[candidate]: its cached copy: result.json has changed since the stage sealed it" in _said(console)
    assert "computing it again" in _said(console)
    assert run_stage(_ctx(tmp_path, console), "quality", "candidate", {"x": 1}, _quality(calls)).reused


def test_a_doctored_samples_file_is_refused_by_the_gate_and_computed_again_on_reuse(tmp_path):
    console, calls = Console(record=True, width=200), []
    run_stage(_ctx(tmp_path, console), "quality", "baseline", {"x": 0}, _quality(calls))
    first = run_stage(_ctx(tmp_path, console), "quality", "candidate", {"x": 1}, _quality(calls))
    assert evidence_from_run(tmp_path / "run")["candidate"].samples["nll"]["0"] == 2.0
    # Between the stage and the gate, the candidate's per-document losses are lowered.
    samples = first.path / "samples.jsonl"
    samples.write_text(samples.read_text().replace('"nll": 2.0', '"nll": 0.1'))
    with pytest.raises(NotVerified, match="samples.jsonl has changed since the stage sealed it"):
        evidence_from_run(tmp_path / "run")
    again = run_stage(_ctx(tmp_path, console, run="run2"), "quality", "candidate", {"x": 1}, _quality(calls))
    assert not again.reused and len(calls) == 3
    assert "samples.jsonl has changed" in _said(console)


def test_a_stage_cached_before_stages_were_sealed_is_computed_once_more_and_said_so(tmp_path):
    console, calls = Console(record=True, width=200), []
    first = run_stage(_ctx(tmp_path, console), "quality", "candidate", {"x": 1}, _quality(calls))
    (first.path / ENVELOPE).unlink()  # what an older kiln left in the cache
    assert not run_stage(_ctx(tmp_path, console), "quality", "candidate", {"x": 1}, _quality(calls)).reused
    assert "no sealed evidence" in _said(console)
    assert run_stage(_ctx(tmp_path, console), "quality", "candidate", {"x": 1}, _quality(calls)).reused
    assert len(calls) == 2


def test_a_reuse_uploads_nothing_and_names_the_run_that_computed_it(tmp_path):
    console, tracker = Console(record=True, width=200), _Tracker()
    computed = run_stage(_ctx(tmp_path, console, tracker), "quality", "candidate", {"x": 1}, _quality([]))
    assert tracker.artifacts == [computed.mlflow_run] and tracker.tags[computed.mlflow_run]["kiln.reused"] == "false"
    reused = run_stage(_ctx(tmp_path, console, tracker), "quality", "candidate", {"x": 1}, _quality([]))
    assert reused.reused and tracker.artifacts == [computed.mlflow_run]  # no second copy
    assert tracker.tags[reused.mlflow_run] == {"kiln.reused": "true", "kiln.reused_from": computed.mlflow_run}
    record = json.loads((tmp_path / "run" / "stages" / "quality-candidate.json").read_text())
    assert record["computed_by"] == computed.mlflow_run and record["mlflow_run"] == reused.mlflow_run


# --- the real CLI ---


def _speed_recipe(path: Path, model_dir: Path, **changes) -> Path:
    """The issue's reproduction, small: a gate no honest run of this candidate passes (50x the baseline's
    decode speed), and a perplexity stage whose per-document losses the gate pairs."""
    return write_recipe(path, model_dir, name="forged", **{
        "evaluate__quality": {"perplexity": {"text": "demo", "max_documents": 4, "seq_len": 64}, "agreement": False},
        "evaluate__benchmark": {"prompts": "demo", "num_prompts": 2, "max_new_tokens": 8, "repeats": 3},
        "gate": {"checks": [{"kind": "performance", "metric": "decode_tok_s", "min_ratio": 50},
                            {"kind": "quality", "metric": "perplexity", "margin": 0.05, "relative": True}]},
        **changes})


def _forge_speed(folder: Path) -> None:
    """The benchmark's result with the candidate FORGED times as fast, every figure the gate reads."""
    result = json.loads((folder / "result.json").read_text())
    part = result["per_role"]["candidate"]
    part["repeats"]["decode_tok_s"] = [v * FORGED for v in part["repeats"]["decode_tok_s"]]
    part["metrics"]["decode_tok_s"] *= FORGED
    result["metrics"]["candidate.decode_tok_s"] *= FORGED
    result.pop("stopped", None)
    (folder / "result.json").write_text(json.dumps(result))


def _stages(run_dir: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in (run_dir / "stages").glob("*.json")}


def _newest_run(work: Path) -> Path:
    return max((work / "runs").iterdir(), key=lambda p: p.stat().st_mtime)


def _ratio(run_dir: Path) -> float:
    stages = _stages(run_dir)
    result = json.loads((Path(stages["benchmark-pair"]["path"]) / "result.json").read_text())
    return result["per_role"]["candidate"]["metrics"]["decode_tok_s"] / result["per_role"]["baseline"]["metrics"]["decode_tok_s"]


def test_a_doctored_cache_is_computed_again_by_kiln_run(tmp_path, tiny_model_dir):
    """The issue's second reproduction: the benchmark's result.json in the local cache edited to 1000x the
    candidate's speed (and the perplexity stage's samples to a better candidate) made the next run pass."""
    env = {"KILN_CACHE": str(fresh_cache(tmp_path / "cache"))}
    recipe = _speed_recipe(tmp_path / "r.yaml", tiny_model_dir)
    first = kiln("run", str(recipe), cwd=tmp_path, env=env)
    assert first.returncode in (1, 3), first.stdout[-3000:] + first.stderr[-3000:]
    honest = _stages(_newest_run(tmp_path))
    _forge_speed(Path(honest["benchmark-pair"]["path"]))
    samples = next(Path(honest["quality-candidate"]["path"]).glob("*.jsonl"))
    samples.write_text(samples.read_text().replace('"doc_id"', '"forged": 1, "doc_id"'))
    second = kiln("run", str(recipe), cwd=tmp_path, env=env)
    said = " ".join(second.stdout.split())
    assert second.returncode in (1, 3), said[-3000:] + second.stderr[-3000:]
    # Each doctored stage is said so and not used: the run's own tracking store (./mlflow.db) holds the
    # honest copy, sealed by this machine, which replaces it; nothing forged is read.
    assert "its cached copy: result.json has changed since the stage sealed it" in said, said[:3000]
    assert f"its cached copy: {samples.name} has changed since the stage sealed it" in said
    again = _stages(_newest_run(tmp_path))
    assert again["benchmark-pair"]["computed_by"] == honest["benchmark-pair"]["mlflow_run"]
    assert "forged" not in samples.read_text() and _ratio(_newest_run(tmp_path)) < 50
    # With no honest copy anywhere (the tracking store moved), the doctored stage is computed again.
    _forge_speed(Path(honest["benchmark-pair"]["path"]))
    third = kiln("run", str(recipe), cwd=tmp_path, env={**env, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'new.db'}"})
    said = " ".join(third.stdout.split())
    assert third.returncode in (1, 3), said[-3000:] + third.stderr[-3000:]
    assert "! benchmark[pair]: its cached copy: result.json has changed since the stage sealed it" in said, said[:3000]
    assert "computing it again ▶ benchmark[pair]" in said
    again = _stages(_newest_run(tmp_path))
    assert not again["benchmark-pair"]["reused"] and again["quality-candidate"]["reused"]
    assert _ratio(_newest_run(tmp_path)) < 50


# --- the tracking server: a real `mlflow server` on PostgreSQL with S3 artifacts ---


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    with tracking_setup("postgres-s3", tmp_path_factory.mktemp("forged-store")) as setup:
        saved = {k: os.environ.get(k) for k in setup.env}
        os.environ.update(setup.env)  # this process reads and forges through the same S3 store
        try:
            yield setup
        finally:
            for k, v in saved.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def _client(store):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=store.uri, registry_uri=store.uri)


def _key_pair(folder: Path, name: str) -> tuple[Path, Path]:
    """A signing key and its public half, as a machine's owner hands it to a teammate ($KILN_TRUSTED_KEYS)."""
    private = folder / f"{name}.pem"
    public = folder / f"{name}.pub"
    public.write_text(signing.public_pem(signing.new_key(private).public_key()))
    return private, public


def _plant(client, experiment_id: str, key: str, folder: Path, stage: str, role: str) -> str:
    """What a teammate with write access can do: a FINISHED run tagged as the one that computed `key`,
    holding `folder` as its stage files. Newer than the honest run, so it is the one found."""
    run = client.create_run(experiment_id, tags={"kiln.stage_key": key, "kiln.stage": stage, "kiln.role": role,
                                                 "kiln.reused": "false"}).info.run_id
    client.log_artifacts(run, str(folder), "stage")
    client.set_terminated(run, "FINISHED")
    return run


def _computing_runs(client, experiment_id: str, key: str) -> list[str]:
    return [r.info.run_id for r in client.search_runs(
        [experiment_id], f"tags.`kiln.stage_key` = '{key}' and tags.`kiln.reused` = 'false'")]


def test_a_forged_result_on_the_tracking_server_is_computed_again_and_never_spreads(tmp_path, tiny_model_dir,
                                                                                      store, monkeypatch):
    """The issue's first reproduction: the benchmark's stage/result.json on the tracking server edited to
    1000x the candidate's speed, planted as a newer run with the stage's key (here also sealed again with
    the attacker's own key, the most a forger can do), was reused by a machine with an empty cache and
    passed; every reuse uploaded it again, and other recipes passed from the copies."""
    env = {**store.env, "MLFLOW_TRACKING_URI": store.uri}
    recipe = _speed_recipe(tmp_path / "r.yaml", tiny_model_dir, tracking={"experiment": "forged-server"})
    a_key, a_public = _key_pair(tmp_path, "a")
    (tmp_path / "a").mkdir()
    a = kiln("run", str(recipe), cwd=tmp_path / "a", env={**env, "KILN_CACHE": str(fresh_cache(tmp_path / "cache-a")),
                                                          signing.SIGNING_KEY_ENV: str(a_key)})
    assert a.returncode in (1, 3), a.stdout[-3000:] + a.stderr[-3000:]
    client = _client(store)
    exp = client.get_experiment_by_name("forged-server").experiment_id
    honest = _stages(_newest_run(tmp_path / "a"))["benchmark-pair"]
    folder = Path(client.download_artifacts(honest["mlflow_run"], "stage", str(tmp_path / "mallory")))
    inputs = json.loads((folder / "manifest.json").read_text())["inputs"]
    _forge_speed(folder)
    monkeypatch.setenv(signing.SIGNING_KEY_ENV, str(_key_pair(tmp_path, "mallory")[0]))
    seal(folder, "benchmark", honest["key"], inputs)
    monkeypatch.delenv(signing.SIGNING_KEY_ENV)
    forged = _plant(client, exp, honest["key"], folder, "benchmark", "pair")

    # Machine B: an empty cache; it trusts machine A's key (a teammate's), not the forger's.
    (tmp_path / "b").mkdir()
    b = kiln("run", str(recipe), cwd=tmp_path / "b", env={
        **env, "KILN_CACHE": str(fresh_cache(tmp_path / "cache-b")),
        signing.TRUSTED_KEYS_ENV: str(a_public)})
    said = " ".join(b.stdout.split())
    assert b.returncode in (1, 3), said[-3000:] + b.stderr[-3000:]
    assert f"the copy on the tracking server (run {forged}): signed by" in said, said[:4000]
    assert "which this machine does not trust" in said and "computing it here ▶ benchmark[pair]" in said
    run_b = _newest_run(tmp_path / "b")
    stages_b = _stages(run_b)
    assert not stages_b["benchmark-pair"]["reused"] and _ratio(run_b) < 50
    # What machine A computed and sealed is reused from the server; what was reused is uploaded nowhere.
    assert stages_b["quality-candidate"]["reused"]
    assert stages_b["quality-candidate"]["computed_by"] == _stages(_newest_run(tmp_path / "a"))["quality-candidate"]["mlflow_run"]
    for name, record in stages_b.items():
        if record["reused"]:
            assert client.list_artifacts(record["mlflow_run"]) == [], name
            assert client.get_run(record["mlflow_run"]).data.tags["kiln.reused_from"] == record["computed_by"]
            if name.startswith("quality"):  # a portable stage: the one copy on the server is A's
                assert _computing_runs(client, exp, record["key"]) == [record["computed_by"]], name
    for mv in client.search_model_versions("name = 'forged'"):
        assert "challenger" not in mv.aliases and "champion" not in mv.aliases


def test_a_result_edited_on_the_tracking_server_is_refused_and_an_honest_copy_reused_once(tmp_path, store):
    """The same through the stage mechanism alone, with the forgery left unsigned: the planted copy's
    result.json no longer matches its seal. An honest copy is reused, and reusing it uploads nothing, so
    however many machines reuse it, its key is held by one run."""
    from kiln.pipeline.tracking.runs import Tracker

    tracker = Tracker(store.uri, "forged-stage")
    console, calls = Console(record=True, width=200), []
    machine_a = replace_tracker(_ctx(tmp_path / "a", console), tracker)
    computed = run_stage(machine_a, "quality", "candidate", {"x": 1}, _quality(calls))
    for machine in ("b", "c"):  # empty caches, the same server
        reused = run_stage(replace_tracker(_ctx(tmp_path / machine, console), tracker), "quality", "candidate",
                           {"x": 1}, _quality(calls))
        assert reused.reused and len(calls) == 1 and tracker.client.list_artifacts(reused.mlflow_run) == []
    assert _computing_runs(tracker.client, tracker.experiment_id, computed.key) == [computed.mlflow_run]
    folder = Path(tracker.client.download_artifacts(computed.mlflow_run, "stage", str(tmp_path / "mallory")))
    (folder / "result.json").write_text(json.dumps({"metrics": {"perplexity": 1.0}, "samples": {
        "file": "samples.jsonl", "columns": ["nll"]}}))
    forged = _plant(tracker.client, tracker.experiment_id, computed.key, folder, "quality", "candidate")
    again = run_stage(replace_tracker(_ctx(tmp_path / "d", console), tracker), "quality", "candidate", {"x": 1},
                      _quality(calls))
    assert not again.reused and len(calls) == 2 and again.result["metrics"]["perplexity"] == 7.4
    said = _said(console)
    assert f"the copy on the tracking server (run {forged}): result.json has changed since the stage sealed it" in said


def replace_tracker(ctx: RunContext, tracker) -> RunContext:
    from dataclasses import replace

    parent = tracker.start("parent", {})
    return replace(ctx, tracker=tracker, parent_run=parent)


def test_the_ray_driver_takes_a_nodes_stage_only_under_a_key_it_or_the_node_trusts(tmp_path, monkeypatch):
    """A node signs with its own key; the driver reads its stages back through the tracking server and
    checks them under its own trusted keys and those the node reported over Ray, then seals the copy
    itself, so the gate checks it as it checks its own. A copy edited on the server is refused (exit 5)."""
    from kiln.pipeline.search.ray_executor import fetch_stage, node_keys
    from kiln.pipeline.tracking.runs import Tracker

    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "ray-fetch")
    node_key, node_public = _key_pair(tmp_path, "node")
    monkeypatch.setenv(signing.SIGNING_KEY_ENV, str(node_key))  # the node computes and seals
    node = replace_tracker(_ctx(tmp_path / "node", Console(quiet=True)), tracker)
    computed = run_stage(node, "quality", "candidate", {"x": 1}, _quality([]))
    record = json.loads((node.run_dir / "stages" / "quality-candidate.json").read_text())
    monkeypatch.delenv(signing.SIGNING_KEY_ENV)  # the driver: this machine's own key
    driver = replace_tracker(_ctx(tmp_path / "driver", Console(quiet=True)), tracker)
    with pytest.raises(NotVerified, match="which this machine does not trust"):
        fetch_stage(driver, record, node_keys({}))
    fetch_stage(driver, record, node_keys({"node": node_public.read_text()}))
    fetched = json.loads((driver.run_dir / "stages" / "quality-candidate.json").read_text())
    assert Path(fetched["path"]).parent.parent.name == "from-nodes"
    verified = check(Path(fetched["path"]), "quality", computed.key)  # the driver's own seal now
    assert verified.predicate["origin"]["mlflow_run"] == computed.mlflow_run
    assert evidence_from_run(driver.run_dir)["candidate"].samples["nll"]["0"] == 2.0
    # A build comes back without its model (it stays on the node): the records that came back still check.
    monkeypatch.setenv(signing.SIGNING_KEY_ENV, str(node_key))
    build = run_stage(node, "optimize", "candidate", {"x": 1}, _build, artifacts=("model/kiln-artifact.json",),
                      portable=False)
    monkeypatch.delenv(signing.SIGNING_KEY_ENV)
    fetch_stage(driver, json.loads((node.run_dir / "stages" / "optimize-candidate.json").read_text()),
                node_keys({"node": node_public.read_text()}))
    brought = Path(json.loads((driver.run_dir / "stages" / "optimize-candidate.json").read_text())["path"])
    assert set(check(brought, "optimize", build.key).subjects()) == {"result.json", "manifest.json",
                                                                      "model/kiln-artifact.json"}
    # The same stage, edited on the server (the node's run's files replaced), is refused by the driver.
    folder = Path(tracker.client.download_artifacts(computed.mlflow_run, "stage", str(tmp_path / "mallory")))
    (folder / "samples.jsonl").write_text((folder / "samples.jsonl").read_text().replace('"nll": 2.0', '"nll": 0.1'))
    record = {**record, "computed_by": _plant(tracker.client, tracker.experiment_id, computed.key, folder, "quality",
                                              "candidate")}
    other = replace_tracker(_ctx(tmp_path / "driver2", Console(quiet=True)), tracker)
    with pytest.raises(NotVerified, match="samples.jsonl has changed since the stage sealed it"):
        fetch_stage(other, record, node_keys({"node": node_public.read_text()}))
