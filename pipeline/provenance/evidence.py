"""Rebuild what each arm measured (`Evidence`) from a run directory's stage records.

Stages write results in one convention, so the gate, `kiln compare` and `kiln show` all read
evidence the same way:
- `metrics`: the role's aggregate values;
- `samples`: {"file": JSONL in the stage folder, "columns": [...]} (or a list of them):
  per-document values by doc_id;
- `per_role`: for stages that measure both arms together (interleaved benchmarks), each role's
  `metrics`, `repeats` and `counts` (the load stage's requests: error_rate -> [errors, trials]).

Only sealed evidence is read: each stage folder's seal is checked when the gate reads it
(kiln.pipeline.provenance.stage_evidence, cheap on an unchanged folder), and every file read is hashed as read
and compared with its sealed digest, so a file edited after its stage, even after the check, is
refused (NotVerified, exit 5), never judged.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kiln.core.errors import BadInput, NotVerified
from kiln.core.files import read_json
from kiln.core.gate.base import Evidence
from kiln.core.signing import sha256_bytes
from kiln.pipeline.provenance.stage_evidence import check_record

ROLES = ("baseline", "candidate")
Reader = Callable[[str], str]  # a stage file's name -> its text


def sealed_reader(path: Path, subjects: dict[str, str]) -> Reader:
    """Reads a file of a checked stage folder, refused unless the bytes read are the sealed ones:
    nothing can change between the check and the use."""
    def read(name: str) -> str:
        data = (path / name).read_bytes()
        if name not in subjects or sha256_bytes(data) != subjects[name]:
            raise NotVerified(f"{path / name}: not the file its stage sealed (changed after the stage, or "
                              "never part of it); run the recipe again")
        return data.decode()
    return read


def _samples(read: Reader, spec: dict[str, Any]) -> dict[str, dict[str, float]]:
    rows = [json.loads(line) for line in read(spec["file"]).splitlines() if line.strip()]
    return {col: {str(r["doc_id"]): r[col] for r in rows if col in r} for col in spec["columns"]}


def add_result(evidence: dict[str, Evidence], role: str, result: dict[str, Any], read: Reader) -> None:
    if role in evidence:
        ev = evidence[role]
        ev.metrics.update({k: v for k, v in result.get("metrics", {}).items() if isinstance(v, int | float)})
        specs = result.get("samples", [])
        for spec in specs if isinstance(specs, list) else [specs]:
            ev.samples.update(_samples(read, spec))
        for name, pair in result.get("counts", {}).items():
            ev.counts[name] = tuple(pair)
    for r, part in result.get("per_role", {}).items():
        if r in evidence:
            evidence[r].metrics.update(part.get("metrics", {}))
            evidence[r].repeats.update(part.get("repeats", {}))
            evidence[r].counts.update({name: tuple(pair) for name, pair in part.get("counts", {}).items()})


def evidence_from_run(run_dir: Path) -> dict[str, Evidence]:
    """Each arm's evidence from the run's stage records; NotVerified when a stage folder's seal does
    not check or a file read is not the sealed one."""
    run_dir = Path(run_dir)
    stages = sorted((run_dir / "stages").glob("*.json"))
    if not stages:
        raise BadInput(f"{run_dir}: no finished stages (is this a kiln run directory? see `kiln runs`)")
    evidence = {role: Evidence(role) for role in ROLES}
    for f in stages:
        record = read_json(f)
        path = Path(record["path"])
        if not (path / "result.json").exists():
            raise BadInput(f"{f}: its stage output {path} is gone (cache cleaned?). Re-run the recipe.")
        read = sealed_reader(path, check_record(record).subjects())
        add_result(evidence, record["role"], json.loads(read("result.json")), read)
    return evidence
