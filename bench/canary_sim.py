"""Whole canary walks on a simulated target: how often the controller does the right thing, how fast.

The controller (kiln.deploy.canary) walks the default steps (5, 25, 50, 100 %, 50 canary requests
each, at most 300 s) on kiln.deploy.simulated.SimulatedTarget: lognormal TTFT/TPOT (log-sd
--sigma), 50 requests/s, a look every 2 s, virtual time. Gate policy: ttft_ms and tpot_ms
max_ratio 1.15, error_rate max 0.02, confidence 0.95. Scenarios:

- healthy: canary identical to stable. Any rollback is a false rollback.
- at-bound: canary exactly 15% slower (on the bound; not a regression by the policy's letter):
  "Failed" should stay rare (the sequential guarantee is per check, at most alpha); such a canary
  cannot be shown within the bound either, so it ends undecided at the step limit (rolled back
  under the default on_inconclusive: rollback).
- regressed: canary 30% slower: should be rolled back, early.
- errors: canary fails 10% of requests: should be rolled back.

Agreement scenarios (mirror_fraction 0.1: every tenth request is answered by stable twice and by
the canary once; served_prefix per mirrored prompt, see SimulatedTarget), policy as above plus an
agreement check on served_prefix:
- agree-identical: stable agrees with itself 0.8 on average (two replicas that batch differently)
  and the canary 0.8 with stable; min 0.9, a drop of at most 0.1 below the noise floor. Any
  rollback is a false one: at most alpha for the agreement check.
- agree-at-bound: the canary agrees 0.7, exactly 0.1 below the floor (on the bound): Failed at
  most alpha of the time (the test's error rate; it cannot be shown within the bound either).
- agree-minus-0.2: the canary agrees 0.6 with stable, 0.2 below stable's own 0.8: caught, and how
  many mirrored prompts that took.
- deterministic-broken: one deterministic stable (floor 1.0) and a canary that agrees 0.031 (the
  engine that corrupts batched tokens, offline), under the demo recipe's min 0.3.

Per scenario: share promoted / rolled back / held, the step where rollbacks happened, the median
virtual seconds and canary requests to the decision, and (agreement scenarios) the mirrored
prompts to the decision: median and 95th percentile, and the extra requests mirroring cost. Writes bench/results/canary_sim.json and
prints a table.

    python bench/canary_sim.py              # 200 walks per scenario
    python bench/canary_sim.py --runs 50    # quicker
"""

from __future__ import annotations

import argparse
import platform
import time
from collections import Counter
from pathlib import Path

import numpy as np

from kiln.deploy.canary import Controller
from kiln.deploy.config import DeployConfig
from kiln.deploy.simulated import ArmModel, SimulatedTarget
from kiln.core.files import atomic_write_json
from kiln.core.gate.policy import GateSection

OUT = Path(__file__).parent / "results" / "canary_sim.json"
POLICY = GateSection.model_validate({"checks": [
    {"kind": "performance", "metric": "ttft_ms", "max_ratio": 1.15},
    {"kind": "performance", "metric": "tpot_ms", "max_ratio": 1.15},
    {"kind": "error_rate", "max": 0.02},
]})


MIRROR_FRACTION = 0.1


def agreement_policy(minimum: float) -> GateSection:
    return GateSection.model_validate({"checks": [*POLICY.model_dump()["checks"],
                                                  {"kind": "agreement", "metric": "served_prefix", "min": minimum}]})


def scenarios(sigma: float) -> dict[str, tuple[ArmModel, ArmModel, GateSection]]:
    """name -> (stable, canary, policy). A stable model's served_prefix is its noise floor."""
    stable, noisy = ArmModel(sigma=sigma), ArmModel(sigma=sigma, served_prefix=0.8)
    return {"healthy": (stable, ArmModel(sigma=sigma), POLICY),
            "at-bound": (stable, ArmModel(ttft_ms=57.5, tpot_ms=23, sigma=sigma), POLICY),
            "regressed": (stable, ArmModel(ttft_ms=65, tpot_ms=26, sigma=sigma), POLICY),
            "errors": (stable, ArmModel(sigma=sigma, error_rate=0.10), POLICY),
            "agree-identical": (noisy, ArmModel(sigma=sigma, served_prefix=0.8), agreement_policy(0.9)),
            "agree-at-bound": (noisy, ArmModel(sigma=sigma, served_prefix=0.7), agreement_policy(0.9)),
            "agree-minus-0.2": (noisy, ArmModel(sigma=sigma, served_prefix=0.6), agreement_policy(0.9)),
            "deterministic-broken": (stable, ArmModel(sigma=sigma, served_prefix=0.031), agreement_policy(0.3))}


def walk(stable: ArmModel, canary: ArmModel, policy: GateSection, seed: int) -> dict:
    mirroring = len(policy.checks) > len(POLICY.checks)
    target = SimulatedTarget(stable, canary, rate=50, seed=seed, mirror_fraction=MIRROR_FRACTION if mirroring else 0.0)
    deploy = DeployConfig.model_validate({"router": {"mirror_fraction": MIRROR_FRACTION if mirroring else 0.0}})
    result = Controller(target, policy, deploy, log=lambda _: None, sleep=target.sleep, clock=target.clock).run()
    return {"status": result.status, "verdict": result.steps[-1].verdict, "steps": len(result.steps), "seconds": target.now,
            "canary_requests": sum(s.canary["requests"] for s in result.steps),
            "requests": target.seq, "mirrored": target.mirrored,
            "failed_checks": [c["name"] for c in result.steps[-1].checks if c["verdict"] == "Failed"]}


def summarize(walks: list[dict]) -> dict:
    status = Counter(w["status"] for w in walks)
    rolled = [w for w in walks if w["status"] == "rolled_back"]
    return {"runs": len(walks), **{k: status[k] / len(walks) for k in ("promoted", "rolled_back", "held")},
            "rolled_back_failed": sum(w["verdict"] == "Failed" for w in rolled) / len(walks),
            "rolled_back_inconclusive": sum(w["verdict"] == "Inconclusive" for w in rolled) / len(walks),
            "rollback_step": dict(Counter(w["steps"] for w in rolled)),
            "median_seconds": float(np.median([w["seconds"] for w in walks])),
            "median_canary_requests": float(np.median([w["canary_requests"] for w in walks])),
            "failed_checks": dict(Counter(c for w in rolled for c in w["failed_checks"])),
            **mirrored(walks, rolled)}


def mirrored(walks: list[dict], rolled: list[dict]) -> dict:
    """Mirrored prompts to the decision (all walks, and those rolled back), and what they cost:
    2 extra requests per mirrored prompt (one is the client's own answer)."""
    if not any(w["mirrored"] for w in walks):
        return {}
    out = {"median_mirrored": float(np.median([w["mirrored"] for w in walks])),
           "extra_requests_share": float(sum(2 * w["mirrored"] for w in walks) / sum(w["requests"] for w in walks))}
    if rolled:
        out["rolled_back_mirrored_median"] = float(np.median([w["mirrored"] for w in rolled]))
        out["rolled_back_mirrored_p95"] = float(np.percentile([w["mirrored"] for w in rolled], 95))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=200)
    p.add_argument("--sigma", type=float, default=0.3, help="log-sd of per-request latency")
    args = p.parse_args()
    started = time.time()
    results = {name: summarize([walk(stable, canary, policy, seed) for seed in range(args.runs)])
               for name, (stable, canary, policy) in scenarios(args.sigma).items()}
    report = {"args": vars(args), "python": platform.python_version(), "seconds": time.time() - started,
              "policy": POLICY.model_dump(mode="json"), "mirror_fraction": MIRROR_FRACTION, "scenarios": results}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(OUT, report)
    print(f"{'scenario':<21} {'promoted':>9} {'rolled back (Failed / undecided)':>34} {'held':>6} {'at step':>16} "
          f"{'median s':>9} {'median canary req':>18} {'mirrored to rollback (median / p95)':>36}")
    for name, r in results.items():
        steps = ",".join(f"{k}:{v}" for k, v in sorted(r["rollback_step"].items())) or "-"
        split = f"{r['rolled_back']:.1%} ({r['rolled_back_failed']:.1%} / {r['rolled_back_inconclusive']:.1%})"
        mirrors = (f"{r['rolled_back_mirrored_median']:.0f} / {r['rolled_back_mirrored_p95']:.0f}"
                   if "rolled_back_mirrored_median" in r else "-")
        print(f"{name:<21} {r['promoted']:>9.1%} {split:>34} {r['held']:>6.1%} {steps:>16} "
              f"{r['median_seconds']:>9.0f} {r['median_canary_requests']:>18.0f} {mirrors:>36}")
    print(f"({args.runs} walks per scenario, {report['seconds']:.0f} s; {OUT})")


if __name__ == "__main__":
    main()
