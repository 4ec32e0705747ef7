"""The quality-eval contract: per-sample records plus aggregate metrics, and the registry of evals.

Records are keyed by `doc_id` so baseline and candidate join item by item for paired
statistics. Every eval writes its records to disk (JSONL) and the stage logs them as an MLflow
table.

A quality eval is one file: a `QualityEval` registered in `QUALITY_EVALS` under its recipe key
(`evaluate.quality.<name>`) with its config, the recipe field it takes (`section`: its default and
description) and the names of the metrics it records (`metrics`), each declared with its direction
in kiln.core.metrics (`declare`, called from the eval's file; perplexity's and agreement's stay in
kiln.core.metrics itself, where the gate judges them without any eval imported). The recipe's
`QualitySection` is built from the registry, and the evaluate stage (kiln.pipeline.stages.evaluate)
runs every eval the recipe enables: it keys the eval's stage on the engines and `inputs()`, and hands
it the run's engines, documents, prompts and task data (`EvalInputs`), each read when first asked for.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol

from pydantic.fields import FieldInfo

from kiln.core.files import atomic_write_text
from kiln.core.registry import Registry


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

    def stage_result(self, out_dir: Path, columns: list[str]) -> dict[str, Any]:
        """Write the records into the stage's folder; the stage's result: the metrics, and which
        columns of the records file the gate reads per sample."""
        self.write(out_dir)
        return {"metrics": self.metrics, "samples": {"file": f"{self.name}.jsonl", "columns": columns}}


def read_records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def documents(tokenizer: Any, text: str, seq_len: int, max_documents: int) -> list[list[int]]:
    """Cut held-out text into consecutive, non-overlapping windows of `seq_len` tokens."""
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]  # longer than the model: cut below
    n = min(max_documents, len(ids) // seq_len)
    return [ids[i * seq_len:(i + 1) * seq_len] for i in range(n)]


class EvalInputs(Protocol):
    """What the evaluate stage hands an eval; each input is read (and cached) when first asked for."""

    dirs: dict[str, Path]  # each arm's engine folder: "baseline", "candidate"
    engines: Any  # each arm's Engine, loaded on first use; keep_only(role) closes the others

    def documents(self) -> tuple[list[list[int]], dict[str, Any]]:
        """The held-out documents (evaluate.quality.perplexity's text, cut so), and what keys them."""

    def prompts(self, n: int, count_field: str) -> list[list[int]]:
        """The first `n` of evaluate.benchmark.prompts as token ids; `count_field` is named if too few."""

    def task_data(self) -> Any:
        """The data files kiln's shipped lm-eval tasks read (kiln.evaluate.tasks.TaskData)."""


class QualityEval:
    """Base of every quality eval: built from its recipe section's value, run by the evaluate stage."""

    name: ClassVar[str]  # its key under evaluate.quality: set by the registry
    section: ClassVar[FieldInfo]  # its recipe field's default and description; a None default: off unless set
    stage: ClassVar[str]  # the stage (and cache folder) its results are kept under
    phase: ClassVar[str] = "rest"  # when it runs: "quality", "agreement" or "rest" (kiln.pipeline.stages.phases)
    pair: ClassVar[bool] = False  # True: once, the candidate against the baseline; False: each arm alone
    metrics: ClassVar[tuple[str, ...]] = ()  # what it records that a gate check may name (kiln.core.metrics)

    def __init__(self, config: Any):
        self.config = config

    def inputs(self, given: EvalInputs) -> dict[str, Any]:
        """What decides the results besides the engines' folders: part of the stage's key."""
        return {}

    def run(self, given: EvalInputs, role: str, out: Path) -> dict[str, Any]:
        """Measure `role` (a pair: "candidate"), write the records into `out`; the stage's result."""
        raise NotImplementedError


class _InOrder(Registry[QualityEval]):
    def names(self) -> list[str]:
        """In registration order (kiln.evaluate.quality's imports): the recipe lists the sections so."""
        return list(self._plugins)


QUALITY_EVALS: Registry[QualityEval] = _InOrder("quality eval", "name")
