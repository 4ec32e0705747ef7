"""lm-eval cost: kiln's batched `KilnLM` adapter vs lm-eval's own batched `hf` backend, per CPU-second.

Same demo model, same rendered tasks and documents, same batch size, one process (so the same
torch threads); model loading is not timed. Three task kinds: `word_swap` (multiple choice),
`heldout` (rolling log-likelihood) and `gsm8k_gen` (generate_until, a bench-only task over the
GSM8K questions: greedy, stops at a blank line or `max_gen_toks`). Each repeat runs both backends,
the order alternating (hf kiln, kiln hf, ...) so machine drift favours neither.

The cost is process CPU time (`time.process_time`: every thread of this process) spent inside
the model's request methods (`loglikelihood`, `loglikelihood_rolling`, `generate_until`: what a
backend controls; lm-eval's task building is the same for both and reported separately as the
whole `simple_evaluate` CPU time). The table gives requests per CPU-second, medians over repeats
with [min, max], and the kiln/hf ratio computed within each repeat. It also reports how far apart
the two backends' per-request results are, and the load average before and after.

    flock /tmp/kiln-heavy.lock python bench/lmeval_throughput.py [--repeats 4] [--batch-size 32]

Writes bench/results/lmeval_throughput.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results" / "lmeval_throughput.json"
METHODS = ("loglikelihood", "loglikelihood_rolling", "generate_until")
LIMITS = {"word_swap": 48, "heldout": 6, "gsm8k_gen": 16}  # ~10-20 CPU-seconds per run on the demo model
GEN_TASK = """task: gsm8k_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{continuation}}}}"
generation_kwargs:
  until: ["\\n\\n", "Question:"]
  max_gen_toks: {max_gen_toks}
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


class Timed:
    """Wraps a backend's request methods, adding the process CPU and wall time spent in them."""

    def __init__(self, lm: Any) -> None:
        self.cpu = self.wall = 0.0
        for name in METHODS:
            setattr(lm, name, self._wrap(getattr(lm, name)))

    def _wrap(self, method: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            cpu, wall = time.process_time(), time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.cpu += time.process_time() - cpu
                self.wall += time.perf_counter() - wall
        return timed

    def reset(self) -> None:
        self.cpu = self.wall = 0.0


def _evaluate(lm: Any, timer: Timed, task: str, manager: Any, limit: int) -> dict[str, Any]:
    from lm_eval import simple_evaluate

    timer.reset()
    cpu, wall = time.process_time(), time.perf_counter()
    out = simple_evaluate(model=lm, tasks=[task], task_manager=manager, limit=limit, log_samples=True,
                          bootstrap_iters=0)
    return {"out": out, "model_cpu_s": timer.cpu, "model_wall_s": timer.wall,
            "total_cpu_s": time.process_time() - cpu, "total_wall_s": time.perf_counter() - wall}


def _responses(out: dict[str, Any], task: str) -> list[Any]:
    """Every response lm-eval got back for the task, in document order (a float or a string)."""
    values = []
    for s in sorted(out["samples"][task], key=lambda s: s["doc_id"]):
        for r in s["resps"]:
            values.append(r[0][0] if isinstance(r[0], (list, tuple)) else r[0])
    return values


def _difference(hf: list[Any], kiln: list[Any]) -> dict[str, Any]:
    if hf and isinstance(hf[0], str):
        return {"texts_differing": sum(a != b for a, b in zip(hf, kiln, strict=True))}
    return {"max_abs_ll_diff": max(abs(float(a) - float(b)) for a, b in zip(hf, kiln, strict=True))}


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _pressure() -> str | None:
    try:
        return Path("/proc/pressure/cpu").read_text().splitlines()[0]
    except OSError:
        return None


def _render_gen_task(folder: Path, data: Any, max_gen_toks: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "gsm8k_gen.yaml").write_text(GEN_TASK.format(data=json.dumps(str(data.gsm8k_answers)),
                                                           max_gen_toks=max_gen_toks))
    return folder


def _row(task: str, runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    requests = len(_responses(runs["kiln"][0]["out"], task))
    rates = {k: [requests / r["model_cpu_s"] for r in v] for k, v in runs.items()}
    ratios = [k / h for k, h in zip(rates["kiln"], rates["hf"], strict=True)]
    last = {k: v[-1]["out"] for k, v in runs.items()}
    return {"task": task, "documents": len(last["kiln"]["samples"][task]), "requests": requests,
            "requests_per_cpu_s": {k: _spread(v) for k, v in rates.items()},
            "kiln_vs_hf": _spread(ratios), "ratios": ratios,
            "runs": {k: [{x: r[x] for x in r if x != "out"} for r in v] for k, v in runs.items()},
            **_difference(_responses(last["hf"], task), _responses(last["kiln"], task)),
            "results": {k: v["results"][task] for k, v in last.items()}}


def _table(report: dict[str, Any]) -> None:
    print(f"{'task':<11}{'docs':>5}{'reqs':>6}  {'hf req/CPU-s':<22}{'kiln req/CPU-s':<22}{'kiln/hf':<20}diff")
    for r in report["tasks"]:
        h, k, q = r["requests_per_cpu_s"]["hf"], r["requests_per_cpu_s"]["kiln"], r["kiln_vs_hf"]
        diff = (f"{r['texts_differing']} texts" if "texts_differing" in r else f"{r['max_abs_ll_diff']:.1e}")
        print(f"{r['task']:<11}{r['documents']:>5}{r['requests']:>6}  "
              f"{h['median']:>6.2f} [{h['min']:.2f}, {h['max']:.2f}]   {k['median']:>6.2f} [{k['min']:.2f}, {k['max']:.2f}]"
              f"   {q['median']:.2f}x [{q['min']:.2f}, {q['max']:.2f}]   {diff}")
    print(f"load average {report['loadavg_before']} -> {report['loadavg_after']}; torch threads "
          f"{report['torch_threads']}; -> {RESULTS}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=4, help="runs per backend and task (order alternates)")
    parser.add_argument("--batch-size", type=int, default=32, help="both backends' batch size")
    parser.add_argument("--max-gen-toks", type=int, default=48, help="gsm8k_gen's generation budget")
    parser.add_argument("--tasks", nargs="+", default=list(LIMITS), choices=list(LIMITS))
    parser.add_argument("--limit", type=int, default=None, help="documents per task (default: per-task sizes)")
    args = parser.parse_args()

    from kiln.evaluate.tasks import offline_environment, prepare_tasks, task_manager
    from kiln.pipeline.demo.prepare import demo_model_dir, prepare_demo_data

    offline_environment()
    import torch
    from lm_eval.models.huggingface import HFLM

    from kiln.engine.hf_torch import TorchEngine, TorchEngineConfig
    from kiln.evaluate.quality.lmeval_adapter import KilnLM
    from kiln.core.files import atomic_write_json

    model, data = demo_model_dir(), prepare_demo_data()
    work = Path(tempfile.mkdtemp(prefix="kiln-lmeval-bench-"))
    tasks = prepare_tasks([t for t in args.tasks if t != "gsm8k_gen"], work, data)
    manager = task_manager([*tasks.include_paths, _render_gen_task(work / "bench", data, args.max_gen_toks)])
    backends = {
        "hf": HFLM(pretrained=str(model), device="cpu", dtype="float32", batch_size=args.batch_size),
        "kiln": KilnLM(engine=TorchEngine(model, TorchEngineConfig()), batch_size=args.batch_size),
    }
    timers = {k: Timed(v) for k, v in backends.items()}
    loadavg_before, pressure_before = os.getloadavg(), _pressure()
    rows = []
    for task in args.tasks:
        limit = args.limit or LIMITS[task]
        runs: dict[str, list[dict[str, Any]]] = {"hf": [], "kiln": []}
        for rep in range(args.repeats):
            for name in (["hf", "kiln"] if rep % 2 == 0 else ["kiln", "hf"]):
                runs[name].append(_evaluate(backends[name], timers[name], task, manager, limit))
        rows.append(_row(task, runs))
    report = {"model": str(model), "batch_size": args.batch_size, "repeats": args.repeats,
              "max_gen_toks": args.max_gen_toks, "torch_threads": torch.get_num_threads(),
              "cpus": os.cpu_count(), "machine": platform.processor() or platform.machine(),
              "loadavg_before": [round(x, 2) for x in loadavg_before],
              "loadavg_after": [round(x, 2) for x in os.getloadavg()],
              "cpu_pressure_before": pressure_before, "cpu_pressure_after": _pressure(), "tasks": rows}
    atomic_write_json(RESULTS, report)
    _table(report)


if __name__ == "__main__":
    main()
