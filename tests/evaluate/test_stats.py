"""kiln.core.stats against reference implementations and by simulation."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from scipy import optimize, stats
from statsmodels.stats.contingency_tables import mcnemar

from kiln.core.stats import (
    Comparison,
    Verdict,
    mcnemar_exact,
    non_inferiority,
    paired_bootstrap,
    paired_log_ratio,
    tango_interval,
    unpaired_test,
)
from kiln.core.errors import BadInput


def paired_binary(rng, n, p_base, p_lost, p_won):
    """Baseline outcomes plus flips: a correct item is lost with p_lost, a wrong one won with p_won."""
    base = rng.random(n) < p_base
    u = rng.random(n)
    cand = np.where(base, u >= p_lost, u < p_won)
    return base, cand


# --- McNemar -------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(60))
def test_mcnemar_p_matches_statsmodels_and_binomtest(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(5, 400))
    flips = [0.0, 0.0] if seed % 10 == 0 else rng.uniform(0, 0.15, 2)  # every 10th: no discordant
    base, cand = paired_binary(rng, n, rng.uniform(0.2, 0.9), *flips)
    table = [[np.sum(~base & ~cand), np.sum(~base & cand)], [np.sum(base & ~cand), np.sum(base & cand)]]
    got = mcnemar_exact(base, cand)
    assert got.p_value == pytest.approx(mcnemar(table, exact=True).pvalue, rel=1e-9, abs=1e-12)
    won, lost = got.extra["won"], got.extra["lost"]
    if won + lost:
        assert got.p_value == pytest.approx(stats.binomtest(won, won + lost, 0.5).pvalue, rel=1e-9)
    else:
        assert got.p_value == 1.0
    assert got.difference == pytest.approx(cand.mean() - base.mean())
    assert got.ci_low <= got.difference <= got.ci_high


def test_tango_matches_published_example():
    # Fagerland, Lydersen & Laake, airway hyper-responsiveness data (Bentur et al. 2009):
    # n12 = 1, n21 = 7, n = 21, delta = (n12 - n21) / n; their Tango interval is (-0.517, -0.026).
    # kiln's won/lost play the roles of n12/n21.
    low, high = tango_interval(won=1, lost=7, n=21)
    assert (round(low, 3), round(high, 3)) == (-0.517, -0.026)


def score_by_numeric_mle(delta, won, lost, n):
    """Tango's score statistic with the constrained MLE found numerically (independent of the
    closed form in kiln): maximise the multinomial likelihood over p_lost given delta."""
    rest = n - won - lost

    def nll(p):
        p_won = p + delta
        return -(won * math.log(p_won) + lost * math.log(p) + (rest * math.log(1 - 2 * p - delta) if rest else 0))

    lo, hi = max(0.0, -delta) + 1e-12, (1 - delta) / 2 - 1e-12
    p = optimize.minimize_scalar(nll, bounds=(lo, hi), method="bounded", options={"xatol": 1e-13}).x
    return (won - lost - n * delta) / math.sqrt(n * (2 * p + delta * (1 - delta)))


@pytest.mark.parametrize(("won", "lost", "n"), [(1, 7, 21), (12, 3, 200), (0, 4, 50), (30, 30, 500), (2, 0, 9)])
def test_tango_bounds_solve_the_score_equation(won, lost, n):
    z = stats.norm.ppf(0.975)
    low, high = tango_interval(won, lost, n)
    assert score_by_numeric_mle(low, won, lost, n) == pytest.approx(z, abs=2e-3)
    assert score_by_numeric_mle(high, won, lost, n) == pytest.approx(-z, abs=2e-3)
    # At delta = 0 the score statistic is McNemar's uncorrected chi-square.
    if won + lost:
        chi2 = mcnemar([[0, won], [lost, 0]], exact=False, correction=False).statistic
        assert score_by_numeric_mle(0.0, won, lost, n) ** 2 == pytest.approx(chi2, rel=1e-4)


def test_tango_interval_covers_the_true_difference():
    rng = np.random.default_rng(7)
    p_base, p_lost, p_won = 0.7, 0.06, 0.10
    truth = (1 - p_base) * p_won - p_base * p_lost
    cis = [mcnemar_exact(*paired_binary(rng, 150, p_base, p_lost, p_won)) for _ in range(1000)]
    hits = [c.ci_low <= truth <= c.ci_high for c in cis]
    assert 0.93 <= np.mean(hits) <= 0.975  # nominal 0.95; Monte Carlo se ~0.007


def test_no_discordant_pairs_gives_an_honest_interval():
    base = np.random.default_rng(0).random(10) < 0.6
    small, large = mcnemar_exact(base, base), mcnemar_exact(np.tile(base, 200), np.tile(base, 200))
    assert small.p_value == large.p_value == 1.0 and small.difference == 0.0
    assert small.ci_low == pytest.approx(-small.ci_high) and small.ci_high > 0.2  # 10 items prove little
    assert large.ci_high < 0.005  # z^2 / n
    assert non_inferiority(small, 0.02, higher_is_better=True).verdict == Verdict.INCONCLUSIVE
    assert non_inferiority(large, 0.01, higher_is_better=True).verdict == Verdict.SUCCESSFUL


# --- bootstrap ------------------------------------------------------------------------------


def expanded_confidence(n, confidence=0.95):
    alpha = 1 - confidence
    return 1 - 2 * stats.norm.sf(math.sqrt(n / (n - 1)) * stats.t.ppf(1 - alpha / 2, n - 1))


@pytest.mark.parametrize(("seed", "n"), [(0, 200), (1, 200), (2, 12)])
def test_bootstrap_matches_scipy_paired_percentile(seed, n):
    rng = np.random.default_rng(seed)
    base = rng.gamma(2.0, 1.0, n)
    cand = base + rng.normal(-0.1, 0.5, n)
    got = paired_bootstrap(base, cand, seed=seed)
    ref = stats.bootstrap((base, cand), lambda b, c, axis: c.mean(axis) - b.mean(axis), paired=True,
                          method="percentile", confidence_level=expanded_confidence(n),
                          n_resamples=20_000, rng=np.random.default_rng(seed + 100))
    width = got.ci_high - got.ci_low
    assert got.ci_low == pytest.approx(ref.confidence_interval.low, abs=0.04 * width)
    assert got.ci_high == pytest.approx(ref.confidence_interval.high, abs=0.04 * width)


def test_perplexity_ratio_bootstrap_matches_formula_and_scipy():
    rng = np.random.default_rng(3)
    tokens = rng.integers(20, 400, 150).astype(float)
    base_nll = tokens * rng.normal(3.5, 0.4, 150)  # per-document NLL sums
    cand_nll = base_nll + tokens * rng.normal(0.02, 0.05, 150)
    got = paired_bootstrap(base_nll, cand_nll, denom=tokens, transform=np.exp, relative=True, metric="perplexity")
    assert got.baseline == pytest.approx(math.exp(base_nll.sum() / tokens.sum()))
    assert got.difference == pytest.approx(math.exp((cand_nll.sum() - base_nll.sum()) / tokens.sum()) - 1)

    def ratio(b, c, t, axis):
        return np.exp((c.sum(axis) - b.sum(axis)) / t.sum(axis)) - 1

    ref = stats.bootstrap((base_nll, cand_nll, tokens), ratio, paired=True, method="percentile",
                          confidence_level=expanded_confidence(150), n_resamples=20_000,
                          rng=np.random.default_rng(1)).confidence_interval
    width = got.ci_high - got.ci_low
    assert got.ci_low == pytest.approx(ref.low, abs=0.04 * width)
    assert got.ci_high == pytest.approx(ref.high, abs=0.04 * width)


def test_bootstrap_interval_covers_the_truth():
    rng = np.random.default_rng(11)
    hits = []
    for seed in range(300):
        base = rng.exponential(1.0, 80)
        cand = base + rng.normal(0.05, 0.3, 80)  # true mean difference 0.05
        c = paired_bootstrap(base, cand, iterations=2000, seed=seed)
        hits.append(c.ci_low <= 0.05 <= c.ci_high)
    assert 0.91 <= np.mean(hits) <= 0.99  # nominal 0.95; Monte Carlo se ~0.013


@pytest.mark.parametrize("seed", range(25))
def test_equal_candidate_is_never_failed(seed):
    rng = np.random.default_rng(seed)
    base = rng.normal(0.6, 0.2, 500)
    same = paired_bootstrap(base, base.copy(), iterations=1000, seed=seed)
    assert (same.ci_low, same.ci_high, same.p_value) == (0.0, 0.0, 1.0)
    assert non_inferiority(same, 0.01, higher_is_better=True).verdict == Verdict.SUCCESSFUL
    assert non_inferiority(same, 0.0, higher_is_better=False).verdict == Verdict.SUCCESSFUL
    # Equal in distribution (independent noise on the same items): never Failed; large n passes.
    twin = paired_bootstrap(base, base + rng.normal(0, 0.05, 500), iterations=1000, seed=seed)
    assert non_inferiority(twin, 0.02, higher_is_better=True).verdict == Verdict.SUCCESSFUL


# --- perplexity: paired log-ratio -----------------------------------------------------------


def ppl_docs(rng, n, log_ratio, spread, tokens=None):
    tokens = np.full(n, 255.0) if tokens is None else tokens
    base_nll = tokens * rng.normal(3.5, 0.4, n)
    return base_nll, base_nll + tokens * (log_ratio + spread * rng.normal(0, 1, n)), tokens


def test_log_ratio_point_values_and_student_t_part():
    rng = np.random.default_rng(4)
    tokens = rng.integers(40, 256, 30).astype(float)
    base, cand, _ = ppl_docs(rng, 30, 0.03, 0.02, tokens)
    got = paired_log_ratio(base, cand, tokens)
    r = (cand.sum() - base.sum()) / tokens.sum()
    assert got.baseline == pytest.approx(math.exp(base.sum() / tokens.sum()))
    assert got.difference == pytest.approx(math.expm1(r)) and got.extra["log_ratio"] == pytest.approx(r)
    # Each end is at least as far out as the Student-t interval with the ratio estimator's SE.
    se = math.sqrt(np.sum((cand - base - r * tokens) ** 2) * 30 / 29) / tokens.sum()
    half = stats.t.ppf(0.975, 29) * se
    assert got.ci_low <= math.expm1(r - half) + 1e-12 and got.ci_high >= math.expm1(r + half) - 1e-12
    # Equal token counts: that SE is the ordinary one of the per-document log-ratios.
    base, cand, tokens = ppl_docs(rng, 30, 0.03, 0.02)
    ratios = (cand - base) / tokens
    assert paired_log_ratio(base, cand, tokens).extra["log_ratio_se"] == pytest.approx(ratios.std(ddof=1) / math.sqrt(30))


def test_two_documents_give_an_unbounded_interval_not_an_error():
    """Two documents (a recipe's max_documents: 2) put an end of the interval past float's range:
    `kiln run` died with OverflowError in the report. The interval says "unbounded" instead."""
    got = paired_log_ratio([675.1, 672.3], [675.4, 672.1], [63.0, 63.0])
    assert got.difference == pytest.approx(math.expm1(0.1 / 126)) and got.n == 2
    assert got.ci_low >= -1.0 and got.ci_high == math.inf


def bootstrap_t_upper(ratios, seed, iterations=20_000, one_sided=0.025):
    """An independent bootstrap-t upper end on the mean (equal token counts), resampling by index."""
    n, m, se = ratios.size, ratios.mean(), ratios.std(ddof=1) / math.sqrt(ratios.size)
    x = ratios[np.random.default_rng(seed).integers(0, n, (iterations, n))]
    t = (x.mean(1) - m) / (x.std(1, ddof=1) / math.sqrt(n))
    return m - np.quantile(t[np.isfinite(t)], one_sided) * se


def hall_upper(ratios, one_sided=0.025, allowance=2.0):
    """Hall's (1992) skew-corrected t upper end, written out on its own: the sample skewness g1 plus
    `allowance` normal-theory standard errors of g1 (equal token counts)."""
    n, m, se = ratios.size, ratios.mean(), ratios.std(ddof=1) / math.sqrt(ratios.size)
    dev = ratios - m
    facing = np.mean(dev ** 3) / np.mean(dev ** 2) ** 1.5 + allowance * math.sqrt(6 * (n - 2) / ((n + 1) * (n + 3)))
    a, c, t_q = facing / (3 * math.sqrt(n)), facing / (6 * math.sqrt(n)), stats.t.ppf(1 - one_sided, n - 1)
    return m - se * (np.cbrt(1 + 3 * a * (-t_q - c)) - 1) / a


def test_log_ratio_follows_skew_with_bootstrap_t_and_hall():
    rng = np.random.default_rng(9)
    tokens = np.full(40, 255.0)
    base = tokens * rng.normal(3.5, 0.4, 40)
    ratios = 0.01 + np.where(rng.random(40) < 0.2, 0.15, 0.0) + rng.normal(0, 0.003, 40)  # a few much worse
    got = paired_log_ratio(base, base + tokens * ratios, tokens)
    t_high = ratios.mean() + stats.t.ppf(0.975, 39) * ratios.std(ddof=1) / math.sqrt(40)
    boot_high = bootstrap_t_upper(ratios, 1)
    assert t_high < boot_high < math.log1p(got.ci_high)  # the right-skewed side reaches further than t's
    # the upper end is the widest of the three: here Hall's, its skewness 1.31 + 2 x 0.36 facing it
    assert math.log1p(got.ci_high) == pytest.approx(max(t_high, boot_high, hall_upper(ratios)), rel=1e-9)


def test_log_ratio_skew_corrected_end_covers_one_bad_document():
    # 26 documents on the +5% margin's per-token scale, one of them much worse, at the 99% of a
    # five-candidate search: Hall's (1992) skew-corrected t, written out here on its own with the
    # skewness two standard errors above the sample's (the upper end's), reaches past the margin
    # where both the t and the bootstrap-t ends stop short of it.
    rng = np.random.default_rng(8)
    n, tokens = 26, np.full(26, 255.0)
    ratios = 0.0392 + np.where(np.arange(n) == 0, 0.048, 0.0) + rng.normal(0, 0.0055, n)
    base = tokens * rng.normal(3.5, 0.4, n)
    got = paired_log_ratio(base, base + tokens * ratios, tokens, confidence=0.99)
    m, se, dev = ratios.mean(), ratios.std(ddof=1) / math.sqrt(n), ratios - ratios.mean()
    skew = np.mean(dev ** 3) / np.mean(dev ** 2) ** 1.5
    facing = skew + 2 * math.sqrt(6 * (n - 2) / ((n + 1) * (n + 3)))  # + 2 normal-theory s.e. of g1
    a, c, t_q = facing / (3 * math.sqrt(n)), facing / (6 * math.sqrt(n)), stats.t.ppf(0.995, n - 1)
    hall_high = m - se * (np.cbrt(1 + 3 * a * (-t_q - c)) - 1) / a
    assert math.log1p(got.ci_high) == pytest.approx(hall_high, rel=1e-9)
    assert got.extra["skewness"] == pytest.approx(skew)
    margin = math.log1p(0.05)
    assert m + t_q * se < margin and bootstrap_t_upper(ratios, 1, one_sided=0.005) < margin < hall_high


def test_log_ratio_identical_arms_and_bad_input():
    rng = np.random.default_rng(1)
    base, _, tokens = ppl_docs(rng, 24, 0.0, 0.0)
    same = paired_log_ratio(base, base.copy(), tokens)
    assert (same.ci_low, same.ci_high, same.p_value, same.difference) == (0.0, 0.0, 1.0, 0.0)
    with pytest.raises(BadInput, match="tokens"):
        paired_log_ratio(base, base, None)
    with pytest.raises(BadInput, match="denom"):
        paired_log_ratio(base, base, np.zeros(24))


def test_paired_sees_what_unpaired_misses():
    rng = np.random.default_rng(5)
    difficulty = rng.normal(0.5, 0.25, 400)  # items differ a lot; both models see the same items
    base = difficulty + rng.normal(0, 0.02, 400)
    cand = difficulty - 0.01 + rng.normal(0, 0.02, 400)
    assert paired_bootstrap(base, cand).p_value < 0.001
    assert unpaired_test(base, cand).p_value > 0.2
    # The same with 0/1 outcomes: 14 discordant items, 12 of them lost.
    b = np.zeros(1000, bool)
    b[:700] = True
    c = b.copy()
    c[:12], c[700:702] = False, True
    assert mcnemar_exact(b, c).p_value < 0.05 < unpaired_test(b, c).p_value


# --- non-inferiority ------------------------------------------------------------------------


def test_tiny_set_is_inconclusive_and_says_how_many_items():
    rng = np.random.default_rng(2)
    for seed in range(20):
        base = rng.uniform(0.3, 0.9, 10)
        small_drop = paired_bootstrap(base, base - 0.01 + rng.normal(0, 0.05, 10), seed=seed)
        verdict = non_inferiority(small_drop, 0.02, higher_is_better=True)
        assert verdict.verdict == Verdict.INCONCLUSIVE and verdict.items_needed > 10
        big_drop = paired_bootstrap(base, base - 0.3 + rng.normal(0, 0.05, 10), seed=seed)
        assert non_inferiority(big_drop, 0.02, higher_is_better=True).verdict == Verdict.FAILED


def make(diff, low, high, n=100):
    return Comparison("m", 0.5, 0.5 + diff, diff, low, high, 0.5, n, "test", 0.95)


def test_items_needed_follows_the_square_root_law():
    # higher is better: drop 0.01, drop CI [-0.03, 0.05]; 0.04 half-width must shrink to 0.01.
    verdict = non_inferiority(make(-0.01, -0.05, 0.03), 0.02, higher_is_better=True)
    assert verdict.verdict == Verdict.INCONCLUSIVE and verdict.items_needed == 1600
    # lower is better (e.g. perplexity ratio - 1): drop 0.03 beyond margin 0.02, heading for Failed.
    verdict = non_inferiority(make(0.03, 0.01, 0.05), 0.02, higher_is_better=False)
    assert verdict.verdict == Verdict.INCONCLUSIVE and verdict.items_needed == 400
    assert non_inferiority(make(0.02, 0.0, 0.04), 0.02, higher_is_better=False).items_needed is None


def test_items_needed_with_no_discordant_pair_scales_like_one_over_n():
    # The demo's tiny eval: 10 word-swap items, no discordant pair, margin 0.03. The 1/sqrt(n) law
    # said 856; the Tango interval of 0 discordant items shrinks like z^2 / n.
    base = np.ones(10, bool)
    base[[2, 5]] = False
    verdict = non_inferiority(mcnemar_exact(base, base.copy()), 0.03, higher_is_better=True)
    assert verdict.verdict == Verdict.INCONCLUSIVE and verdict.items_needed == 125
    decide = [non_inferiority(mcnemar_exact(np.ones(m, bool), np.ones(m, bool)), 0.03, True).verdict for m in (124, 125)]
    assert decide == [Verdict.INCONCLUSIVE, Verdict.SUCCESSFUL]


@pytest.mark.parametrize(("won", "lost", "n", "margin"), [(1, 3, 20, 0.05), (2, 2, 40, 0.03), (0, 5, 60, 0.05)])
def test_items_needed_for_mcnemar_is_where_the_scaled_counts_decide(won, lost, n, margin):
    base, cand = np.ones(n, bool), np.ones(n, bool)
    cand[:lost] = False
    base[lost:lost + won] = False
    verdict = non_inferiority(mcnemar_exact(base, cand), margin, higher_is_better=True)
    assert verdict.verdict == Verdict.INCONCLUSIVE
    m, heading_pass = verdict.items_needed, verdict.drop < margin

    def decides(items):
        low, high = sorted(-v for v in tango_interval(won * items / n, lost * items / n, items))
        return high <= margin if heading_pass else low > margin

    assert decides(m) and not decides(m - 1)


def test_verdict_edges_and_errors():
    assert non_inferiority(make(-0.02, -0.02, -0.02), 0.02, True).verdict == Verdict.SUCCESSFUL
    assert non_inferiority(make(-0.05, -0.07, -0.03), 0.02, True).verdict == Verdict.FAILED
    assert non_inferiority(make(0.05, 0.03, 0.07), 0.02, True).verdict == Verdict.SUCCESSFUL
    assert non_inferiority(make(0.05, 0.03, 0.07), 0.02, False).verdict == Verdict.FAILED
    assert non_inferiority(make(math.nan, math.nan, math.nan), 0.02, True).verdict == Verdict.ERROR
    with pytest.raises(BadInput, match="margin"):
        non_inferiority(make(0, 0, 0), -0.1, True)


def test_results_are_json_ready():
    rng = np.random.default_rng(0)
    base = rng.random(50) < 0.5
    cmp = mcnemar_exact(base, ~base)
    text = json.dumps({"cmp": cmp.to_dict(), "ni": non_inferiority(cmp, 0.01, True).to_dict()}, allow_nan=False)
    back = json.loads(text)
    assert back["ni"]["verdict"] in {v.value for v in Verdict}
    assert back["cmp"]["extra"]["won"] + back["cmp"]["extra"]["lost"] == 50  # every item flipped
    assert back["cmp"]["method"] == "mcnemar-exact+tango-score" and back["cmp"]["n"] == 50


def test_bad_input_names_the_problem():
    with pytest.raises(BadInput, match="same length"):
        paired_bootstrap([1.0, 2.0, 3.0], [1.0, 2.0])
    with pytest.raises(BadInput, match="0/1"):
        mcnemar_exact([0, 1, 2], [0, 1, 1])
    with pytest.raises(BadInput, match="finite"):
        paired_bootstrap([1.0, np.nan], [1.0, 2.0])
    with pytest.raises(BadInput, match="denom"):
        paired_bootstrap([1.0, 2.0], [1.0, 2.0], denom=[1, 1], statistic=np.median)
    with pytest.raises(BadInput, match="denom"):
        paired_bootstrap([1.0, 2.0], [1.0, 2.0], denom=[5, 0])
    with pytest.raises(BadInput, match="statistic"):
        paired_bootstrap([1.0, 2.0], [1.0, 2.0], statistic="median")
