"""The gate policy judged on live data: which checks map, and the verdicts on known arms."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from kiln.deploy.base import ArmData, Observations
from kiln.deploy.live_gate import LiveGate
from kiln.deploy.observations import Comparison
from kiln.deploy.simulated import ArmModel
from kiln.core.stats import Verdict
from kiln.core.errors import BadInput
from kiln.core.gate.policy import GateSection


def policy(*checks: dict) -> GateSection:
    return GateSection.model_validate({"checks": list(checks)})


def feed(gate: LiveGate, stable: ArmModel, canary: ArmModel, looks: int = 10, per_look: int = 40, seed: int = 0,
         mirrored: int = 0) -> None:
    """`mirrored` prompts per look, scored by canary.served_prefix (the floor by stable's)."""
    rng = np.random.default_rng(seed)
    for _ in range(looks):
        obs = Observations(stable.draw(per_look, rng), canary.draw(per_look, rng))
        obs.mirrored = [Comparison(0, 0.0, "stable", float(p), float(p == 1), float(f), float(f == 1))
                        for p, f in zip(canary.agree(mirrored, rng), stable.agree(mirrored, rng), strict=True)]
        gate.update(obs)


def verdicts(gate: LiveGate) -> dict[str, Verdict]:
    return {r.name: r.verdict for r in gate.judge().results}


TTFT = {"kind": "performance", "metric": "ttft_ms", "max_ratio": 1.1}


def test_same_speed_passes_and_30_percent_slower_fails():
    same = LiveGate(policy(TTFT))
    feed(same, ArmModel(), ArmModel())
    assert verdicts(same) == {"performance:ttft_ms": Verdict.SUCCESSFUL}
    slow = LiveGate(policy(TTFT))
    feed(slow, ArmModel(), ArmModel(ttft_ms=65))
    outcome = slow.judge()
    assert outcome.verdict == Verdict.FAILED
    r = outcome.results[0]
    assert 1.2 < r.observed < 1.4 and r.ci[0] > 1.1  # reported on the check's own scale: a ratio
    assert "threshold ratio ≤ 1.1" in r.reason


def test_too_little_data_is_inconclusive_not_a_pass():
    gate = LiveGate(policy(TTFT), min_per_arm=20)
    feed(gate, ArmModel(), ArmModel(), looks=1, per_look=10)
    assert gate.judge().verdict == Verdict.INCONCLUSIVE


def test_min_ratio_on_throughput_reads_the_bound_direction():
    check = {"kind": "performance", "metric": "decode_tok_s", "min_ratio": 0.9}
    fast, slow = LiveGate(policy(check)), LiveGate(policy(check))
    feed(fast, ArmModel(), ArmModel(tpot_ms=15))  # faster decode: tokens/s ratio ~1.33 >= 0.9
    feed(slow, ArmModel(), ArmModel(tpot_ms=30))  # ratio ~0.67 < 0.9
    assert verdicts(fast)["performance:decode_tok_s"] == Verdict.SUCCESSFUL
    assert verdicts(slow)["performance:decode_tok_s"] == Verdict.FAILED


def test_absolute_slo():
    check = {"kind": "performance", "metric": "tpot_ms", "max": 25}
    ok, bad = LiveGate(policy(check)), LiveGate(policy(check))
    feed(ok, ArmModel(), ArmModel(tpot_ms=18))
    feed(bad, ArmModel(), ArmModel(tpot_ms=35))
    assert verdicts(ok)["performance:tpot_ms"] == Verdict.SUCCESSFUL
    assert verdicts(bad)["performance:tpot_ms"] == Verdict.FAILED


def test_error_rate_bound():
    check = {"kind": "error_rate", "max": 0.05}
    clean, broken = LiveGate(policy(check)), LiveGate(policy(check))
    feed(clean, ArmModel(), ArmModel())
    feed(broken, ArmModel(), ArmModel(error_rate=0.3))
    assert verdicts(clean)["error_rate:error_rate"] == Verdict.SUCCESSFUL
    assert verdicts(broken)["error_rate:error_rate"] == Verdict.FAILED


def test_checks_without_a_live_signal_are_listed_as_skipped():
    gate = LiveGate(policy(TTFT, {"kind": "quality", "metric": "perplexity", "margin": 0.05, "relative": True},
                           {"kind": "size", "max_ratio": 0.5},
                           {"kind": "agreement", "metric": "greedy_match", "min": 0.9}))
    assert [c.config.label for c in gate.checks] == ["performance:ttft_ms"]
    reasons = {s["check"]: s["reason"] for s in gate.skipped}
    assert "offline" in reasons["quality:perplexity"]
    assert "mirror_fraction" in reasons["agreement:greedy_match"]


def test_agreement_from_mirrored_requests():
    check = {"kind": "agreement", "metric": "greedy_match", "min": 0.9}
    same, drifted = LiveGate(policy(check), mirroring=True), LiveGate(policy(check), mirroring=True)
    feed(same, ArmModel(), ArmModel(), mirrored=40)
    feed(drifted, ArmModel(), ArmModel(served_prefix=0.75), mirrored=40)  # half the answers identical
    assert verdicts(same)["agreement:greedy_match"] == Verdict.SUCCESSFUL
    assert verdicts(drifted)["agreement:greedy_match"] == Verdict.FAILED


def test_the_recipes_served_prefix_check_is_judged_live_with_its_own_threshold():
    """The demo recipe's offline check (served_prefix >= 0.3) judges mirrored prompts: a correct int8
    build (offline 0.77-0.88) passes, the engine that corrupts batched tokens (0.031) fails."""
    from kiln.pipeline.recipe.schema import load_recipe

    gate = load_recipe(Path(__file__).parents[2] / "recipes" / "demo.yaml").gate
    served = [c for c in gate.checks if c.metric == "served_prefix"]
    assert [(c.kind, c.min) for c in served] == [("agreement", 0.3)]
    results = {}
    for name, agreement in (("identical", 1.0), ("int8", 0.8), ("broken", 0.031)):
        live = LiveGate(GateSection(checks=served), mirroring=True)
        feed(live, ArmModel(), ArmModel(served_prefix=agreement), looks=5, mirrored=10)
        results[name] = live.judge().results[0]
    assert {k: r.verdict for k, r in results.items()} == {
        "identical": Verdict.SUCCESSFUL, "int8": Verdict.SUCCESSFUL, "broken": Verdict.FAILED}
    assert results["broken"].threshold.startswith("≥ 0.3") and results["broken"].observed < 0.1
    assert abs(results["int8"].observed - 0.8) < 0.1
    # one deterministic stable: the floor is 1.0, so the statistic is exactly the offline one
    assert "noise floor (stable vs stable) 1 over 50 mirrored prompts" in results["int8"].reason
    assert "deterministic" in results["int8"].reason


def test_the_noise_floor_keeps_a_nondeterministic_but_correct_canary():
    """Stable agrees with itself 0.8 on average (two replicas that batch differently). A canary
    as good as stable (0.8 against stable) passes a served_prefix >= 0.9 check, which the
    floor-blind statistic (0.8 < 0.9) would fail; one 0.2 below stable's floor (0.6) fails."""
    check = {"kind": "agreement", "metric": "served_prefix", "min": 0.9}
    noisy = ArmModel(served_prefix=0.8)
    verdict = {}
    for name, canary in (("as good as stable", 0.8), ("0.2 below", 0.6)):
        gate = LiveGate(policy(check), mirroring=True)
        feed(gate, noisy, ArmModel(served_prefix=canary), looks=10, mirrored=40)
        verdict[name] = gate.judge().results[0]
    assert verdict["as good as stable"].verdict == Verdict.SUCCESSFUL, verdict["as good as stable"].reason
    assert verdict["0.2 below"].verdict == Verdict.FAILED
    assert abs(verdict["0.2 below"].observed - 0.8) < 0.05  # 1 - drop, on the check's own scale
    floor = re.search(r"noise floor \(stable vs stable\) ([0-9.]+) over 400", verdict["0.2 below"].reason)
    assert floor and abs(float(floor.group(1)) - 0.8) < 0.05, verdict["0.2 below"].reason


def test_a_policy_with_nothing_live_is_bad_input():
    with pytest.raises(BadInput, match="none of the checks can be judged on live traffic"):
        LiveGate(policy({"kind": "size", "max_ratio": 0.5}))


def test_failures_count_but_client_errors_do_not():
    arm = ArmData()
    for status, error in ((200, None), (500, "boom"), (502, "refused"), (429, "busy"), (400, "bad"), (499, "left")):
        arm.add({"status": status, "error": error, "ttft_s": 0.05 if error is None else None, "tpot_s": None})
    assert arm.errors == [0, 1, 1, 1, 0] and arm.ttft_ms == [50.0]


def test_a_check_short_of_its_observations_says_it_measured_too_little():
    """Below min_per_arm a live check has no verdict to give: `insufficient`, which the canary never
    advances on, whatever the gate's on_inconclusive says. Past it, an undecided check is not."""
    gate = LiveGate(policy(TTFT, {"kind": "error_rate", "max": 0.05}), min_per_arm=20)
    feed(gate, ArmModel(), ArmModel(), looks=1, per_look=10)
    results = gate.judge().results
    assert all(r.insufficient and "too little data" in r.reason for r in results), [r.reason for r in results]
    feed(gate, ArmModel(), ArmModel(), looks=2, per_look=40, seed=1)
    assert not any(r.insufficient for r in gate.judge().results)
