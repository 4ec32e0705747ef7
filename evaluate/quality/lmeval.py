"""lm-eval tasks run through a kiln engine: per-document records joined on `doc_id`, plus aggregates.

`evaluate_lmeval(engine, LmEvalConfig(...), out_dir)` renders kiln's shipped tasks (or takes the
user's task YAMLs by path), runs lm-eval's `simple_evaluate` with the batched `KilnLM` adapter
and `log_samples=True`, and returns one `QualityResult` per task. Records are keyed by lm-eval's
`doc_id` (the document's index), never `doc_hash`: repeated documents would explode that join.

Kiln names every metric `<task>_<metric>` (`word_swap_acc`, `heldout_word_perplexity`), declared
with its direction in `kiln.core.metrics` so the gate knows which way is worse. Each record
holds those per-document values (a perplexity for one document; 0/1 for accuracy) and the raw
pieces a paired ratio needs (`nll` with `tokens`, `words`, `bytes`).
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path
from typing import Any

from pydantic import Field

from kiln.evaluate.quality.base import QUALITY_EVALS, EvalInputs, QualityEval, QualityResult
from kiln.evaluate.quality.lmeval_config import DEFAULT_BATCH_SIZE, LmEvalConfig
from kiln.evaluate.tasks import (SHIPPED, TaskData, TaskSet, needs_data, prepare_tasks, task_fingerprint,
                                 task_manager)
from kiln.core.errors import BadInput
from kiln.core.files import atomic_write_json
from kiln.core.metrics import LMEVAL, METRICS, declare

__all__ = ["DEFAULT_BATCH_SIZE", "LmEvalConfig", "TaskSet", "evaluate_lmeval", "prepare_tasks", "run_lmeval",
           "task_fingerprint", "task_manager"]

COUNTS = {"word_perplexity": "words", "byte_perplexity": "bytes", "bits_per_byte": "bytes"}
# lm-eval's own aggregation for these metrics, when a task YAML leaves it out.
RATIO_AGGREGATION = {"word_perplexity": "weighted_perplexity", "byte_perplexity": "weighted_perplexity",
                     "bits_per_byte": "bits_per_byte"}

SHIPPED_METRICS = (
    ("word_swap_acc", True, "fraction", "word-swap pairs where the original sentence beats the swapped one"),
    ("gsm8k_answer_logprob", True, "nats", "log-likelihood of a GSM8K reference solution given its question"),
    ("gsm8k_answer_logprob_per_token", True, "nats/token", "GSM8K reference solution log-likelihood per token"),
    ("gsm8k_answer_bits_per_byte", False, "bits/byte", "GSM8K reference solution negative log-likelihood per byte"),
    ("heldout_word_perplexity", False, "", "rolling perplexity per word on held-out text (lm-eval wikitext style)"),
    ("heldout_byte_perplexity", False, "", "rolling perplexity per byte on held-out text"),
    ("heldout_bits_per_byte", False, "bits/byte", "rolling negative log-likelihood per byte on held-out text"),
    ("heldout_token_perplexity", False, "", "rolling perplexity per token on held-out text"),
)
for _metric in SHIPPED_METRICS:  # each measured when its task is listed (`kiln validate` checks)
    _task = next(t for t in SHIPPED if _metric[0].startswith(f"{t}_"))
    declare(*_metric, kind="quality", measured_by=LMEVAL, task=_task)


@QUALITY_EVALS.register("lmeval", LmEvalConfig)
class LmEval(QualityEval):
    """The tasks through each arm alone; keyed by each task's content fingerprint."""

    section = Field(None, description="lm-eval tasks run through the engine (per-document records)")
    stage = "lmeval"
    metrics = tuple(m[0] for m in SHIPPED_METRICS)  # a user's task's: declared when it runs (_result)

    def _data(self, given: EvalInputs) -> TaskData | None:
        return given.task_data() if needs_data(self.config.tasks) else None  # user YAMLs alone need no demo data

    def inputs(self, given: EvalInputs) -> dict[str, Any]:
        with tempfile.TemporaryDirectory() as tmp:
            fingerprints = prepare_tasks(self.config.tasks, Path(tmp), self._data(given)).fingerprints()
        return {"tasks": fingerprints, "limit": self.config.limit}

    def run(self, given: EvalInputs, role: str, out: Path) -> dict[str, Any]:
        results = evaluate_lmeval(given.engines[role], self.config, out, self._data(given))
        samples = [{"file": f"{r.name}.jsonl",
                    "columns": sorted({k for rec in r.records for k in rec if k.startswith(f"{r.name}_")})}
                   for r in results]
        return {"metrics": {k: v for r in results for k, v in r.metrics.items()}, "samples": samples}


def evaluate_lmeval(engine: Any, config: LmEvalConfig, out_dir: Path,
                    data: TaskData | None = None) -> list[QualityResult]:
    """Prepare `config.tasks` under `out_dir/tasks`, run them, write records to `out_dir`.
    `data`: the shipped tasks' data paths (see `prepare_tasks`)."""
    tasks = prepare_tasks(config.tasks, Path(out_dir) / "tasks", data)
    return run_lmeval(engine, tasks.names, tasks.include_paths, config.limit, out_dir, config.batch_size)


def run_lmeval(engine: Any, tasks: list[str], include_paths: list[Path], limit: int | None,
               out_dir: Path, batch_size: int = DEFAULT_BATCH_SIZE) -> list[QualityResult]:
    """Run lm-eval tasks through `engine`; write `<task>.jsonl` records and `lmeval.json` to `out_dir`."""
    manager = task_manager(include_paths)
    missing = [t for t in tasks if t not in manager.all_subtasks]
    if missing:
        raise BadInput(f"lm-eval task(s) {missing} not found in {[str(p) for p in include_paths]}.",
                       [f"available: {', '.join(manager.all_subtasks) or 'none'}"])
    # lm-eval (and the adapter built on it) load here, not at import: `kiln validate` reads LmEvalConfig.
    from lm_eval import simple_evaluate

    from kiln.evaluate.quality.lmeval_adapter import KilnLM

    lm = KilnLM(engine=engine, batch_size=batch_size)
    out = simple_evaluate(model=lm, tasks=list(tasks), task_manager=manager, limit=limit,
                          log_samples=True, bootstrap_iters=0)  # kiln's gate does its own paired statistics
    results = [_result(task, out, lm) for task in tasks]
    for r in results:
        r.write(Path(out_dir))
    atomic_write_json(Path(out_dir) / "lmeval.json", {
        "results": out["results"], "versions": out["versions"], "n-samples": out["n-samples"],
        "configs": out["configs"], "lm_eval_version": out.get("lm_eval_version"), "limit": limit,
        "fingerprints": {t: task_fingerprint(t, include_paths) for t in tasks}})
    return results


def _result(task: str, out: dict[str, Any], lm: Any) -> QualityResult:
    config = out["configs"][task]
    aggregation = {m["metric"]: m.get("aggregation") for m in config.get("metric_list") or [] if isinstance(m, dict)}
    for metric, higher in out["higher_is_better"][task].items():
        if f"{task}_{metric}" not in METRICS:  # a user's task: lm-eval's declared direction
            declare(f"{task}_{metric}", bool(higher), "", f"lm-eval task {task}: {metric}", kind="quality",
                    measured_by=LMEVAL, task=task)
    records: dict[int, dict[str, Any]] = {}
    for sample in out["samples"][task]:
        rec = records.setdefault(sample["doc_id"], {"doc_id": sample["doc_id"], **_doc_fields(sample)})
        suffix = "" if sample["filter"] == "none" else f"_{sample['filter']}"
        for metric in sample["metrics"]:
            rec.update(_per_doc(f"{task}_{metric}{suffix}", metric, sample[metric], aggregation.get(metric)))
        rec.update(_response(config["output_type"], sample, lm))
    rows = [records[i] for i in sorted(records)]
    metrics = {f"{task}_{key.replace(',none', '').replace(',', '_')}": float(v)
               for key, v in out["results"][task].items()
               if "," in key and "_stderr" not in key and isinstance(v, (int, float))}
    metrics.update(_token_metrics(task, config["output_type"], rows))
    metrics[f"{task}_documents"] = float(len(rows))
    return QualityResult(task, rows, metrics)


def _doc_fields(sample: dict[str, Any]) -> dict[str, Any]:
    doc = sample["doc"]
    return {"id": doc["id"], "doc": doc} if isinstance(doc, dict) and "id" in doc else {"doc": doc}


def _per_doc(name: str, metric: str, value: Any, aggregation: str | None) -> dict[str, Any]:
    """One document's value; (loglikelihood, count) pairs become that document's own ratio."""
    if isinstance(value, (bool, int, float)):
        return {name: float(value)}
    aggregation = aggregation or RATIO_AGGREGATION.get(metric)
    if isinstance(value, (tuple, list)) and len(value) == 2 and aggregation in ("weighted_perplexity", "bits_per_byte"):
        ll, n = float(value[0]), int(value[1])
        per = -ll / n / math.log(2) if aggregation == "bits_per_byte" else math.exp(-ll / n)
        return {name: per, "nll": -ll, COUNTS.get(metric, f"{metric}_count"): n}
    return {name: value}


def _response(output_type: str, sample: dict[str, Any], lm: Any) -> dict[str, Any]:
    resps = sample["filtered_resps"]
    if output_type == "multiple_choice":
        return {"logprobs": [float(r[0]) for r in resps], "target": sample["target"]}
    if output_type == "loglikelihood":
        _, cont = lm.encode_request(*sample["arguments"][0])
        return {"loglikelihood": float(resps[0][0]), "is_greedy": bool(resps[0][1]), "tokens": len(cont)}
    if output_type == "loglikelihood_rolling":
        return {"loglikelihood": float(resps[0]), "nll": -float(resps[0]),
                "tokens": len(lm.tok_encode(sample["arguments"][0][0]))}
    return {"response": resps[0] if isinstance(resps, list) and resps else resps}


def _token_metrics(task: str, output_type: str, rows: list[dict[str, Any]]) -> dict[str, float]:
    """Per-token values: each document's own, and the aggregate as sum over sum (as lm-eval does)."""
    tokens = sum(r.get("tokens", 0) for r in rows)
    if not tokens or output_type not in ("loglikelihood", "loglikelihood_rolling"):
        return {}
    per_token = output_type == "loglikelihood"  # else rolling text: a perplexity

    def value(ll: float, n: int) -> float:
        return ll / n if per_token else math.exp(-ll / n)

    name = f"{task}_logprob_per_token" if per_token else f"{task}_token_perplexity"
    if name not in METRICS:
        declare(name, per_token, "", f"lm-eval task {task}: {name.removeprefix(task + '_')}", kind="quality",
                measured_by=LMEVAL, task=task)
    for r in rows:
        r[name] = value(r["loglikelihood"], r["tokens"]) if r["tokens"] else None
    return {name: value(sum(r["loglikelihood"] for r in rows), tokens)}
