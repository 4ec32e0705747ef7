"""The gate policy: checks, verdicts kept apart, the combining rule and exit codes."""

import numpy as np
import pytest

from kiln.core.errors import ExitCode
from kiln.core.gate.base import CheckResult, Evidence, Verdict
from kiln.core.gate.policy import GateSection, combine, judge


def _policy(*checks, **kw):
    return GateSection.model_validate({"checks": list(checks), **kw})


def _perf(values_b, values_c, metric="decode_tok_s"):
    b, c = Evidence("baseline"), Evidence("candidate")
    b.repeats[metric], c.repeats[metric] = list(values_b), list(values_c)
    b.metrics[metric], c.metrics[metric] = float(np.median(values_b)), float(np.median(values_c))
    return c, b


def test_speedup_ratio_with_interval():
    cand, base = _perf([10, 10.2, 9.9], [15, 15.1, 14.8])
    out = judge(_policy({"kind": "performance", "metric": "decode_tok_s", "min_ratio": 1.2}), cand, base)
    r = out.results[0]
    assert r.verdict is Verdict.SUCCESSFUL and out.exit_code == ExitCode.PASSED
    assert r.ci[0] > 1.2 and r.ci[0] < r.observed < r.ci[1]


def test_noisy_speedup_is_inconclusive_not_pass():
    cand, base = _perf([10, 14, 8], [13, 11, 15])
    out = judge(_policy({"kind": "performance", "metric": "decode_tok_s", "min_ratio": 1.2}), cand, base)
    assert out.results[0].verdict is Verdict.INCONCLUSIVE
    assert out.exit_code == ExitCode.GATE_INCONCLUSIVE
    out = judge(_policy({"kind": "performance", "metric": "decode_tok_s", "min_ratio": 1.2}, on_inconclusive="pass"), cand, base)
    assert out.verdict is Verdict.INCONCLUSIVE and out.exit_code == ExitCode.PASSED


def test_slowdown_fails():
    cand, base = _perf([10, 10.1, 9.9], [7, 7.1, 6.9])
    out = judge(_policy({"kind": "performance", "metric": "decode_tok_s", "min_ratio": 1.0}), cand, base)
    assert out.verdict is Verdict.FAILED and out.exit_code == ExitCode.GATE_FAILED


def test_one_repeat_cannot_pass():
    cand, base = _perf([10], [30])
    out = judge(_policy({"kind": "performance", "metric": "decode_tok_s", "min_ratio": 1.2}), cand, base)
    assert out.results[0].verdict is Verdict.INCONCLUSIVE


def _ppl_evidence(rng, n, shift):
    tokens = np.full(n, 255)
    base_nll = rng.normal(3.5, 0.3, n) * tokens
    cand_nll = base_nll + rng.normal(shift, 0.02, n) * tokens
    b, c = Evidence("baseline"), Evidence("candidate")
    for ev, nll in ((b, base_nll), (c, cand_nll)):
        ev.samples["nll"] = {str(i): float(v) for i, v in enumerate(nll)}
        ev.samples["tokens"] = {str(i): int(t) for i, t in enumerate(tokens)}
    return c, b


@pytest.mark.parametrize("seed", range(5))
def test_perplexity_non_inferiority(seed):
    rng = np.random.default_rng(seed)
    check = {"kind": "quality", "metric": "perplexity", "margin": 0.05, "relative": True}
    same = judge(_policy(check), *_ppl_evidence(rng, 40, 0.0))
    assert same.verdict is Verdict.SUCCESSFUL
    broken = judge(_policy(check), *_ppl_evidence(rng, 40, 0.5))  # exp(0.5) = +65% perplexity
    assert broken.verdict is Verdict.FAILED
    r = broken.results[0]
    assert r.observed > r.baseline
    # perplexity up is worse: the drop is the relative rise, its interval the difference's, above the margin
    assert r.drop == pytest.approx(r.observed / r.baseline - 1) and r.drop_ci == r.ci and r.drop_ci[0] > 0.05


def test_accuracy_uses_mcnemar_and_small_sets_are_inconclusive():
    b, c = Evidence("baseline"), Evidence("candidate")
    b.samples["top1_agreement"] = {str(i): 1.0 for i in range(10)}
    c.samples["top1_agreement"] = {str(i): float(i != 0) for i in range(10)}
    out = judge(_policy({"kind": "quality", "metric": "top1_agreement", "margin": 0.02}), c, b)
    r = out.results[0]
    assert r.verdict is Verdict.INCONCLUSIVE and "mcnemar" in r.method.lower()
    # accuracy down is worse: the drop's interval is the difference's, negated and reordered
    assert r.drop == pytest.approx(0.1) and r.drop_ci == (-r.ci[1], -r.ci[0]) and r.drop_ci[1] > 0.02
    assert r.items_needed and r.items_needed > 10


def test_missing_evidence_is_error_not_crash():
    out = judge(_policy({"kind": "quality", "metric": "perplexity", "margin": 0.05}), Evidence("c"), Evidence("b"))
    assert out.verdict is Verdict.ERROR and out.exit_code == ExitCode.INTERNAL_ERROR
    assert "no per-sample 'nll'" in out.results[0].reason


def test_combining_rule_failed_beats_everything():
    def r(v):
        return CheckResult("x", "k", "m", v, None, None, "")

    assert combine([r(Verdict.SUCCESSFUL), r(Verdict.INCONCLUSIVE), r(Verdict.FAILED)], "fail")[0] is Verdict.FAILED
    assert combine([r(Verdict.ERROR), r(Verdict.INCONCLUSIVE)], "pass")[0] is Verdict.ERROR
    assert combine([r(Verdict.SUCCESSFUL)] * 3, "fail") == (Verdict.SUCCESSFUL, ExitCode.PASSED)


def test_size_and_error_rate():
    b, c = Evidence("baseline"), Evidence("candidate")
    b.metrics["size_bytes"], c.metrics["size_bytes"] = 500e6, 120e6
    c.counts["error_rate"] = (0, 2000)
    out = judge(_policy({"kind": "size", "max_ratio": 0.3}, {"kind": "error_rate", "max": 0.01}), c, b)
    assert [x.verdict for x in out.results] == [Verdict.SUCCESSFUL, Verdict.SUCCESSFUL]
    c.counts["error_rate"] = (50, 2000)
    assert judge(_policy({"kind": "error_rate", "max": 0.01}), c, b).verdict is Verdict.FAILED


def test_agreement_bound():
    b, c = Evidence("baseline"), Evidence("candidate")
    c.samples["top1_agreement"] = {str(i): v for i, v in enumerate(np.linspace(0.9, 0.97, 20))}
    assert judge(_policy({"kind": "agreement", "metric": "top1_agreement", "min": 0.85}), c, b).verdict is Verdict.SUCCESSFUL
    assert judge(_policy({"kind": "agreement", "metric": "top1_agreement", "min": 0.99}), c, b).verdict is Verdict.FAILED


@pytest.mark.parametrize("pressure, bound, metric, expected", [
    (0.6, 0.25, "decode_tok_s", Verdict.INCONCLUSIVE),  # a busy machine cannot give a speed verdict
    (0.6, None, "decode_tok_s", Verdict.SUCCESSFUL),  # the recipe switched the guard off
    (0.04, 0.25, "decode_tok_s", Verdict.SUCCESSFUL),  # quiet
    (0.6, 0.25, "load_ttft_p50_ms", Verdict.SUCCESSFUL),  # the decode bench's pressure says nothing of the load stage
])
def test_speed_measured_on_a_busy_machine_is_inconclusive(pressure, bound, metric, expected):
    cand, base = _perf([10, 10.2, 9.9], [15, 15.1, 14.8], metric)
    for ev in (cand, base):
        ev.metrics["bench_cpu_pressure"] = pressure
    check = {"kind": "performance", "metric": metric, "max_cpu_pressure": bound, "min_ratio": 1.2}
    r = judge(_policy(check), cand, base).results[0]
    assert r.verdict is expected, r.reason
    if expected is Verdict.INCONCLUSIVE:
        assert "60%" in r.reason and "--fresh benchmark" in r.reason


def test_contention_between_two_readings():
    from kiln.evaluate.contention import Reading, between

    got = between(Reading(10.0, 1_000_000, 5, 1000), Reading(12.0, 2_000_000, 15, 1200))
    assert got["cpu_pressure"] == pytest.approx(0.5) and got["cpu_steal"] == pytest.approx(0.05)
    assert between(Reading(0, None, None, None), Reading(1, None, None, None))["cpu_pressure"] is None


@pytest.mark.parametrize(("limited_role", "verdict"), [(None, Verdict.SUCCESSFUL), ("candidate", Verdict.INCONCLUSIVE),
                                                       ("baseline", Verdict.INCONCLUSIVE)])
def test_a_load_check_on_a_client_limited_measurement_decides_nothing(limited_role, verdict):
    """The load generator fell behind its schedule: the numbers measure the client, so a search
    must not rank on them and the gate must not pass or fail the server on them."""
    from kiln.core.metrics import CLIENT_LIMITED

    cand, base = _perf([2.0, 2.1, 1.9], [4.0, 4.1, 3.9], metric="load_output_token_throughput")
    for ev in (cand, base):
        ev.counts[CLIENT_LIMITED] = (1 if ev.role == limited_role else 0, 3)
    out = judge(_policy({"kind": "performance", "metric": "load_output_token_throughput", "min_ratio": 1.5}), cand, base)
    assert out.results[0].verdict is verdict, out.results[0].reason
    if limited_role:
        assert f"1 of 3 {limited_role} repeats" in out.results[0].reason and "client-limited" in out.results[0].reason


# --- measured nothing or too little: `on_inconclusive: pass` never accepts it ----------------------

def _short(r: CheckResult) -> bool:
    return r.verdict is Verdict.INCONCLUSIVE and r.insufficient and "too little data" in r.reason


def test_combine_blocks_an_insufficient_check_whatever_on_inconclusive_says():
    wide = CheckResult("wide", "k", "m", Verdict.INCONCLUSIVE, None, None, "")
    empty = CheckResult("empty", "k", "m", Verdict.INCONCLUSIVE, None, None, "", insufficient=True)
    assert combine([wide], "pass") == (Verdict.INCONCLUSIVE, ExitCode.PASSED)  # enough data, wide interval
    for on_inconclusive in ("pass", "fail"):
        assert combine([wide, empty], on_inconclusive) == (Verdict.INCONCLUSIVE, ExitCode.GATE_INCONCLUSIVE)
    failed = CheckResult("f", "k", "m", Verdict.FAILED, None, None, "")
    assert combine([empty, failed], "pass") == (Verdict.FAILED, ExitCode.GATE_FAILED)
    assert empty.to_dict()["insufficient"] is True and wide.to_dict()["insufficient"] is False


def test_no_requests_and_one_repeat_measured_nothing():
    b, c = Evidence("baseline"), Evidence("candidate")  # no load stage ran: no counts, no repeats
    out = judge(_policy({"kind": "error_rate", "max": 0.001},
                        {"kind": "performance", "metric": "load_ttft_p95_ms", "max": 0.001}, on_inconclusive="pass"),
                c, b)
    assert out.verdict is Verdict.INCONCLUSIVE and out.exit_code == ExitCode.GATE_INCONCLUSIVE
    assert all(_short(r) for r in out.results), [r.reason for r in out.results]
    cand, base = _perf([10], [30])
    one = judge(_policy({"kind": "performance", "metric": "decode_tok_s", "min_ratio": 1.2}, on_inconclusive="pass"),
                cand, base)
    assert one.exit_code == ExitCode.GATE_INCONCLUSIVE and _short(one.results[0])
    assert "1 repeat(s)" in one.results[0].reason


def test_a_client_limited_load_check_blocks_under_pass():
    from kiln.core.metrics import CLIENT_LIMITED

    cand, base = _perf([2.0, 2.1, 1.9], [4.0, 4.1, 3.9], metric="load_output_token_throughput")
    cand.counts[CLIENT_LIMITED], base.counts[CLIENT_LIMITED] = (1, 3), (0, 3)
    out = judge(_policy({"kind": "performance", "metric": "load_output_token_throughput", "min_ratio": 1.5},
                        on_inconclusive="pass"), cand, base)
    assert out.exit_code == ExitCode.GATE_INCONCLUSIVE and _short(out.results[0])


def test_perplexity_below_its_minimum_documents_blocks_under_pass():
    """`on_inconclusive: pass` used to waive the perplexity minimum: 12 documents, exit 0."""
    rng = np.random.default_rng(0)
    check = {"kind": "quality", "metric": "perplexity", "margin": 0.05, "relative": True}
    for shift in (0.0, 0.04):  # would pass on its interval; undecided on its interval
        out = judge(_policy(check, on_inconclusive="pass"), *_ppl_evidence(rng, 12, shift))
        r = out.results[0]
        assert out.exit_code == ExitCode.GATE_INCONCLUSIVE, r.reason
        assert _short(r) and "12 documents are too few" in r.reason, r.reason
    enough = judge(_policy(check, on_inconclusive="pass"), *_ppl_evidence(rng, 40, 0.0))
    assert enough.verdict is Verdict.SUCCESSFUL and not enough.results[0].insufficient


def _accuracy(n: int, lost: int, won: int = 0):
    b, c = Evidence("baseline"), Evidence("candidate")
    b.samples["top1_agreement"] = {str(i): float(i >= won) for i in range(n)}  # the first `won` wrong
    c.samples["top1_agreement"] = {str(i): float(i < won or i >= won + lost) for i in range(n)}
    return c, b


def test_items_too_few_to_ever_pass_block_but_a_wide_interval_on_enough_items_does_not():
    check = {"kind": "quality", "metric": "top1_agreement", "margin": 0.03}
    tiny = judge(_policy(check, on_inconclusive="pass"), *_accuracy(10, 0))  # identical on all 10 items
    r = tiny.results[0]
    assert tiny.exit_code == ExitCode.GATE_INCONCLUSIVE, r.reason
    assert _short(r) and "10 paired items cannot show a drop within 0.03" in r.reason, r.reason
    assert r.items_needed == 125
    # 400 items, 8 lost and 4 won: could have passed, but the interval straddles the margin
    wide = judge(_policy(check, on_inconclusive="pass"), *_accuracy(400, 8, 4))
    assert wide.results[0].verdict is Verdict.INCONCLUSIVE and not wide.results[0].insufficient, wide.results[0].reason
    assert wide.exit_code == ExitCode.PASSED
