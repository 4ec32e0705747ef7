"""`kiln compare`'s gate: two runs' candidates were never measured as pairs, so a ratio speed check
between them is not judged, and a model compared with itself across two runs is never Failed."""

import numpy as np

from kiln.core.errors import ExitCode
from kiln.core.gate.base import Evidence, Verdict
from kiln.core.gate.policy import judge
from kiln.evaluate.perf.compare import across_runs
from kiln.pipeline.recipe.schema import GateSection


def _run(base_tok_s: float, cand_tok_s: float, pressure: float, seed: int) -> dict[str, Evidence]:
    """One run's decode benchmark: 24 pairs under steady load `pressure`."""
    rng = np.random.default_rng(seed)
    run = {role: Evidence(role) for role in ("baseline", "candidate")}
    for role, speed in (("baseline", base_tok_s), ("candidate", cand_tok_s)):
        ev = run[role]
        ev.repeats["decode_tok_s"] = list(speed * np.exp(rng.normal(0, 0.1, 24)))
        ev.repeats["bench_cpu_pressure"] = [pressure] * 24
        ev.metrics.update(decode_tok_s=speed, bench_cpu_pressure=pressure, bench_cpu_steal=0.0)
    return run


POLICY = GateSection.model_validate({"confidence": 0.95, "checks": [
    {"kind": "performance", "metric": "decode_tok_s", "min_ratio": 1.0},
    {"kind": "performance", "metric": "decode_tok_s", "min": 10}]})


def test_the_same_file_measured_in_a_quiet_and_a_busy_run_is_not_failed_against_itself():
    quiet, busy = _run(17, 45, 0.02, seed=1), _run(7.5, 20, 0.2, seed=2)  # other jobs slowed both arms of run B
    # What compare did: sample i of one run paired with sample i of the other, 20 / 45 = 0.44x.
    assert judge(POLICY, busy["candidate"], quiet["candidate"]).results[0].verdict is Verdict.FAILED
    outcome = across_runs(POLICY, busy, quiet, same_baseline=True)
    speed, slo = outcome.results
    assert speed.verdict is Verdict.INCONCLUSIVE and speed.insufficient, speed.reason
    assert "measured in different runs" in speed.reason and "measure them in one run" in speed.reason
    assert 0.85 < speed.observed < 1.2 and speed.ci[0] < 1 < speed.ci[1]  # B over A through the baseline: itself
    assert slo.verdict is Verdict.SUCCESSFUL  # an SLO reads run B's candidate alone: judged as in its run
    assert outcome.verdict is Verdict.INCONCLUSIVE and outcome.exit_code is ExitCode.GATE_INCONCLUSIVE


def test_without_a_shared_baseline_no_figure_is_offered():
    quiet, busy = _run(17, 45, 0.02, seed=1), _run(7.5, 20, 0.2, seed=2)
    speed = across_runs(POLICY, busy, quiet, same_baseline=False).results[0]
    assert speed.verdict is Verdict.INCONCLUSIVE and speed.observed is None and "not judged" in speed.reason
