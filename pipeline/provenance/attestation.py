"""The verdict as an attestation: a signed statement binding what the gate decided to the bytes it judged.

Every judged run writes `attestation.dsse.json` into its run folder and onto its MLflow parent run: an
in-toto Statement (v1) in a DSSE envelope, signed with kiln's key (kiln.core.signing). Its subjects are
the candidate's files, each with its sha256 — the artifact as registered (`model/…`) and the engine it
was served from (`engine/…`). Its predicate holds the verdict and each check's, the digest of the policy
it was judged under (kiln.pipeline.recipe.policy), every piece of evidence (each stage's key and the digests of
its result and its sealed evidence), the registered version, kiln's version and the machine.

Nothing that moves or serves a version trusts a tag, a cache entry or a run folder for any of this:
`verify_version` and `verify_run` check the signature against the trusted keys, the subjects against the
bytes as they are now, the evidence against the stage folders, and the policy against the one the
registered model pins. `kiln verify` exits with the attested verdict's code (0 passed, 1 failed,
3 inconclusive) once all of that holds, and 5 (NotVerified) naming the first thing that does not.
"""

from __future__ import annotations

import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.core import signing
from kiln.core.errors import NotVerified
from kiln.core.files import atomic_write_json, read_json, sha256_file
from kiln.core.versions import environment, library_versions

VERDICT_TYPE = "https://kiln.dev/verdict/v1"
ENVELOPE = "attestation.dsse.json"
ATTESTATION_RUN = "kiln.attestation_run"  # on a version: the MLflow run whose artifacts hold its latest envelope
ATTESTATION_SHA = "kiln.attestation_sha256"  # on a version: that envelope's sha256 (shown; verification rehashes)
MODEL, ENGINE = "model", "engine"  # subject name prefixes: the registered artifact, the engine it was served from


def file_subjects(root: Path, prefix: str) -> list[signing.Subject]:
    """Every file under `root` (symlinks followed, as a loader reads them), named `prefix/relative/path`."""
    root = Path(root)
    files = sorted(p for p in root.rglob("*") if p.is_file())
    return [signing.Subject(f"{prefix}/{p.relative_to(root).as_posix()}", sha256_file(p)) for p in files]


def check_files(verified: signing.Verified, root: Path, prefix: str, what: str) -> int:
    """The files under `root` are exactly the statement's `prefix/…` subjects, byte for byte; else
    NotVerified naming the first that differs. Returns how many were checked."""
    want = {n: d for n, d in verified.subjects().items() if n.startswith(prefix + "/")}
    if not want:
        raise NotVerified(f"{what}: the attestation names no {prefix} files")
    have = {s.name: s.sha256 for s in file_subjects(root, prefix)} if Path(root).is_dir() else {}
    for name in sorted(want.keys() | have.keys()):
        if name not in have:
            raise NotVerified(f"{what}: {name} is missing from {root} (it was judged, and is gone)")
        if name not in want:
            raise NotVerified(f"{what}: {name} in {root} was not judged (a file added since the verdict)")
        if have[name] != want[name]:
            raise NotVerified(f"{what}: {name} has changed since it was judged (sha256 {have[name][:12]}, "
                              f"judged {want[name][:12]}); nothing serves bytes nobody judged")
    return len(want)


def check_local(verified: signing.Verified, folder: Path, what: str) -> None:
    """`folder` is what the verdict judged: the engine it names (and, when that engine's manifest loads a
    checkpoint from a folder, that folder as the artifact), or the artifact when it names no engine."""
    if not any(n.startswith(ENGINE + "/") for n in verified.subjects()):
        check_files(verified, folder, MODEL, what)
        return
    check_files(verified, folder, ENGINE, what)
    manifest = folder / "kiln-engine.json"
    checkpoint = (read_json(manifest).get("build") or {}).get("checkpoint") if manifest.is_file() else None
    if checkpoint and Path(checkpoint).is_dir():
        check_files(verified, Path(checkpoint), MODEL, what)


def evidence_records(run_dir: Path) -> list[dict[str, Any]]:
    """What the verdict rests on: each stage the run read, with the digests of its result and of its
    sealed evidence (kiln.pipeline.provenance.stage_evidence) when the stage has one."""
    out = []
    for f in sorted((Path(run_dir) / "stages").glob("*.json")):
        record = read_json(f)
        path = Path(record["path"])
        sealed = path / "evidence.dsse.json"
        out.append({"stage": record["stage"], "role": record["role"], "key": record["key"],
                    "result_sha256": sha256_file(path / "result.json"),
                    "evidence_sha256": sha256_file(sealed) if sealed.is_file() else None,
                    "mlflow_run": record.get("mlflow_run")})
    return out


@dataclass(frozen=True)
class Judged:
    """What `attest` needs beyond the run folder: the outcome and where the candidate's bytes are."""

    outcome: Any  # GateOutcome
    artifact: Path  # the candidate's artifact folder (registered as the version's `model/`)
    engine: Path | None  # the folder the candidate's engine was served from
    registered: dict[str, str]  # {"name", "version"}
    policy_sha256: str
    policy: dict[str, Any]
    recipe: dict[str, str]  # {"name", "sha256"}
    mlflow_run: str


def statement(run_dir: Path, judged: Judged) -> dict[str, Any]:
    o = judged.outcome
    subjects = file_subjects(judged.artifact, MODEL)
    if judged.engine is not None and Path(judged.engine).resolve() != Path(judged.artifact).resolve():
        subjects += file_subjects(judged.engine, ENGINE)
    predicate = {
        "verdict": o.verdict.value, "exit_code": int(o.exit_code), "passed": int(o.exit_code) == 0,
        "summary": o.summary, "rule": o.rule,
        "checks": [{"name": r.name, "verdict": r.verdict.value, "observed": r.observed, "threshold": r.threshold}
                   for r in o.results],
        "policy_sha256": judged.policy_sha256, "policy": judged.policy, "recipe": judged.recipe,
        "registered_model": judged.registered, "run": {"name": Path(run_dir).name, "mlflow_run": judged.mlflow_run},
        "evidence": evidence_records(run_dir),
        "kiln_version": library_versions(("kiln",)).get("kiln"),
        "machine": {"host": socket.gethostname(), **environment()},
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    return signing.statement(subjects, VERDICT_TYPE, predicate)


def attest(run_dir: Path, judged: Judged) -> Path:
    """Sign the run's verdict and write it to the run folder; returns the envelope's path."""
    path = Path(run_dir) / ENVELOPE
    atomic_write_json(path, signing.sign(statement(run_dir, judged)))
    return path


def read_envelope(path: Path, what: str) -> signing.Verified:
    if not Path(path).is_file():
        raise NotVerified(f"{what}: no attestation ({Path(path).name}); only a run kiln judged and signed can be "
                          "verified (run the recipe again)")
    try:
        envelope = read_json(path)
    except ValueError as e:
        raise NotVerified(f"{what}: {path} is not JSON ({e})") from None
    return signing.verify(envelope, VERDICT_TYPE, what)


def stage_folder(run_dir: Path, stage: str, role: str) -> Path | None:
    record = Path(run_dir) / "stages" / f"{stage}-{role}.json"
    return Path(read_json(record)["path"]) if record.is_file() else None


def verify_run(run_dir: Path) -> signing.Verified:
    """The run's attestation, once its signature, the candidate's bytes (artifact and engine) and every
    piece of evidence it names match what is on disk now; else NotVerified naming what does not."""
    run_dir = Path(run_dir)
    what = f"run {run_dir.name}"
    verified = read_envelope(run_dir / ENVELOPE, what)
    optimize = stage_folder(run_dir, "optimize", "candidate")
    if optimize is None:
        raise NotVerified(f"{what}: the run records no candidate artifact (stages/optimize-candidate.json)")
    check_files(verified, optimize / "model", MODEL, what)
    if any(n.startswith(ENGINE + "/") for n in verified.subjects()):
        engine = stage_folder(run_dir, "engine", "candidate")
        engine_dir = Path(read_json(engine / "result.json")["engine_dir"]) if engine else Path("/nonexistent")
        check_files(verified, engine_dir, ENGINE, what)
    _check_evidence(verified, run_dir, what)
    return verified


def _check_evidence(verified: signing.Verified, run_dir: Path, what: str) -> None:
    """Each stage the verdict rests on is still there with the result that was judged, and its sealed
    evidence still checks."""
    for e in verified.predicate.get("evidence", []):
        path = stage_folder(run_dir, e["stage"], e["role"])
        label = f"{what}: the {e['stage']}[{e['role']}] stage"
        if path is None or not (path / "result.json").is_file():
            raise NotVerified(f"{label} is gone (cache pruned?); its evidence cannot be checked")
        if sha256_file(path / "result.json") != e["result_sha256"]:
            raise NotVerified(f"{label}: result.json has changed since the verdict")
        if e.get("evidence_sha256"):
            _check_sealed(path, e, label)


def _check_sealed(path: Path, entry: dict[str, Any], label: str) -> None:
    sealed = path / "evidence.dsse.json"
    if not sealed.is_file() or sha256_file(sealed) != entry["evidence_sha256"]:
        raise NotVerified(f"{label}: its sealed evidence is not the one the verdict rests on")
    try:
        from kiln.pipeline.provenance import stage_evidence
    except ImportError:  # sealing not in this kiln: the result digest above is the check
        return
    try:
        stage_evidence.check(path, entry["stage"], entry["key"])
    except NotVerified as e:
        raise NotVerified(f"{label}: {e}") from None


def download_attestation(client: Any, name: str, version: str, mv: Any) -> signing.Verified:
    """The version's latest attestation, fetched from the run its tag names and verified (signature and
    type). The tag only says where to look: the statement must itself name this version."""
    what = f"{name} v{version}"
    run_id = mv.tags.get(ATTESTATION_RUN)
    if not run_id:
        raise NotVerified(f"{what}: no attestation recorded (a version registered by an older kiln, or by hand); "
                          "run its recipe again so kiln judges and signs it")
    with tempfile.TemporaryDirectory() as tmp:
        try:
            local = client.download_artifacts(run_id, ENVELOPE, tmp)
        except Exception as e:  # noqa: BLE001 - any store failure: the attestation cannot be read
            raise NotVerified(f"{what}: cannot fetch its attestation from run {run_id} ({type(e).__name__})") from None
        verified = read_envelope(Path(local), what)
    named = verified.predicate.get("registered_model", {})
    if (named.get("name"), str(named.get("version"))) != (name, str(version)):
        raise NotVerified(f"{what}: the attestation found is for {named.get('name')} v{named.get('version')}, "
                          "not this version")
    return verified


def download_version(client: Any, mv: Any, dest: Path) -> Path:
    """The version's registered artifact (its `model/` folder) downloaded into `dest`."""
    import mlflow.artifacts

    try:
        return Path(mlflow.artifacts.download_artifacts(artifact_uri=mv.source, dst_path=str(dest),
                                                        tracking_uri=client.tracking_uri))
    except Exception as e:  # noqa: BLE001 - a store that cannot serve the bytes cannot show they are the judged ones
        raise NotVerified(f"{mv.name} v{mv.version}: cannot download its artifact from {mv.source} "
                          f"({type(e).__name__}: {e})") from None
