"""The quality-eval contract: per-sample records plus aggregate metrics.

Records are keyed by `doc_id` so baseline and candidate join item by item for paired
statistics. Every eval writes its records to disk (JSONL) and the stage logs them as an MLflow
table.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.core.files import atomic_write_text


@dataclass
class QualityResult:
    name: str
    records: list[dict[str, Any]]  # each has "doc_id"
    metrics: dict[str, float] = field(default_factory=dict)

    def write(self, out_dir: Path) -> Path:
        path = Path(out_dir) / f"{self.name}.jsonl"
        atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in self.records))
        return path

    def column(self, key: str) -> dict[str, float]:
        return {str(r["doc_id"]): r[key] for r in self.records}


def read_records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def documents(tokenizer: Any, text: str, seq_len: int, max_documents: int) -> list[list[int]]:
    """Cut held-out text into consecutive, non-overlapping windows of `seq_len` tokens."""
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]  # longer than the model: cut below
    n = min(max_documents, len(ids) // seq_len)
    return [ids[i * seq_len:(i + 1) * seq_len] for i in range(n)]
