"""lm-eval throughput: kiln's batched `KilnLM` adapter vs lm-eval's own batched `hf` backend.

Same demo model, same rendered tasks, same document limit, one process (so the same torch
threads); model loading is not timed. Each task runs on both backends, alternating which goes
first on each repeat so machine drift does not favour one side. Also reports how far apart the
two backends' per-document results are (they score the same tokens, so only float noise).

    python bench/lmeval_throughput.py [--limit 32] [--batch-size 32] [--repeats 2]

Writes bench/results/lmeval_throughput.json and prints a table.
"""

from __future__ import annotations

import argparse
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results" / "lmeval_throughput.json"


def _evaluate(lm: Any, task: str, manager: Any, limit: int) -> tuple[float, dict[str, Any]]:
    from lm_eval import simple_evaluate

    start = time.perf_counter()
    out = simple_evaluate(model=lm, tasks=[task], task_manager=manager, limit=limit, log_samples=True,
                          bootstrap_iters=0)
    return time.perf_counter() - start, out


def _lls(out: dict[str, Any], task: str) -> list[float]:
    """Every log-likelihood lm-eval got back for the task, in document order."""
    values = []
    for s in sorted(out["samples"][task], key=lambda s: s["doc_id"]):
        for r in s["resps"]:
            values.append(float(r[0][0]) if isinstance(r[0], (list, tuple)) else float(r[0]))
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=32, help="documents per task")
    parser.add_argument("--batch-size", type=int, default=32, help="both backends' batch size")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--tasks", nargs="+", default=None)
    args = parser.parse_args()

    from kiln.evaluate.tasks import SHIPPED, offline_environment, prepare_tasks, task_manager
    from kiln.pipeline.demo import demo_model_dir, prepare_demo_data

    offline_environment()
    import torch
    from lm_eval.models.huggingface import HFLM

    from kiln.engine.hf_torch import TorchEngine, TorchEngineConfig
    from kiln.evaluate.quality.lmeval_adapter import KilnLM
    from kiln.pipeline.files import atomic_write_json

    model = demo_model_dir()
    names = args.tasks or list(SHIPPED)
    work = Path(tempfile.mkdtemp(prefix="kiln-lmeval-bench-"))
    tasks = prepare_tasks(names, work, prepare_demo_data())
    manager = task_manager(tasks.include_paths)
    backends = {
        "hf": HFLM(pretrained=str(model), device="cpu", dtype="float32", batch_size=args.batch_size),
        "kiln": KilnLM(engine=TorchEngine(model, TorchEngineConfig()), batch_size=args.batch_size),
    }
    rows = []
    for task in names:
        seconds: dict[str, list[float]] = {"hf": [], "kiln": []}
        outs: dict[str, dict[str, Any]] = {}
        for rep in range(args.repeats):
            for name in (["hf", "kiln"] if rep % 2 == 0 else ["kiln", "hf"]):
                elapsed, outs[name] = _evaluate(backends[name], task, manager, args.limit)
                seconds[name].append(elapsed)
        hf_ll, kiln_ll = _lls(outs["hf"], task), _lls(outs["kiln"], task)
        best = {k: min(v) for k, v in seconds.items()}
        rows.append({"task": task, "documents": len(outs["kiln"]["samples"][task]), "requests": len(kiln_ll),
                     "hf_s": seconds["hf"], "kiln_s": seconds["kiln"], "speedup": best["hf"] / best["kiln"],
                     "max_abs_ll_diff": max(abs(a - b) for a, b in zip(hf_ll, kiln_ll, strict=True)),
                     "results": {"hf": outs["hf"]["results"][task], "kiln": outs["kiln"]["results"][task]}})
    total = {k: sum(min(r[f"{k}_s"]) for r in rows) for k in ("hf", "kiln")}
    report = {"model": str(model), "limit": args.limit, "batch_size": args.batch_size, "repeats": args.repeats,
              "torch_threads": torch.get_num_threads(), "machine": platform.processor() or platform.machine(),
              "tasks": rows, "total_s": total, "speedup": total["hf"] / total["kiln"]}
    atomic_write_json(RESULTS, report)
    print(f"{'task':<14}{'docs':>6}{'reqs':>6}{'hf s':>9}{'kiln s':>9}{'speedup':>9}{'max |Δll|':>11}")
    for r in rows:
        print(f"{r['task']:<14}{r['documents']:>6}{r['requests']:>6}{min(r['hf_s']):>9.1f}"
              f"{min(r['kiln_s']):>9.1f}{r['speedup']:>8.2f}x{r['max_abs_ll_diff']:>11.2e}")
    print(f"{'all':<26}{total['hf']:>9.1f}{total['kiln']:>9.1f}{report['speedup']:>8.2f}x   -> {RESULTS}")


if __name__ == "__main__":
    main()
