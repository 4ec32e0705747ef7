"""`kiln run` against real tracking setups: sqlite, `mlflow server` over HTTP, and `mlflow server`
on PostgreSQL with S3 artifacts (SeaweedFS). On each: a full run finishes with its verdict; the
registered version's artifacts live in the server's artifact store and download from another
folder; a second machine (another folder, an empty cache, the team's signing key) reuses the
baseline's stages, whose seals it trusts, and the registered version; promote and rollback move the aliases. The HTTP and S3 runs also carry
planted credentials that must appear nowhere."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from kiln.core.files import sha256_tree
from kiln.core.signing import new_key
from tests.pipeline.conftest import fresh_cache, kiln, write_recipe
from tests.tracking_servers import S3_SECRET, tracking_setup

PORTABLE = {"quality-baseline", "quality-candidate", "agreement-candidate", "lmeval-baseline", "lmeval-candidate",
            "benchmark-pair"}
URI_SECRET, PASSWORD_SECRET, TOKEN_SECRET = "UriPw7f3c9a1", "EnvPw0b8e4d2", "Tok5a6c7e8f9"


def _client(uri: str) -> MlflowClient:
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def _run(recipe: Path, work: Path, cache: Path, uri: str, env: dict[str, str], *args: str):
    work.mkdir(parents=True, exist_ok=True)
    proc = kiln("run", str(recipe), *args, cwd=work, env={**env, "KILN_CACHE": str(cache), "MLFLOW_TRACKING_URI": uri})
    assert proc.returncode in (0, 1, 3), proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = max((work / "runs").iterdir(), key=lambda p: p.stat().st_mtime)
    stages = {p.stem: json.loads(p.read_text()) for p in (run_dir / "stages").glob("*.json")}
    return proc, run_dir, stages


def _version(client: MlflowClient, run_dir: Path):
    """The registered version a run recorded (challenger only if it passed, so not looked up by alias)."""
    registered = json.loads((run_dir / "registry.json").read_text())
    return client.get_model_version(registered["name"], str(registered["version"]))


def _with_credentials(uri: str) -> str:
    return uri.replace("http://", f"http://alice:{URI_SECRET}@", 1)


def _download_tree_hash(client: MlflowClient, uri: str, name: str, version: str, dest: Path) -> str:
    """The version's artifact fetched through the store (as another machine would), hashed as kiln hashes
    an artifact: every file but the manifest kiln writes beside the weights."""
    import mlflow.artifacts

    source = client.get_model_version_download_uri(name, version)
    local = Path(mlflow.artifacts.download_artifacts(artifact_uri=source, dst_path=str(dest), tracking_uri=uri))
    (local / "kiln-artifact.json").unlink()
    return sha256_tree(local)


def _everything_in_mlflow(client: MlflowClient, experiment: str, model: str, dest: Path) -> str:
    """Every param, tag and artifact of the experiment's runs and every version's tags, as one text."""
    exp = client.get_experiment_by_name(experiment)
    parts = []
    for r in client.search_runs([exp.experiment_id], max_results=1000):
        parts.append(json.dumps({"params": r.data.params, "tags": r.data.tags, "name": r.info.run_name}))
        folder = dest / r.info.run_id
        folder.mkdir(parents=True)
        if client.list_artifacts(r.info.run_id):
            client.download_artifacts(r.info.run_id, "", str(folder))
    for mv in client.search_model_versions(f"name = '{model}'"):
        parts.append(json.dumps({"tags": mv.tags, "source": mv.source}))
    for f in dest.rglob("*"):
        if f.is_file():
            parts.append(f.read_bytes().decode("latin-1"))
    return "\n".join(parts)


def _grep(root: Path, secrets: list[str]) -> list[str]:
    hits = []
    for f in root.rglob("*"):
        if f.is_file() and not f.is_symlink():
            data = f.read_bytes()
            hits += [f"{f}: {s}" for s in secrets if s.encode() in data]
    return hits


@pytest.mark.parametrize("kind", ["sqlite", "http", "postgres-s3"])
def test_tracking_setup_end_to_end(kind, tmp_path, tiny_model_dir):
    recipe = write_recipe(tmp_path / "tiny.yaml", tiny_model_dir, tracking={"experiment": f"kiln-{kind}"})
    with tracking_setup(kind, tmp_path / "server") as setup:
        planted = {} if kind == "sqlite" else {
            "MLFLOW_TRACKING_USERNAME": "bob", "MLFLOW_TRACKING_PASSWORD": PASSWORD_SECRET,
            "MLFLOW_TRACKING_TOKEN": TOKEN_SECRET}
        uri = setup.uri if kind == "sqlite" else _with_credentials(setup.uri)
        secrets = [URI_SECRET, PASSWORD_SECRET, TOKEN_SECRET] + ([S3_SECRET] if setup.env else [])

        # Machine A: an empty cache, so it computes every stage and the server holds each once (a stage
        # reused from a cache is never uploaded again). Both machines sign with the team's key.
        team = {"KILN_SIGNING_KEY": str(tmp_path / "team.pem")}
        new_key(tmp_path / "team.pem")
        cache_a = fresh_cache(tmp_path / "cache-a")
        proc_a, run_a, _ = _run(recipe, tmp_path / "a", cache_a, uri, {**setup.env, **planted, **team})
        verdict_a = json.loads((run_a / "verdict.json").read_text())
        client = _client(setup.uri)
        mv = _version(client, run_a)
        assert mv.tags["kiln.verdict"] == verdict_a["verdict"] and mv.tags["kiln.registration"] == "complete"
        assert ("challenger" in mv.aliases) is (proc_a.returncode == 0)  # only a version whose run passed
        assert str(cache_a) not in mv.source, mv.source  # the store's copy, not the runner's cache
        if kind == "sqlite":  # beside the store's .db file, not in ./mlruns of the folder machine A ran in
            assert mv.source.startswith(str(tmp_path / "server" / "mlruns")), mv.source
            assert not (tmp_path / "a" / "mlruns").exists()
        if kind == "http":
            assert mv.source.startswith("mlflow-artifacts:"), mv.source
        if kind == "postgres-s3":
            assert mv.source.startswith("s3://mlflow/"), mv.source
        os.environ.update(setup.env)  # this test process downloads through the same S3 store
        try:
            assert _download_tree_hash(client, setup.uri, "tiny", mv.version, tmp_path / "download") == mv.tags["kiln.artifact_sha256"]

            # Machine B: another folder, an empty cache, the same server.
            proc_b, run_b, stages_b = _run(recipe, tmp_path / "b", fresh_cache(tmp_path / "cache-b"), uri,
                                           {**setup.env, **team})
            assert proc_b.returncode == proc_a.returncode
            assert json.loads((run_b / "verdict.json").read_text())["verdict"] == verdict_a["verdict"]
            assert PORTABLE <= set(stages_b)
            assert all(stages_b[s]["reused"] for s in PORTABLE), {s: stages_b[s]["reused"] for s in PORTABLE}
            assert not stages_b["optimize-candidate"]["reused"]  # quantized again, to the same bytes
            versions = client.search_model_versions("name = 'tiny'")
            assert [v.version for v in versions] == [mv.version], "an unchanged recipe registered a second version"
            assert json.loads((run_b / "registry.json").read_text())["reused"] is True

            # A changed policy is a new claim on the same artifact: set on the model on purpose (issue 52: the
            # model owns its policy), then a new version; then the aliases move.
            stricter = ["--set", "gate.checks.2.max_ratio=0.99"]
            pinned = kiln("policy", "set", "tiny", str(recipe), *stricter, "--reason", "tracking-setup test: a new bound",
                          "--tracking-uri", setup.uri, cwd=tmp_path, env={**setup.env, **team})
            assert pinned.returncode == 0, pinned.stderr[-2000:]
            proc_c, run_c, _ = _run(recipe, tmp_path / "b", tmp_path / "cache-b", setup.uri, {**setup.env, **team},
                                    "--set", "gate.checks.2.max_ratio=0.99")
            v2 = str(_version(client, run_c).version)
            assert v2 != str(mv.version)
            if kind != "sqlite":
                hits = [hit for root in (tmp_path / "a", tmp_path / "b", tmp_path / "cache-b", cache_a / "stages")
                        for hit in _grep(root, secrets)]
                assert not hits, hits
                printed = proc_a.stdout + proc_a.stderr
                assert not [s for s in secrets if s in printed], printed[-2000:]
                assert "View run" not in printed  # MLflow's per-run URL lines (with the URI) are off
                stored = _everything_in_mlflow(client, f"kiln-{kind}", "tiny", tmp_path / "mlflow-dump")
                assert not [s for s in secrets if s in stored]
        finally:
            for k in setup.env:
                os.environ.pop(k, None)
        v1 = str(mv.version)
        # The tiny recipe may end Inconclusive on a busy machine: a version whose run did not pass goes
        # in only with a reason (test_aliases_follow_verdicts.py holds the refusal itself); v1 was judged
        # under the policy tiny no longer holds, so it goes back in only with one too.
        forced = {v1: True, v2: proc_c.returncode != 0}
        for args, champion in ((["promote", "tiny", v1], v1), (["promote", "tiny", v2], v2), (["rollback", "tiny"], v1)):
            if forced[args[2] if args[0] == "promote" else v1]:
                args = [*args, "--force", "--reason", "tracking-setup test: not passed here, or judged under the old policy"]
            proc = kiln(*args, "--tracking-uri", uri, cwd=tmp_path, env={**planted, **team})
            assert proc.returncode == 0, proc.stderr[-2000:]
            assert str(client.get_model_version_by_alias("tiny", "champion").version) == champion
            assert not [s for s in secrets if s in proc.stdout + proc.stderr]


def _silent_listener() -> tuple[socket.socket, int]:
    """A port whose kernel completes TCP handshakes (up to the backlog) while nothing ever reads or
    answers: a hung server."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    return sock, sock.getsockname()[1]


def test_unreachable_tracking_server_fails_fast_with_exit_2(tmp_path, tiny_model_dir):
    recipe = write_recipe(tmp_path / "tiny.yaml", tiny_model_dir)
    refused = socket.socket()
    refused.bind(("127.0.0.1", 0))
    closed_port = refused.getsockname()[1]
    refused.close()
    silent, silent_port = _silent_listener()
    try:
        for uri, why in ((f"http://u:{URI_SECRET}@127.0.0.1:{closed_port}", "connection refused"),
                         (f"http://u:{URI_SECRET}@127.0.0.1:{silent_port}", "timed out"),
                         (f"postgresql://u:{URI_SECRET}@127.0.0.1:{closed_port}/mlflow", "connection refused")):
            # MLflow's own client retries for minutes (over four for HTTP, about two for a database):
            # kiln's probe answers within its 5 s timeout plus start-up, far inside this bound.
            proc = kiln("run", str(recipe), cwd=tmp_path, env={"MLFLOW_TRACKING_URI": uri}, timeout=90)
            assert proc.returncode == 2, proc.stderr[-2000:]
            assert "tracking.uri" in proc.stderr and why in proc.stderr and "Traceback" not in proc.stderr
            assert URI_SECRET not in proc.stdout + proc.stderr
            assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())
    finally:
        silent.close()


def test_promote_and_rollback_name_what_is_wrong(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = _client(uri)
    client.create_registered_model("m")
    for args, needle in ((["promote", "m", "7"], "no version 7"), (["rollback", "m"], "no champion"),
                         (["promote", "nope", "1"], "'nope'")):
        proc = kiln(*args, "--tracking-uri", uri, cwd=tmp_path)
        assert proc.returncode == 2 and needle in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
