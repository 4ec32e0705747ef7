"""Simulation bench for the canary's sequential test (kiln.deploy.sequential).

Two questions, answered on lognormal TTFTs compared on the log scale (relative=True):
1. With no real difference, how often does each test roll back a healthy canary when it is read
   after every window? The sequential test against its nominal alpha, and a fixed-sample one-sided
   z test read at every look ("naive peeking") or only once at the end.
2. With a real regression (20% by default), how many requests per arm does the sequential test
   need to roll back, compared with the fixed-horizon z test sized for the same alpha and power 0.8?

Writes bench/results/sequential_sim.json and prints a table. The default run takes well under
two minutes on one core; raise --runs for tighter Monte Carlo error.
"""

from __future__ import annotations

import argparse
import math
import platform
import time
from pathlib import Path

import numpy as np
import scipy
from scipy import stats

from kiln.deploy.sequential import SequentialTest, fixed_horizon_n
from kiln.core.stats import Verdict
from kiln.core.files import atomic_write_json

OUT = Path(__file__).parent / "results" / "sequential_sim.json"


def lognormal_arms(rng: np.random.Generator, args: argparse.Namespace, looks: int, batch: int,
                   regression: float) -> tuple[np.ndarray, np.ndarray]:
    """TTFTs in ms, shape (runs, looks, batch): median 200 ms, log-sd --sigma."""
    shape = (args.runs, looks, batch)
    stable = 200.0 * np.exp(rng.normal(0.0, args.sigma, shape))
    canary = 200.0 * (1 + regression) * np.exp(rng.normal(0.0, args.sigma, shape))
    return stable, canary


def naive_z(stable: np.ndarray, canary: np.ndarray, margin: float) -> np.ndarray:
    """One-sided Welch z statistic on log values using all data up to each look: (runs, looks)."""
    def cumulative(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        logs = np.log(x)
        n = np.arange(1, x.shape[1] + 1) * x.shape[2]
        total, squares = logs.sum(axis=2).cumsum(axis=1), (logs**2).sum(axis=2).cumsum(axis=1)
        mean = total / n
        return n, mean, (squares - n * mean**2) / (n - 1)

    n_s, m_s, v_s = cumulative(stable)
    n_c, m_c, v_c = cumulative(canary)
    return (m_c - m_s - math.log1p(margin)) / np.sqrt(v_s / n_s + v_c / n_c)


def sequential_runs(stable: np.ndarray, canary: np.ndarray, args: argparse.Namespace) -> list[tuple[Verdict, int]]:
    """Run the real SequentialTest over every simulated run; stop at the first verdict."""
    out = []
    for s_run, c_run in zip(stable, canary, strict=True):
        test = SequentialTest(alpha=args.alpha, margin=args.margin, relative=True, effect_scale=args.effect_scale)
        decision = None
        for s, c in zip(s_run, c_run, strict=True):
            test.update(s, c)
            decision = test.decide()
            if decision.verdict != Verdict.INCONCLUSIVE:
                break
        out.append((decision.verdict, decision.n_canary))
    return out


def no_difference(rng: np.random.Generator, args: argparse.Namespace) -> dict:
    stable, canary = lognormal_arms(rng, args, args.looks, args.batch, 0.0)
    runs = sequential_runs(stable, canary, args)
    z = naive_z(stable, canary, args.margin) > stats.norm.ppf(1 - args.alpha)
    return {
        "runs": args.runs, "looks": args.looks, "requests_per_arm_per_look": args.batch,
        "sequential_false_rollback": float(np.mean([v == Verdict.FAILED for v, _ in runs])),
        "sequential_false_success": float(np.mean([v == Verdict.SUCCESSFUL for v, _ in runs])),
        "naive_peeking_false_rollback": float(z.any(axis=1).mean()),
        "naive_single_look_false_rollback": float(z[:, -1].mean()),
        "monte_carlo_se": math.sqrt(args.alpha * (1 - args.alpha) / args.runs),
    }


def regression(rng: np.random.Generator, args: argparse.Namespace) -> dict:
    effect = math.log1p(args.regression) - math.log1p(args.margin)
    n_fixed = fixed_horizon_n(effect, args.sigma, args.alpha, args.power)
    looks = math.ceil(args.max_per_arm / args.detect_batch)
    stable, canary = lognormal_arms(rng, args, looks, args.detect_batch, args.regression)
    runs = sequential_runs(stable, canary, args)
    needed = np.array([n for v, n in runs if v == Verdict.FAILED])
    # Check the formula: the fixed test's power at exactly n_fixed per arm, on the same kind of data.
    z = naive_z(*lognormal_arms(rng, args, 1, n_fixed, args.regression), args.margin)[:, -1]
    return {
        "regression": args.regression, "requests_per_arm_per_look": args.detect_batch,
        "max_requests_per_arm": looks * args.detect_batch,
        "sequential_detection_rate": float(len(needed) / args.runs),
        "sequential_requests_per_arm_mean": float(needed.mean()) if needed.size else None,
        "sequential_requests_per_arm_median": float(np.median(needed)) if needed.size else None,
        # Requests per arm by which a share `power` of all runs had rolled back: equal-power yardstick.
        "sequential_requests_per_arm_at_power": float(np.sort(needed)[math.ceil(args.power * args.runs) - 1])
        if len(needed) >= math.ceil(args.power * args.runs) else None,
        "fixed_horizon_requests_per_arm": n_fixed,
        "fixed_horizon_power_simulated": float(np.mean(z > stats.norm.ppf(1 - args.alpha))),
    }


def _num(value: float | None, digits: int) -> str:
    return "none" if value is None else f"{value:.{digits}f}"


def table(null: dict, reg: dict, args: argparse.Namespace) -> str:
    alpha, power = args.alpha, args.power
    rows = [
        ("false rollback, sequential (every look)", f"{null['sequential_false_rollback']:.4f}", f"<= {alpha}"),
        ("false rollback, naive z at every look", f"{null['naive_peeking_false_rollback']:.4f}", f"{alpha} intended"),
        ("false rollback, naive z once at the end", f"{null['naive_single_look_false_rollback']:.4f}", f"{alpha}"),
        (f"{args.regression:.0%} regression rolled back, sequential", f"{reg['sequential_detection_rate']:.3f}",
         f"within {reg['max_requests_per_arm']} requests/arm"),
        ("requests/arm to roll back, sequential mean", _num(reg["sequential_requests_per_arm_mean"], 1), ""),
        ("requests/arm to roll back, sequential median", _num(reg["sequential_requests_per_arm_median"], 0), ""),
        (f"requests/arm by which {power:.0%} of runs rolled back",
         _num(reg["sequential_requests_per_arm_at_power"], 0), ""),
        (f"requests/arm, fixed horizon (alpha {alpha}, power {power})", f"{reg['fixed_horizon_requests_per_arm']}",
         f"simulated power {reg['fixed_horizon_power_simulated']:.3f}"),
    ]
    width = max(len(r[0]) for r in rows)
    return "\n".join(f"{a:<{width}}  {b:>10}  {c}" for a, b, c in rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=2000, help="simulated canaries per scenario")
    p.add_argument("--looks", type=int, default=50, help="looks per run with no difference")
    p.add_argument("--batch", type=int, default=20, help="requests per arm per look, no-difference runs")
    p.add_argument("--detect-batch", type=int, default=10, help="requests per arm per look, regression runs")
    p.add_argument("--max-per-arm", type=int, default=2000, help="give up after this many requests per arm")
    p.add_argument("--regression", type=float, default=0.20, help="true TTFT regression (0.2 = 20%% slower)")
    p.add_argument("--sigma", type=float, default=0.5, help="log-sd of TTFT (0.5: p99/p50 about 3.2)")
    p.add_argument("--alpha", type=float, default=0.05)
    p.add_argument("--power", type=float, default=0.8, help="power the fixed-horizon test is sized for")
    p.add_argument("--margin", type=float, default=0.0, help="tolerated relative regression")
    p.add_argument("--effect-scale", type=float, default=0.2, help="effect the sequential test is tuned to")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args()
    if args.regression <= args.margin:
        p.error("--regression must be larger than --margin (otherwise there is nothing to detect)")
    rng = np.random.default_rng(args.seed)
    start = time.perf_counter()
    null, reg = no_difference(rng, args), regression(rng, args)
    result = {"settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "no_difference": null, "regression": reg, "seconds": round(time.perf_counter() - start, 1),
              "versions": {"python": platform.python_version(), "numpy": np.__version__, "scipy": scipy.__version__}}
    atomic_write_json(args.out, result)
    print(table(null, reg, args))
    print(f"\n{result['seconds']} s; wrote {args.out}")


if __name__ == "__main__":
    main()
