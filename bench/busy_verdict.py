"""The demo's speed check with 0, 1 and 2 busy processes beside it: does the verdict hold on a busy machine?

The demo's decode check (recipes/demo.yaml: decode_tok_s of the pick, GGUF q4_1 on llama.cpp, at least
`min_ratio` times the fp32 torch baseline's) measured as the benchmark stage measures it: its prompts,
rounds and tokens, the arms interleaved per prompt, each arm's half of every pair watched
(kiln.evaluate.contention), then judged by the recipe's check at the recipe's confidence. The engines
are the ones a cached demo run built (`--run`, default the newest runs/demo-*: `make demo` first),
loaded once for every trial.

A trial measures each level once, in an order that rotates trial by trial, so drift of the shared
machine does not fall on one level; a level starts its busy processes (`python -c "while True:
pass"`, one CPU each) a second before measuring and ends them after. Per level: the verdicts, the
ratio and interval of each trial, the pairs dropped by the guard (load that changed within a pair),
and the CPU pressure over the whole measurement and within the pairs. Targets (issue 54): every
verdict agrees with the quiet one or is Inconclusive, and at 1 busy process at least 90% of trials
decide.

    python bench/busy_verdict.py                    # 3 trials x levels 0 1 2 (~14 min on 2 cores; 5: 23 min)
    python bench/busy_verdict.py --trials 2 --levels 0 --levels 1

Writes bench/results/busy_verdict.json and prints a table.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

OUT = Path(__file__).parent / "results" / "busy_verdict.json"
ROOT = Path(__file__).parent.parent
BUSY = [sys.executable, "-c", "while True: pass"]


def demo_engines(run: Path) -> dict[str, Path]:
    """The baseline's and the q4_1 pick's engine folders of a cached demo run."""
    from kiln.core.files import read_json

    stages = run / "candidates" / "llama-q4_1" / "stages"
    if not stages.is_dir():
        raise SystemExit(f"{run}: no llama-q4_1 candidate; run `make demo` first or pass --run")
    return {role: Path(read_json(Path(read_json(stages / f"engine-{role}.json")["path"]) / "result.json")["engine_dir"])
            for role in ("baseline", "candidate")}


def newest_demo_run() -> Path:
    from kiln.core.home import runs_root

    runs = sorted(runs_root().glob("demo-*"), key=lambda p: p.stat().st_mtime)
    if not runs:
        raise SystemExit(f"no demo-* folder under {runs_root()}: run `make demo` first or pass --run")
    return runs[-1]


def cpu_model() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def speed_policy(recipe: Any) -> Any:
    """The recipe's gate with its decode-benchmark checks only."""
    checks = [c for c in recipe.gate.checks if c.kind == "performance" and not c.metric.startswith("load_")]
    return recipe.gate.model_copy(update={"checks": checks})


def measure(arms: dict[str, Any], prompts: list[list[int]], recipe: Any, busy: int) -> dict[str, Any]:
    """One level of one trial: `busy` spinning processes beside the demo's benchmark, then the verdict."""
    from kiln.core.gate.base import Evidence
    from kiln.core.gate.performance import steady_pairs
    from kiln.core.gate.policy import judge
    from kiln.evaluate import contention
    from kiln.evaluate.decode_bench import interleaved

    b = recipe.evaluate.benchmark
    procs = [subprocess.Popen(BUSY) for _ in range(busy)]
    try:
        time.sleep(1.0 if busy else 0)  # they are running before the first pair
        load = os.getloadavg()[0]
        with contention.Watch() as watch:
            per_arm = interleaved(arms, prompts, b.max_new_tokens, [1], b.repeats, watch=watch)
            machine = watch.figures()
    finally:
        for p in procs:
            p.kill()
            p.wait()
    ev = {role: Evidence(role, metrics=contention.as_metrics(machine), repeats=samples)
          for role, samples in per_arm.items()}
    policy = speed_policy(recipe)
    result = judge(policy, ev["candidate"], ev["baseline"]).results[0]
    pairs = len(per_arm["candidate"]["decode_tok_s"])
    steady = steady_pairs(policy.checks[0], ev["candidate"].repeats, ev["baseline"].repeats, pairs)
    halves = [v for role in per_arm for k, vs in per_arm[role].items() if k.endswith("pressure") for v in vs]
    return {"busy": busy, "verdict": result.verdict.value, "ratio": result.observed,
            "ci": list(result.ci) if result.ci else None, "dropped": int((~steady[0]).sum()) if steady else None, "pairs": pairs,
            "reason": result.reason, "pressure": machine["cpu_pressure"], "signal": machine["signal"],
            "steal": machine["cpu_steal"], "half_pressure_median": statistics.median(halves) if halves else None,
            "load_average_start": load,
            "pressure_in_halves": {role: per_arm[role].get(name, []) for role in per_arm
                                   for name in (contention.as_metrics(machine) or {"": 0}) if name.endswith("pressure")}}


def summarize(trials: list[dict[str, Any]], levels: list[int]) -> dict[str, Any]:
    quiet = [t["verdict"] for t in trials if t["busy"] == 0]
    reference = statistics.mode(quiet) if quiet else None
    out = {}
    for level in levels:
        rows = [t for t in trials if t["busy"] == level]
        decided = [t for t in rows if t["verdict"] in ("Successful", "Failed")]
        out[str(level)] = {
            "trials": len(rows), "verdicts": [t["verdict"] for t in rows],
            "decided_share": len(decided) / len(rows),
            "agree_or_inconclusive": all(t["verdict"] in (reference, "Inconclusive") for t in rows),
            "ratio_median": statistics.median(t["ratio"] for t in rows if t["ratio"] is not None)
            if any(t["ratio"] is not None for t in rows) else None,
            "dropped": [f"{t['dropped']}/{t['pairs']}" for t in rows],
            "pressure_median": statistics.median(t["pressure"] for t in rows if t["pressure"] is not None),
        }
    return {"quiet_verdict": reference, "levels": out}


def print_table(result: dict[str, Any]) -> None:
    print(f"{'busy':>4}  {'verdict':<13}{'ratio [interval]':<26}{'dropped':>9}{'pressure':>10}{'in pairs':>10}")
    for t in result["trials"]:
        ci = f"[{t['ci'][0]:.2f}, {t['ci'][1]:.2f}]" if t["ci"] else ""
        ratio = f"{t['ratio']:.2f} {ci}" if t["ratio"] is not None else "—"
        half = f"{t['half_pressure_median']:.0%}" if t["half_pressure_median"] is not None else "—"
        print(f"{t['busy']:>4}  {t['verdict']:<13}{ratio:<26}{t['dropped']:>5}/{t['pairs']:<3}"
              f"{t['pressure']:>10.0%}{half:>10}")
    print(f"quiet verdict: {result['summary']['quiet_verdict']}")
    for level, s in result["summary"]["levels"].items():
        print(f"{level} busy: {s['trials']} trials, decided {s['decided_share']:.0%}, agree or Inconclusive: "
              f"{s['agree_or_inconclusive']}, median ratio {s['ratio_median']}, pressure {s['pressure_median']:.0%}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--levels", type=int, action="append", help="busy processes beside it (repeatable; default 0 1 2)")
    p.add_argument("--run", type=Path, help="a cached demo run folder (default: the newest runs/demo-*)")
    p.add_argument("--recipe", type=Path, default=ROOT / "recipes" / "demo.yaml")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args()
    from kiln.core.files import atomic_write_json
    from kiln.engine.loader import load_engine
    from kiln.pipeline.recipe.schema import load_recipe
    from kiln.pipeline.stages.inputs import _encode, read_prompts, tokenizer_of

    levels = args.levels or [0, 1, 2]
    recipe = load_recipe(args.recipe, [])
    dirs = demo_engines(args.run or newest_demo_run())
    b = recipe.evaluate.benchmark
    prompts = _encode(tokenizer_of(dirs["baseline"]), read_prompts(b.prompts, b.num_prompts))
    arms = {role: load_engine(path) for role, path in dirs.items()}
    started, trials = time.time(), []
    for trial in range(args.trials):
        for level in levels[trial % len(levels):] + levels[:trial % len(levels)]:
            trials.append({"trial": trial, **measure(arms, prompts, recipe, level)})
            print(f"trial {trial} busy {level}: {trials[-1]['verdict']} {trials[-1]['reason']}", flush=True)
    for engine in arms.values():
        engine.close()
    result = {"machine": {"cpu": cpu_model(), "cores": os.cpu_count(),
                          "load_average_end": os.getloadavg()}, "seconds": round(time.time() - started),
              "recipe": str(args.recipe), "trials": trials, "summary": summarize(trials, levels)}
    atomic_write_json(args.out, result)
    print_table(result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
