"""Figures as a person reads them (kiln.core.units) on the console, in the report and in `kiln show`: the unit
each metric declares or its name implies, never `size_bytes=5.416e+08`."""

import re
from pathlib import Path

import pytest

from kiln.core.units import DEFAULT_CURRENCY, amount, check_figures, currency_problem, money, number


@pytest.mark.parametrize(("name", "value", "shown"), [
    ("size_bytes", 5.416e8, "541.6 MB"),  # a size on disk: decimal
    ("size_bytes", 1.5e9, "1.5 GB"),
    ("peak_rss_bytes", 2.763e8, "263.5 MiB"),  # memory: binary
    ("optimize_children_peak_pss_bytes", 3 << 30, "3.0 GiB"),
    ("engine_children_peak_pss_bytes", 0, "0 B"),
    ("decode_tok_s", 110.66, "110.7 tok/s"),
    ("baseline.decode_tok_s", 17.09, "17.09 tok/s"),  # a role's figure reads as its metric's
    ("ttft_ms", 176.6, "176.6 ms"),
    ("top1_agreement", 0.9613, "96.1%"),
    ("bench_cpu_pressure", 0.0111, "1.1%"),
    ("kl_mean", 0.003473, "0.003473 nats"),
    ("quantize_s", 22.55, "22.55 s"),
    ("perplexity", 66.42, "66.42"),
    ("served_prompts", 18, "18"),
    ("perplexity", None, "—"),
])
def test_each_figure_carries_its_unit(name, value, shown):
    assert amount(name, value) == shown


def test_no_e_notation_a_reader_has_to_decode():
    assert number(123456.7) == "123,457"
    assert number(0.00012) == "0.00012"
    assert "e" not in amount("size_bytes", 5.416e8) + amount("peak_rss_bytes", 2.763e8)


@pytest.mark.parametrize(("value", "currency", "shown"), [
    (0.2391, "USD", "$0.24"),  # USD, the default, shows as its symbol
    (3.0, "EUR", "€3.00"),
    (24090.0, "GBP", "£24,090"),  # from a thousand on, cents no longer matter
    (12.5, "CHF", "12.50 CHF"),  # a code with no symbol here follows the figure
    (0.0024, "USD", "$0.0024"),  # below a cent: never $0.00
    (1.5, "R$", "R$1.50"),  # a symbol the recipe gives is used as it is
    (None, "USD", "—"),
])
def test_money_in_the_recipes_currency(value, currency, shown):
    assert money(value, currency) == shown


def test_a_cost_metric_is_shown_in_the_currency_it_is_given():
    assert amount("load_cost_per_1m_output_tokens", 0.2391) == "$0.24"
    assert amount("baseline.load_cost_per_1m_output_tokens", 0.2391, "EUR") == "€0.24"


def test_the_recipes_currency_is_a_code_or_a_symbol_and_says_the_fix():
    from kiln.core.errors import BadInput
    from kiln.pipeline.recipe.schema import load_recipe

    assert currency_problem("EUR") is None and currency_problem("€") is None
    recipe = Path(__file__).parents[2] / "recipes" / "demo.yaml"
    assert load_recipe(recipe).currency == DEFAULT_CURRENCY
    assert "currency" not in load_recipe(recipe).model_dump(mode="json")  # the default leaves digests as they were
    assert load_recipe(recipe, ["currency=EUR"]).currency == "EUR"
    with pytest.raises(BadInput) as e:
        load_recipe(recipe, ["currency=euros"])
    assert "currency" in str(e.value) and "ISO 4217" in str(e.value) and "EUR" in str(e.value)


def test_a_checks_figures_carry_their_units():
    speed = {"kind": "performance", "metric": "decode_tok_s", "threshold": "ratio ≥ 2", "observed": 7.323,
             "baseline": 1.0, "ci": [6.918, 7.751]}
    size = {"kind": "size", "metric": "size_bytes", "threshold": "ratio ≤ 1", "observed": 1.019e8, "baseline": 5.416e8}
    ppl = {"kind": "quality", "metric": "perplexity", "threshold": "drop ≤ 5% (relative)", "observed": 66.87,
           "baseline": 66.42, "drop_ci": [0.002561, 0.01213]}
    agree = {"kind": "agreement", "metric": "top1_agreement", "threshold": "≥ 0.9", "observed": 0.9613,
             "baseline": None, "ci": [0.9554, 0.9684]}
    assert check_figures(speed) == ("7.32x", "1x", "[6.92x, 7.75x]")
    assert check_figures(size) == ("101.9 MB", "541.6 MB", "—")
    assert check_figures(ppl) == ("66.87", "66.42", "drop [0.26%, 1.21%]")
    assert check_figures(agree) == ("96.1%", "—", "[95.5%, 96.8%]")


SEARCH = {"objective": "decode_tok_s", "winner": "q4", "why": "the fastest", "statistics": "2 candidates",
          "versus_champion": None, "confidence": 0.975, "price_per_hour": 0.1, "currency": "EUR",
          "baseline": {"engine": "torch float32", "decode_tok_s": 16.13, "cost_per_1m": 1.722},
          "candidates": [{"name": "q4", "engine": "llama_cpp q4_1", "optimize": "gguf", "verdict": "Successful",
                          "screened": {"ratio": 7.3, "low": 6.9, "high": 7.7}, "confirmed": None, "runoff": None,
                          "perplexity": {"change": 0.0067, "low": 0.0026, "high": 0.0121}, "decode_tok_s": 116.0,
                          "contention": None, "nodes": None, "cost_per_1m": 0.2395, "serving_bytes": 1.019e8,
                          "eliminated": None}]}


def test_report_and_pull_request_comment_show_costs_in_the_recipes_currency():
    """The report said '1.72 per 1M output tokens at 0.1 per machine-hour' and '0.239': no currency at all."""
    from kiln.core.errors import ExitCode
    from kiln.core.gate.base import CheckResult, Evidence, Verdict
    from kiln.core.gate.policy import GateOutcome
    from kiln.pipeline.github.publish import comment_body
    from kiln.pipeline.report.report import Sections, markdown

    size = CheckResult("size", "size", "size_bytes", Verdict.SUCCESSFUL, 1.019e8, 5.416e8, "ratio ≤ 1")
    outcome = GateOutcome(Verdict.SUCCESSFUL, [size], ExitCode.PASSED, "any Failed fails")
    evidence = {role: Evidence(role, metrics={"size_bytes": b, "load_cost_per_1m_output_tokens": c})
                for role, b, c in (("baseline", 5.416e8, 1.722), ("candidate", 1.019e8, 0.2395))}
    report = markdown("demo", outcome, evidence, {}, Sections(search=SEARCH, currency="EUR"))
    assert "€1.72 per 1M output tokens at €0.10 per machine-hour" in report
    assert "| €0.24 |" in report  # the candidates table's cost per 1M tokens
    assert "| cost per 1M output tokens (load sweep) | €1.72 | €0.24 |" in report
    verdict = {"verdict": "Successful", "exit_code": 0, "checks": [size.to_dict()]}
    comment = comment_body("recipes/demo.yaml", verdict, report, {}, [])
    assert "€0.24" in comment and "$" not in comment
    assert comment.count("| size | 101.9 MB | 541.6 MB | ratio ≤ 1 | — |") == 2  # its table and the report's
    assert "e+0" not in comment


def test_plan_capacity_costs_in_the_currency_asked_for(tmp_path):
    from tests.pipeline.conftest import kiln

    shown = kiln("plan-capacity", "--target-rps", "100", "--goodput", "12", "--price-per-hour", "3",
                 "--currency", "EUR", cwd=tmp_path, check=True).stdout
    assert "€3.00" in shown and "€24,090" in shown and "$" not in shown
    refused = kiln("plan-capacity", "--target-rps", "100", "--goodput", "12", "--currency", "eur", cwd=tmp_path)
    assert refused.returncode == 2 and "currency" in refused.stderr and "ISO 4217" in refused.stderr


def test_a_size_bound_reads_in_megabytes():
    """The threshold said '≤ 200000000 bytes' in the report and the pull-request comment."""
    from kiln.core.gate.base import CHECKS, Evidence

    config = CHECKS.config("size")(max_bytes=200_000_000)
    result = CHECKS.get("size")(config, 0.95).check(Evidence("candidate", metrics={"size_bytes": 1.019e8}),
                                                    Evidence("baseline", metrics={"size_bytes": 5.416e8}))
    assert result.threshold == "≤ 200.0 MB"


def test_the_stage_line_on_the_console_reads_in_units(tmp_path):
    """The line `kiln run` prints under each stage it computes said `size_bytes=5.416e+08, peak_rss_bytes=2.763e+08`."""
    from types import SimpleNamespace

    from rich.console import Console

    from kiln.pipeline.stages.base import RunContext, run_stage

    tracker = SimpleNamespace(start=lambda *a, **k: "run", log=lambda *a, **k: None, end=lambda *a, **k: None,
                              log_artifacts=lambda *a, **k: None, find_stage=lambda key: None)
    console = Console(record=True, width=300)
    ctx = RunContext(SimpleNamespace(name="r", digest=lambda: "d"), tmp_path / "r.yaml", tmp_path / "run",
                     tmp_path / "cache", tracker, "parent", console)
    metrics = {"size_bytes": 5.416e8, "peak_rss_bytes": 2.763e8, "decode_tok_s": 17.04, "ttft_ms": 176.6}
    run_stage(ctx, "optimize", "candidate", {"x": 1}, lambda out: {"metrics": dict(metrics)})
    [line] = [line for line in console.export_text().splitlines() if "done in" in line]
    assert "s size_bytes 541.6 MB, peak_rss_bytes 263.5 MiB, decode_tok_s 17.04 tok/s, ttft_ms 176.6 ms, " in line
    assert re.search(r", optimize_peak_rss_bytes [\d.,]+ (MiB|GiB)", line), line  # the stage's own, measured
    assert "e+0" not in line and "=" not in line


def test_a_checks_reason_reads_in_units():
    """A size check's reason said '2107.0 MB' where a reader wants 2.1 GB; an absolute speed bound's said
    'value 17 [16.2, 17.8]' with no unit."""
    from kiln.core.gate.base import CHECKS, Evidence

    size = CHECKS.get("size")(CHECKS.config("size")(max_ratio=1.0), 0.95)
    result = size.check(Evidence("candidate", metrics={"size_bytes": 5.416e8}),
                        Evidence("baseline", metrics={"size_bytes": 2.107e9}))
    assert result.reason == "541.6 MB is 0.257× the baseline's 2.1 GB"
    speed = CHECKS.get("performance")(CHECKS.config("performance")(metric="decode_tok_s", min=10), 0.95)
    rates = [16.8, 17.2, 17.0, 16.9, 17.3]
    result = speed.check(Evidence("candidate", metrics={"decode_tok_s": 17.04}, repeats={"decode_tok_s": rates}),
                         Evidence("baseline", metrics={"decode_tok_s": 16.0}, repeats={"decode_tok_s": rates}))
    assert re.match(r"value 17.04 tok/s \[16.\d+ tok/s, 17.\d+ tok/s\] at 95%", result.reason), result.reason
