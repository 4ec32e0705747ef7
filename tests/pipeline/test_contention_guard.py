"""The contention guard is never silently off: steal past its bound is Inconclusive as pressure is,
the run queue stands in for PSI under its own name, every decode-speed verdict says how busy the
machine was, and the report warns when a recipe switched the guard off or the machine had no signal."""

import numpy as np
import pytest

from kiln.core.errors import ExitCode
from kiln.core.gate.base import Evidence, Verdict
from kiln.core.gate.policy import GateOutcome, judge
from kiln.pipeline.recipe.schema import GateSection
from kiln.pipeline.report.report import Sections, _search_tables, html_page, markdown


def _speed(machine: dict[str, float], **bounds) -> tuple[GateSection, Evidence, Evidence]:
    b, c = Evidence("baseline"), Evidence("candidate")
    b.repeats["decode_tok_s"], c.repeats["decode_tok_s"] = [10, 10.2, 9.9], [15, 15.1, 14.8]
    b.metrics["decode_tok_s"], c.metrics["decode_tok_s"] = 10.0, 15.0
    for ev in (b, c):
        ev.metrics.update(machine)
    policy = GateSection.model_validate({"checks": [{"kind": "performance", "metric": "decode_tok_s",
                                                     "min_ratio": 1.2, **bounds}]})
    return policy, c, b


@pytest.mark.parametrize("steal, bound, expected", [
    (0.30, {}, Verdict.INCONCLUSIVE),  # the default bound: a hypervisor taking 30% cannot give a speed verdict
    (0.05, {}, Verdict.SUCCESSFUL),  # a shared VM's usual few percent
    (0.05, {"max_cpu_steal": 0.02}, Verdict.INCONCLUSIVE),
    (0.30, {"max_cpu_steal": None}, Verdict.SUCCESSFUL),  # switched off: passes, and says so
])
def test_steal_past_its_bound_is_inconclusive(steal, bound, expected):
    policy, cand, base = _speed({"bench_cpu_pressure": 0.02, "bench_cpu_steal": steal}, **bound)
    r = judge(policy, cand, base).results[0]
    assert r.verdict is expected, r.reason
    if expected is Verdict.INCONCLUSIVE:
        assert f"other guests {steal:.0%} of the CPU time (steal; max_cpu_steal" in r.reason
        assert "--fresh benchmark" in r.reason
    else:
        assert f"CPU pressure 2.0% (PSI), steal {steal:.1%}" in r.reason  # a verdict names what it stood on
    if "max_cpu_steal" in bound and bound["max_cpu_steal"] is None:
        assert "not guarded: the recipe sets max_cpu_steal: null" in r.reason


def test_the_run_queue_pressure_is_judged_and_named():
    policy, cand, base = _speed({"bench_run_queue_pressure": 0.8, "bench_cpu_steal": 0.0})
    r = judge(policy, cand, base).results[0]
    assert r.verdict is Verdict.INCONCLUSIVE
    assert "tasks waited for a CPU 80% of the time (run queue; max_cpu_pressure 25%)" in r.reason


@pytest.mark.parametrize("machine, says", [
    ({"bench_cpu_pressure": 0.031, "bench_cpu_steal": 0.004}, "CPU pressure 3.1% (PSI), steal 0.4%"),
    ({"bench_run_queue_pressure": 0.1, "bench_cpu_steal": 0.0}, "CPU pressure 10.0% (run queue), steal 0.0%"),
    ({}, "CPU pressure not measured (no PSI, no run queue in /proc), steal not measured"),
])
def test_every_speed_verdict_says_how_busy_the_machine_was(machine, says):
    policy, cand, base = _speed(machine)
    r = judge(policy, cand, base).results[0]
    assert r.verdict is Verdict.SUCCESSFUL and says in r.reason, r.reason


def _report(checks: list[dict], machine: dict[str, float]) -> tuple[str, str]:
    from kiln.core.gate.performance import guard_warnings

    policy = GateSection.model_validate({"checks": checks})
    cand = Evidence("candidate", metrics={"decode_tok_s": 15.0, **machine})
    sections = Sections(warnings=guard_warnings(policy.checks, cand.metrics))
    outcome = GateOutcome(Verdict.SUCCESSFUL, [], ExitCode.PASSED, "any Failed fails")
    evidence = {"baseline": Evidence("baseline", metrics={"decode_tok_s": 10.0, **machine}), "candidate": cand}
    return markdown("demo", outcome, evidence, {}, sections), html_page("demo", outcome, evidence, sections)


def test_the_report_warns_when_a_recipe_switched_the_guard_off():
    speed = {"kind": "performance", "metric": "decode_tok_s", "min_ratio": 1.2}
    md, page = _report([{**speed, "max_cpu_pressure": None}], {"bench_cpu_pressure": 0.5, "bench_cpu_steal": 0.0})
    warning = ("contention guard off for performance:decode_tok_s: the recipe sets max_cpu_pressure: null, "
               "so its speed verdict stands however busy the machine was")
    assert f"> ⚠️ {warning}." in md.split("## ", 1)[0]  # under the verdict, before any table
    assert warning in page
    # The machine's figures stand beside the speed in the metrics table.
    assert "| bench_cpu_pressure | 50.0% | 50.0% |" in md and "| bench_cpu_steal | 0.0% | 0.0% |" in md
    quiet, _ = _report([speed], {"bench_cpu_pressure": 0.02, "bench_cpu_steal": 0.0})
    assert "⚠️" not in quiet


def test_the_report_warns_when_the_machine_had_no_pressure_signal():
    speed = {"kind": "performance", "metric": "decode_tok_s", "min_ratio": 1.2}
    md, _ = _report([speed], {})
    assert "> ⚠️ the decode benchmark could not measure CPU pressure on this machine" in md


def test_the_candidates_table_shows_the_machine_beside_each_speed():
    row = {"name": "q4", "engine": "llama_cpp q4_0", "optimize": "gguf", "verdict": "Successful", "eliminated": None,
           "screened": {"ratio": 1.5, "low": 1.2, "high": 1.8}, "confirmed": None, "perplexity": None,
           "decode_tok_s": 72.1, "contention": "CPU pressure 3.0% (PSI), steal 0.0%", "cost_per_1m": None,
           "serving_bytes": 9e7}
    record = {"winner": "q4", "why": "fastest", "statistics": "1 candidate(s)", "baseline": None,
              "confidence": 0.95, "candidates": [row]}
    (_, header, rows), = [t for t in _search_tables(record) if t[0] == "Candidates"]
    assert rows[0][header.index("decode tok/s (b1)")] == "72.1 (CPU pressure 3.0% (PSI), steal 0.0%)"


def test_the_job_summary_and_the_comment_carry_the_warning(tmp_path):
    import json

    from kiln.pipeline.github import publish as github

    speed = {"kind": "performance", "metric": "decode_tok_s", "min_ratio": 1.2, "max_cpu_steal": None}
    md, _ = _report([speed], {"bench_cpu_pressure": 0.02, "bench_cpu_steal": 0.3})
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "report.md").write_text(md)
    (run_dir / "verdict.json").write_text(json.dumps({"verdict": "Successful", "exit_code": 0, "checks": [],
                                                      "recipe": "recipes/demo.yaml"}))
    summary = tmp_path / "summary.md"
    github.publish(run_dir, {"GITHUB_ACTIONS": "true", "GITHUB_STEP_SUMMARY": str(summary)})
    warning = "> ⚠️ contention guard off for performance:decode_tok_s: the recipe sets max_cpu_steal: null"
    assert warning in summary.read_text()
    comment = (run_dir / github.COMMENT_FILE).read_text()
    assert warning in comment.split("<details>", 1)[0]  # in the comment's head, not only in the folded report


def _paired(base_pressure: list[float], cand_pressure: list[float], cand_speed: list[float] | None = None,
            **bounds) -> tuple[GateSection, Evidence, Evidence]:
    """A decode benchmark whose every pair recorded each arm's half: baseline ~10 tok/s, candidate ~15
    (or `cand_speed`), the whole run's pressure the mean of the halves."""
    n = len(base_pressure)
    rng = np.random.default_rng(0)
    b, c = Evidence("baseline"), Evidence("candidate")
    b.repeats["decode_tok_s"] = list(10 * np.exp(rng.normal(0, 0.05, n)))
    c.repeats["decode_tok_s"] = cand_speed or list(15 * np.exp(rng.normal(0, 0.05, n)))
    b.repeats["bench_cpu_pressure"], c.repeats["bench_cpu_pressure"] = base_pressure, cand_pressure
    whole = {"bench_cpu_pressure": float(np.mean(base_pressure + cand_pressure)), "bench_cpu_steal": 0.0}
    for ev in (b, c):
        ev.metrics.update(whole, decode_tok_s=float(np.median(ev.repeats["decode_tok_s"])))
    policy = GateSection.model_validate({"checks": [{"kind": "performance", "metric": "decode_tok_s",
                                                     "min_ratio": 1.2, **bounds}]})
    return policy, c, b


def test_steady_load_on_both_halves_is_judged():
    """One busy process beside the benchmark all along (~50% in every half): both arms of each pair
    shared it, so the whole run's 50% does not refuse the verdict."""
    policy, cand, base = _paired([0.5, 0.52, 0.48] * 8, [0.49, 0.5, 0.51] * 8)
    r = judge(policy, cand, base).results[0]
    assert r.verdict is Verdict.SUCCESSFUL, r.reason
    assert "CPU pressure 50.0% (PSI)" in r.reason and "0 of 24 pairs dropped" in r.reason


def test_a_load_change_within_a_pair_drops_the_pair():
    """Three pairs where a job started between the arms' halves, their ratio off (the candidate slowed
    to a third): they are dropped and said so, and the verdict stands on the other 21."""
    base_p, cand_p = [0.02] * 24, [0.02] * 24
    speed = list(15 * np.ones(24))
    for i in (3, 11, 19):
        cand_p[i], speed[i] = 0.6, 1.0
    policy, cand, base = _paired(base_p, cand_p, cand_speed=speed)
    r = judge(policy, cand, base).results[0]
    assert r.verdict is Verdict.SUCCESSFUL, r.reason
    assert "3 of 24 pairs dropped (3 CPU pressure changed by more than 25% between the arms' halves)" in r.reason
    assert r.method == "paired log-ratio t-interval over 21 of 24 interleaved pairs"
    assert r.ci[0] > 1.4  # the three slowed pairs are not in the interval
    off, c2, b2 = _paired(base_p, cand_p, cand_speed=speed, max_cpu_pressure=None)
    assert judge(off, c2, b2).results[0].verdict is not Verdict.SUCCESSFUL  # unguarded, they pull it down


def test_load_that_keeps_changing_within_pairs_is_refused():
    policy, cand, base = _paired([0.02, 0.6] * 12, [0.02] * 24)  # half the pairs: the rest still decide
    r = judge(policy, cand, base).results[0]
    assert r.verdict is Verdict.SUCCESSFUL and "12 of 24 pairs dropped" in r.reason, r.reason
    policy, cand, base = _paired([0.02, 0.6, 0.6] * 8, [0.02] * 24)  # a job coming and going, mostly there
    r = judge(policy, cand, base).results[0]
    assert r.verdict is Verdict.INCONCLUSIVE, r.reason
    assert "the machine's load changed while measuring: 16 of 24 pairs dropped" in r.reason
    assert "--fresh benchmark" in r.reason


def test_saturated_halves_cannot_show_a_change_and_are_dropped():
    """Two busy processes beside a 2-thread engine on 2 cores: a task waits all the time in both halves."""
    policy, cand, base = _paired([1.0] * 20 + [0.9] * 4, [0.99] * 20 + [0.9] * 4)
    r = judge(policy, cand, base).results[0]
    assert r.verdict is Verdict.INCONCLUSIVE and "20 of 24 pairs dropped" in r.reason
    assert "both halves saturated" in r.reason


def test_an_absolute_check_drops_the_samples_measured_above_the_bound():
    """An SLO on the candidate alone has no pair to share the load with: the level itself is bounded."""
    _, cand, base = _paired([0.02] * 24, [0.02] * 20 + [0.6] * 4)
    policy = GateSection.model_validate({"checks": [{"kind": "performance", "metric": "decode_tok_s", "min": 12}]})
    r = judge(policy, cand, base).results[0]
    assert r.verdict is Verdict.SUCCESSFUL and "4 of 24 samples dropped (4 CPU pressure above 25%)" in r.reason
