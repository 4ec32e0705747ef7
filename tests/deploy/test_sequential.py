"""kiln.deploy.sequential: error rates under peeking, by simulation on lognormal TTFTs."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from scipy import stats

from kiln.deploy.sequential import SequentialTest, fixed_horizon_n
from kiln.core.stats import Verdict
from kiln.core.errors import BadInput

ALPHA = 0.05
SIGMA = 0.5  # log-sd of TTFT: p99/p50 about 3.2, typical of a loaded server


def ttft(rng, shape, slower=0.0, level=200.0):
    return level * (1 + slower) * np.exp(rng.normal(0.0, SIGMA, shape))


def first_verdicts(stable, canary, **settings):
    """Read the test after every look of every run, as a controller would; stop at a verdict."""
    out = []
    for s_run, c_run in zip(stable, canary, strict=True):
        test, verdict = SequentialTest(alpha=ALPHA, **settings), None
        for s, c in zip(s_run, c_run, strict=True):
            test.update(s, c)
            verdict = test.decide()
            if verdict.verdict != Verdict.INCONCLUSIVE:
                break
        out.append(verdict)
    return out


def naive_z(stable, canary):
    """Fixed-sample one-sided Welch z on log TTFT with all data up to each look: (runs, looks)."""
    def cum(x):
        logs = np.log(x)
        n = np.arange(1, x.shape[1] + 1) * x.shape[2]
        mean = logs.sum(2).cumsum(1) / n
        return n, mean, ((logs**2).sum(2).cumsum(1) - n * mean**2) / (n - 1)

    (n_s, m_s, v_s), (n_c, m_c, v_c) = cum(stable), cum(canary)
    return (m_c - m_s) / np.sqrt(v_s / n_s + v_c / n_c)


@pytest.fixture(scope="module")
def no_difference():
    rng = np.random.default_rng(2024)
    shape = (400, 50, 20)  # 400 canaries, read after each of 50 windows of 20 requests per arm
    return ttft(rng, shape), ttft(rng, shape)


def test_peeking_at_every_look_keeps_false_rollbacks_within_alpha(no_difference):
    verdicts = first_verdicts(*no_difference, relative=True, margin=0.0, effect_scale=0.2)
    failed = np.mean([v.verdict == Verdict.FAILED for v in verdicts])
    wrongly_passed = np.mean([v.verdict == Verdict.SUCCESSFUL for v in verdicts])  # margin 0: also wrong
    assert failed + wrongly_passed <= ALPHA + 0.02  # Monte Carlo se ~0.011 at 0.05


def test_naive_z_peeked_at_every_look_exceeds_alpha(no_difference):
    z = naive_z(*no_difference) > stats.norm.ppf(1 - ALPHA)
    assert 0.02 <= z[:, -1].mean() <= 0.09  # read once it is the test it claims to be...
    assert z.any(axis=1).mean() > 3 * ALPHA  # ...read 50 times it rolls back healthy canaries


def test_a_20_percent_ttft_regression_is_rolled_back():
    rng = np.random.default_rng(7)
    shape = (100, 50, 20)
    verdicts = first_verdicts(ttft(rng, shape), ttft(rng, shape, slower=0.2), relative=True, margin=0.05)
    failed = [v for v in verdicts if v.verdict == Verdict.FAILED]
    assert len(failed) >= 90
    assert all(0.05 < v.cs_low and v.cs_low <= v.estimate <= v.cs_high for v in failed)


def test_identical_streams_pass_and_never_fail():
    rng = np.random.default_rng(1)
    for _ in range(20):
        test = SequentialTest(margin=0.05, relative=True)
        for _ in range(40):
            values = ttft(rng, 50)
            test.update(values, values)
            assert test.decide().verdict != Verdict.FAILED
        assert test.decide().verdict == Verdict.SUCCESSFUL


def test_contrasts_within_each_look_survive_drift_and_changing_weight():
    # Load doubles halfway while the canary's share goes from 10% to 50%: pooled arm means
    # would blame the canary for the load; contrasts taken within each window do not.
    rng = np.random.default_rng(3)
    failed, pooled_gap = 0, []
    for _ in range(150):
        test, all_s, all_c = SequentialTest(relative=True, effect_scale=0.2), [], []
        for look in range(30):
            n_canary, level = (10, 200.0) if look < 15 else (50, 400.0)
            s, c = ttft(rng, 100 - n_canary, level=level), ttft(rng, n_canary, level=level)
            test.update(s, c)
            all_s.append(s)
            all_c.append(c)
            if test.decide().verdict == Verdict.FAILED:
                failed += 1
                break
        pooled_gap.append(np.log(np.concatenate(all_c)).mean() - np.log(np.concatenate(all_s)).mean())
    assert failed / 150 <= ALPHA + 0.02
    assert np.mean(pooled_gap) > 0.2  # what a pooled comparison would have seen


def test_binary_errors_do_not_trip_on_zero_counts():
    rng = np.random.default_rng(5)
    null = [SequentialTest(binary=True, effect_scale=0.02) for _ in range(200)]
    rollbacks = 0
    for test in null:
        for _ in range(30):
            test.update(rng.random(100) < 0.01, rng.random(100) < 0.01)
            if test.decide().verdict == Verdict.FAILED:
                rollbacks += 1
                break
    assert rollbacks / 200 <= ALPHA + 0.02
    test = SequentialTest(binary=True, effect_scale=0.02)
    test.update(np.zeros(30), np.zeros(30))  # no errors in either arm proves little yet
    assert test.decide().verdict == Verdict.INCONCLUSIVE
    worse = SequentialTest(binary=True, effect_scale=0.02)
    for _ in range(40):
        worse.update(rng.random(100) < 0.01, rng.random(100) < 0.05)
    assert worse.decide().verdict == Verdict.FAILED


def test_direction_and_units():
    rng = np.random.default_rng(9)
    throughput = SequentialTest(margin=0.05, relative=True, higher_is_better=True)
    for _ in range(30):
        throughput.update(ttft(rng, 50), ttft(rng, 50, slower=-0.2))  # 20% fewer tokens/s
    decision = throughput.decide()
    assert decision.verdict == Verdict.FAILED and decision.estimate == pytest.approx(-0.2, abs=0.05)
    faster = SequentialTest(margin=5.0)  # absolute: at most 5 ms worse
    for _ in range(30):
        faster.update(ttft(rng, 50), ttft(rng, 50) - 20.0)
    decision = faster.decide()
    assert decision.verdict == Verdict.SUCCESSFUL and decision.estimate == pytest.approx(-20, abs=8)
    json.dumps(decision.to_dict(), allow_nan=False)


def test_one_sided_windows_wait_for_the_other_arm():
    test = SequentialTest(margin=0.1, relative=True, min_per_arm=2)
    test.update([100.0, 110.0], [])
    assert (test.decide().n_stable, test.decide().verdict) == (0, Verdict.INCONCLUSIVE)
    test.update([], [105.0, 120.0])
    assert (test.decide().n_stable, test.decide().n_canary) == (2, 2)


def test_fixed_horizon_n_has_the_power_it_claims():
    effect = math.log(1.2)
    n = fixed_horizon_n(effect, SIGMA, ALPHA, 0.8)
    assert n == 93
    rng = np.random.default_rng(0)
    diff = rng.normal(effect, SIGMA, (4000, n)).mean(1) - rng.normal(0, SIGMA, (4000, n)).mean(1)
    assert np.mean(diff / (SIGMA * math.sqrt(2 / n)) > stats.norm.ppf(1 - ALPHA)) == pytest.approx(0.8, abs=0.03)


def test_bad_settings_and_values_are_named():
    with pytest.raises(BadInput) as info:
        SequentialTest(alpha=1.5, margin=0.0)
    assert "alpha" in str(info.value) and "effect_scale" in str(info.value)
    with pytest.raises(BadInput, match="relative and binary"):
        SequentialTest(margin=0.1, relative=True, binary=True)
    with pytest.raises(BadInput, match="canary_values"):
        SequentialTest(margin=0.1, relative=True).update([1.0], [0.0])
    with pytest.raises(BadInput, match="stable_values"):
        SequentialTest(margin=0.1).update([math.nan], [1.0])
