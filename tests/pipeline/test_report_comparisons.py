"""The report compares every quality metric both arms scored item by item, gated or not, with its
difference, interval, p-value and test (from hand-made per-item records, no model)."""

import re

import numpy as np
from scipy import stats as sps

import kiln.evaluate.quality.lmeval  # noqa: F401 - declares word_swap_acc, a fraction, as a run's recipe does
from kiln.core.errors import ExitCode
from kiln.core.gate.base import Evidence, Verdict
from kiln.core.gate.policy import GateOutcome
from kiln.pipeline.report.report import Sections, comparisons, markdown


def _arms() -> dict[str, Evidence]:
    rng = np.random.default_rng(0)
    nll = rng.uniform(500, 700, 30)
    right_b = np.ones(120)
    right_c = right_b.copy()
    right_c[:12] = 0  # the candidate gets 12 items wrong the baseline got right, none the other way
    ids = [f"d{i}" for i in range(120)]

    def arm(role: str, nll_: np.ndarray, right: np.ndarray) -> Evidence:
        return Evidence(role, samples={"nll": dict(zip(ids, nll_)), "tokens": dict.fromkeys(ids[:30], 255.0),
                                       "word_swap_acc": dict(zip(ids, right))})

    return {"baseline": arm("baseline", nll, right_b), "candidate": arm("candidate", nll * 1.02, right_c)}


def test_every_paired_metric_is_compared_whether_gated_or_not():
    cmps = {c.metric: c for c in comparisons(_arms(), 0.95)}
    assert list(cmps) == ["perplexity", "word_swap_acc"]
    ppl, acc = cmps["perplexity"], cmps["word_swap_acc"]
    # NLL 2% higher on every document: perplexity exp(sum NLL / tokens) rises by this much, every resample agreeing
    nll = np.array(list(_arms()["baseline"].samples["nll"].values()))
    assert ppl.relative and abs(ppl.difference - np.expm1(0.02 * nll.sum() / (30 * 255))) < 1e-9
    assert 0 < ppl.ci_low <= ppl.difference <= ppl.ci_high
    # 12 discordant pairs, all one way: the exact McNemar p-value is the two-sided binomial test's
    assert acc.difference == -0.1 and acc.n == 120
    assert acc.p_value == sps.binomtest(0, 12, 0.5).pvalue


def test_report_shows_the_paired_table_after_the_checks():
    arms = _arms()
    outcome = GateOutcome(Verdict.SUCCESSFUL, [], ExitCode.PASSED, "any Failed fails")
    md = markdown("demo", outcome, arms, {}, Sections(comparisons=comparisons(arms, 0.95)))
    section = md.split("## Quality, paired item by item", 1)[1].split("\n## ", 1)[0]
    rows = [r for r in section.splitlines() if r.startswith("| ") and "metric" not in r]
    assert [r.split(" | ")[0] for r in rows] == ["| perplexity", "| word_swap_acc"]
    assert re.search(r"\| word_swap_acc \| 100\.0% \| 90\.0% \| -10 pp \| \[-\d+\.?\d* pp, -\d\.?\d* pp\] at 95% \| 0\.000488 \| "
                     r"mcnemar-exact\S* n=120 \|", md), section
    assert "| perplexity |" in section and "%" in rows[0]


def test_the_candidates_table_names_what_each_engine_computes_in():
    from kiln.engine.base import BACKENDS
    from kiln.optimize.base import QUANTIZERS
    from kiln.pipeline.report.report import _serving

    llama = BACKENDS.config("llama_cpp")(threads=1)
    assert _serving(llama, QUANTIZERS.config("gguf")(type="q4_K_M")) == "llama_cpp q4_K_M"  # the file's own type
    assert _serving(llama, QUANTIZERS.config("none")()) == "llama_cpp f32"  # converted at engine.precision
    assert _serving(BACKENDS.config("torch")()) == "torch float32"
