"""Rebuild what each arm measured (`Evidence`) from a run directory's stage records.

Stages write results in one convention, so the gate, `kiln compare` and `kiln show` all read
evidence the same way:
- `metrics`: the role's aggregate values;
- `samples`: {"file": JSONL in the stage folder, "columns": [...]} (or a list of them):
  per-document values by doc_id;
- `per_role`: for stages that measure both arms together (interleaved benchmarks), each role's
  `metrics`, `repeats` and `counts` (the load stage's requests: error_rate -> [errors, trials]).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kiln.core.errors import BadInput
from kiln.core.files import read_json
from kiln.core.gate.base import Evidence

ROLES = ("baseline", "candidate")


def _samples(path: Path, spec: dict[str, Any]) -> dict[str, dict[str, float]]:
    rows = [json.loads(line) for line in (path / spec["file"]).read_text().splitlines() if line.strip()]
    return {col: {str(r["doc_id"]): r[col] for r in rows if col in r} for col in spec["columns"]}


def add_result(evidence: dict[str, Evidence], role: str, result: dict[str, Any], path: Path) -> None:
    if role in evidence:
        ev = evidence[role]
        ev.metrics.update({k: v for k, v in result.get("metrics", {}).items() if isinstance(v, int | float)})
        specs = result.get("samples", [])
        for spec in specs if isinstance(specs, list) else [specs]:
            ev.samples.update(_samples(path, spec))
        for name, pair in result.get("counts", {}).items():
            ev.counts[name] = tuple(pair)
    for r, part in result.get("per_role", {}).items():
        if r in evidence:
            evidence[r].metrics.update(part.get("metrics", {}))
            evidence[r].repeats.update(part.get("repeats", {}))
            evidence[r].counts.update({name: tuple(pair) for name, pair in part.get("counts", {}).items()})


def evidence_from_run(run_dir: Path) -> dict[str, Evidence]:
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
        add_result(evidence, record["role"], read_json(path / "result.json"), path)
    return evidence
