"""A real run's signed verdict (kiln.pipeline.provenance.attestation) on the tiny model: `kiln verify` holds it to the
bytes on disk, and `kiln serve RUN` refuses a candidate whose bytes or evidence changed after the verdict.
Each change is made as a user or a script would (in place, mtime restored) and undone afterwards."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
from pathlib import Path

import pytest

from kiln.core.files import read_json
from tests.pipeline.conftest import fresh_cache, kiln, quick_recipe


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_model_dir):
    work = tmp_path_factory.mktemp("attested")
    cache = fresh_cache(work / "cache")
    recipe = quick_recipe(work / "tiny.yaml", tiny_model_dir, name="attested")
    env = {"KILN_CACHE": str(cache)}
    proc = kiln("run", str(recipe), cwd=work, env=env)
    assert proc.returncode in (0, 1, 3), proc.stdout[-3000:] + proc.stderr[-3000:]
    return {"work": work, "env": env, "code": proc.returncode, "dir": next((work / "runs").iterdir())}


def _kiln(run, *args):
    return kiln(*args, cwd=run["work"], env=run["env"])


@contextlib.contextmanager
def rewritten(path: Path, change):
    """`path` rewritten in place (same inode) with its mtime restored, as `cp -p` or rsync -a leave it; put back after."""
    before, stat = path.read_bytes(), path.stat()
    try:
        with open(path, "r+b") as f:
            f.write(change(before))
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        yield
    finally:
        with open(path, "r+b") as f:
            f.write(before)
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def _candidate_weights(run) -> Path:
    stage = Path(read_json(run["dir"] / "stages" / "optimize-candidate.json")["path"])
    return max((stage / "model").glob("*.safetensors"), key=lambda p: p.stat().st_size)


def test_the_run_verifies_with_its_verdicts_exit_code(run):
    envelope = read_json(run["dir"] / "attestation.dsse.json")
    stmt = json.loads(base64.b64decode(envelope["payload"]))
    assert stmt["_type"] == "https://in-toto.io/Statement/v1"
    assert any(s["name"].endswith(".safetensors") for s in stmt["subject"])
    p = stmt["predicate"]
    assert p["exit_code"] == run["code"] and p["policy_sha256"] == read_json(run["dir"] / "policy.json")["sha256"]
    assert {e["stage"] for e in p["evidence"]} >= {"optimize", "engine", "quality", "benchmark"}
    proc = _kiln(run, "verify", str(run["dir"]))
    assert proc.returncode == run["code"], proc.stdout + proc.stderr
    assert "✓" in proc.stdout and "verify" in proc.stdout
    registry = read_json(run["dir"] / "registry.json")
    proc = _kiln(run, "verify", registry["name"], str(registry["version"]))
    assert proc.returncode == run["code"], proc.stdout + proc.stderr


def test_weights_rewritten_in_place_do_not_verify_and_are_not_served(run):
    weights = _candidate_weights(run)
    with rewritten(weights, lambda b: b[:-8] + bytes(8 * [0x7F])):
        proc = _kiln(run, "verify", str(run["dir"]))
        assert proc.returncode == 5 and f"{weights.name} has changed since it was judged" in proc.stderr, proc.stderr
        served = _kiln(run, "serve", str(run["dir"]), "--port", "0")
        assert served.returncode == 5 and "will not serve" in served.stderr, served.stdout + served.stderr
    assert _kiln(run, "verify", str(run["dir"])).returncode == run["code"]


def test_a_result_edited_after_the_verdict_does_not_verify(run):
    bench = Path(read_json(run["dir"] / "stages" / "benchmark-pair.json")["path"]) / "result.json"
    with rewritten(bench, lambda b: b.replace(b'"', b"'", 1)):
        proc = _kiln(run, "verify", str(run["dir"]))
        assert proc.returncode == 5 and "benchmark" in proc.stderr, proc.stdout + proc.stderr


def test_a_verdict_edited_after_signing_does_not_verify(run, tmp_path):
    path = run["dir"] / "attestation.dsse.json"
    saved = tmp_path / "saved.json"
    shutil.copyfile(path, saved)
    envelope = read_json(path)
    stmt = json.loads(base64.b64decode(envelope["payload"]))
    stmt["predicate"].update(verdict="Successful", exit_code=0, passed=True)
    envelope["payload"] = base64.b64encode(json.dumps(stmt).encode()).decode()
    try:
        path.write_text(json.dumps(envelope))
        proc = _kiln(run, "verify", str(run["dir"]))
        assert proc.returncode == 5 and "does not match its content" in proc.stderr, proc.stdout + proc.stderr
    finally:
        shutil.copyfile(saved, path)


def test_the_pods_check_verifies_the_engine_folder_it_is_given(run, tmp_path):
    """What the rendered Rollout's init container runs: `kiln verify NAME VERSION --engine DIR`."""
    registry = read_json(run["dir"] / "registry.json")
    engine = Path(read_json(Path(read_json(run["dir"] / "stages" / "engine-candidate.json")["path"]) / "result.json")
                  ["engine_dir"])
    args = ("verify", registry["name"], str(registry["version"]), "--engine")
    proc = _kiln(run, *args, str(engine))
    assert proc.returncode == run["code"], proc.stdout + proc.stderr
    with rewritten(_candidate_weights(run), lambda b: b[:-4] + b"\x00\x01\x02\x03"):  # the checkpoint it loads
        assert _kiln(run, *args, str(engine)).returncode == 5
    image = tmp_path / "image-engine"
    shutil.copytree(engine, image)
    (image / "extra.bin").write_bytes(b"not judged")
    proc = _kiln(run, *args, str(image))
    assert proc.returncode == 5 and "extra.bin" in proc.stderr, proc.stdout + proc.stderr


def _served_name(run, *args: str) -> tuple[str, str]:
    """`kiln serve RUN *args` started until ready: the id in /v1/models and a completion's `model`; stopped after."""
    import signal
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in {**os.environ, **run["env"]}.items() if k != "KILN_API_KEY"}
    proc = subprocess.Popen([sys.executable, "-m", "kiln.pipeline", "serve", str(run["dir"]), "--port", str(port), *args],
                            cwd=run["work"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                with urllib.request.urlopen(url + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "kiln serve was not ready in 120 s"
            time.sleep(0.5)
        with urllib.request.urlopen(url + "/v1/models", timeout=30) as r:
            listed = json.loads(r.read())["data"][0]["id"]
        req = urllib.request.Request(url + "/v1/completions", data=json.dumps({"prompt": "Hi", "max_tokens": 1}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            answered = json.loads(r.read())["model"]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    return listed, answered


def test_serve_refuses_a_run_that_did_not_pass_and_serves_it_under_the_recipes_name_when_forced(run):
    """`kiln serve RUN` served a run that did not pass, without a word, as `model` (issue 54, point 7)."""
    from kiln.core import signing

    path = run["dir"] / "attestation.dsse.json"
    before = path.read_bytes()
    stmt = json.loads(base64.b64decode(read_json(path)["payload"]))
    stmt["predicate"].update(verdict="Failed", exit_code=1, passed=False)
    key = signing._load_private(Path(run["env"]["KILN_CACHE"]) / "keys" / "kiln-signing.pem")  # the run's own key
    try:
        path.write_text(json.dumps(signing.sign(stmt, key)))
        refused = _kiln(run, "serve", str(run["dir"]), "--port", "0")
        assert refused.returncode == 2, refused.stdout + refused.stderr
        assert "ended Failed" in refused.stderr and "only a run that passed" in refused.stderr
        assert "--force --reason" in " ".join(refused.stderr.split())
        assert _served_name(run, "--force", "--reason", "a name check") == ("attested", "attested")
    finally:
        path.write_bytes(before)
    assert _served_name(run, "--force", "--reason", "a name check", "--served-model-name", "my-fine-tune") == \
        ("my-fine-tune", "my-fine-tune")
