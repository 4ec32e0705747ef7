"""How a search's wall time scales with its candidates and the nodes of a Ray cluster (issue 37).

Runs `kiln run` with `search.executor: ray` on a real local cluster (tests/ray_cluster.py: K nodes
of one CPU each, each with its own empty kiln cache) against a real `mlflow server`, for N candidates
that all pass every phase (fp32 copies of a tiny random Llama on torch, one thread, distinct engine
configurations so no stage is shared), and times each phase from the driver's own lines.

The model: a phase is a barrier (the search judges a candidate only once its phase is done, and the
next phase starts after every candidate was judged); on K nodes with one task slot each, a phase of
n candidates runs in ceil(n / K) waves, each as long as its slowest task, after a start that does
not shrink with K (a_p: the first task's worker starting on each node, and the stages every
candidate shares, such as the baseline's perplexity, which each node computes once for itself);
then the winner's confirmation runs alone. So

    wall(N, K) = setup + sum over phases of (a_p + ceil(N_p / K) * t_p) + confirmation and report

with t_p the slowest candidate's time in phase p. a_p and t_p (a least-squares line through each
phase's duration against N), setup and the tail are fitted on the one-node runs, where every wave
is one task, and the model predicts the others; the JSON holds both. On a host whose cores the
nodes share (this 2-core machine, with the driver and the tracking server beside them) the K-node
runs are slower than the model by that contention: it says what a cluster of separate machines does.

    flock /tmp/kiln-heavy.lock .venv/bin/python bench/search_scale.py --candidates 1 2 4 --nodes 1 2
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the test suite's real cluster and tracking server

from kiln.core.files import atomic_write_json  # noqa: E402
from kiln.evaluate import contention  # noqa: E402
from kiln.pipeline.stages.phases import PHASES  # noqa: E402
from tests.conftest import build_tiny_llama  # noqa: E402
from tests.pipeline.conftest import TINY_RECIPE, fresh_cache  # noqa: E402
from tests.ray_cluster import ray_cluster  # noqa: E402
from tests.tracking_servers import tracking_setup  # noqa: E402

OUT = Path(__file__).parent / "results" / "search_scale.json"
CHECKS = [{"kind": "size", "max_ratio": 1.0},
          {"kind": "quality", "metric": "perplexity", "margin": 0.05, "relative": True},
          {"kind": "agreement", "metric": "top1_agreement", "min": 0.99},
          {"kind": "performance", "metric": "decode_tok_s", "min_ratio": 0.1, "max_cpu_pressure": None}]


def recipe(path: Path, model: Path, n: int, address: str, experiment: str) -> Path:
    raw = yaml.safe_load(yaml.safe_dump(TINY_RECIPE))
    del raw["optimize"], raw["engine"]
    candidates = [{"name": f"fp32-b{16 + i}", "optimize": {"method": "none"},
                   "engine": {"backend": "torch", "threads": 1, "max_batch_size": 16 + i}} for i in range(n)]
    raw.update(name="scale", model={"path": str(model)}, candidates=candidates,
               baseline={"engine": {"backend": "torch", "threads": 1}},
               search={"executor": "ray", "ray": {"address": address}})
    raw["evaluate"]["quality"]["lmeval"] = None
    raw["evaluate"]["quality"]["perplexity"]["max_documents"] = 32  # enough for the family's check up to ~10
    raw["tracking"]["experiment"] = experiment
    raw["gate"]["checks"] = CHECKS
    path.write_text(yaml.safe_dump(raw))
    return path


def timed_run(cmd: list[str], cwd: Path, env: dict[str, str], names: list[str]) -> dict:
    """The run's wall time and its phase boundaries: the driver prints '  <name>: …' as it judges
    each candidate after a phase, 'confirm …' before the confirmation."""
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=cwd, env={**os.environ, **env}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    judged, marks, tail = 0, {}, []
    for line in proc.stdout:
        now = time.monotonic() - start
        tail = (tail + [line])[-40:]
        if line.startswith("[bold]search") or line.startswith("search:"):
            marks.setdefault("setup", now)
        if any(line.startswith(f"  {name}: ") for name in names):
            judged += 1
            if judged % len(names) == 0:
                marks[PHASES[judged // len(names) - 1]] = now
        if line.startswith("confirm "):
            marks["confirm_start"] = now
    proc.wait()
    wall = time.monotonic() - start
    if proc.returncode != 0 or judged != len(names) * len(PHASES):
        raise RuntimeError(f"exit {proc.returncode}, {judged} judgements:\n" + "".join(tail))
    return {"wall_s": wall, "marks": marks}


def phases_of(run: dict) -> dict[str, float]:
    """Each phase's duration, the setup before the first and the tail after the last."""
    marks, out, before = run["marks"], {}, run["marks"]["setup"]
    for phase in PHASES:
        out[phase], before = marks[phase] - before, marks[phase]
    return {"setup": marks["setup"], **out, "tail": run["wall_s"] - before}


def measure(work: Path, model: Path, store, n: int, k: int) -> dict:
    names = [f"fp32-b{16 + i}" for i in range(n)]
    with ray_cluster(work / f"cluster-{n}-{k}", k, store.env) as cluster:
        path = recipe(work / f"scale-{n}-{k}.yaml", model, n, cluster.address, f"scale-{n}-{k}")
        env = {**store.env, "MLFLOW_TRACKING_URI": store.uri, "KILN_CACHE": str(fresh_cache(work / f"driver-{n}-{k}"))}
        with contention.Watch() as watch:  # CPU pressure over the run: how much the nodes waited for the cores
            run = timed_run([sys.executable, "-m", "kiln.pipeline", "run", str(path)], work, env, names)
            machine = watch.figures()
    return {"candidates": n, "nodes": k, "wall_s": run["wall_s"], "phases": phases_of(run), "machine": machine}


def fit(runs: list[dict]) -> dict[str, float]:
    """Each phase's start a_p and per-wave time t_p, setup and tail from the one-node runs: there a
    phase of n candidates is n waves, so its duration is a_p + n * t_p (least squares over n)."""
    import numpy as np

    ones = [r for r in runs if r["nodes"] == 1]
    if len({r["candidates"] for r in ones}) < 2:
        raise SystemExit("the fit needs one-node runs at two or more candidate counts (--candidates 1 2 4)")
    n = np.array([r["candidates"] for r in ones], dtype=float)
    model = {}
    for p in PHASES:
        slope, start = np.polyfit(n, [r["phases"][p] for r in ones], 1)
        model[p], model[f"{p}_start"] = float(slope), float(start)
    model["setup"] = sum(r["phases"]["setup"] for r in ones) / len(ones)
    model["tail"] = sum(r["phases"]["tail"] for r in ones) / len(ones)
    return model


def predict(model: dict[str, float], n: int, k: int) -> float:
    return model["setup"] + sum(model[f"{p}_start"] + math.ceil(n / k) * model[p] for p in PHASES) + model["tail"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--candidates", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--nodes", type=int, nargs="+", default=[1, 2])
    args = ap.parse_args()
    if 1 not in args.nodes:
        ap.error("--nodes must include 1: the model is fitted on the one-node runs")
    from kiln.pipeline.demo.prepare import demo_model_dir

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="kiln-scale-") as tmp, tracking_setup("http", Path(tmp) / "store") as store:
        work = Path(tmp)
        model = build_tiny_llama(demo_model_dir(), work / "tiny")
        runs = [measure(work, model, store, n, k) for k in sorted(args.nodes) for n in args.candidates]
    model_fit = fit(runs)
    for r in runs:
        r["predicted_s"] = predict(model_fit, r["candidates"], r["nodes"])
        print(f"N={r['candidates']} K={r['nodes']}: {r['wall_s']:.1f} s measured, {r['predicted_s']:.1f} s modelled "
              f"({r['wall_s'] / r['predicted_s'] - 1:+.0%}), CPU pressure {r['machine']['cpu_pressure'] or 0:.0%}; phases " +
              " ".join(f"{p} {v:.1f}" for p, v in r["phases"].items()))
    atomic_write_json(OUT, {"runs": runs, "model": model_fit, "predicted_24_on_8_s": predict(model_fit, 24, 8),
                            "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                                        "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
                            "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
    print(f"24 candidates on 8 such nodes: {predict(model_fit, 24, 8):.0f} s by the model; written to {OUT}")


if __name__ == "__main__":
    main()
