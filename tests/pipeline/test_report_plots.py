"""The report's quality-deltas figure and its sections, from hand-made gate results (no model)."""

import base64
import re

import pytest

from kiln.core.errors import ExitCode
from kiln.core.gate.base import CheckResult, Evidence, Verdict
from kiln.core.gate.policy import GateOutcome
from kiln.core.gate.quality import QualityCheckConfig
from kiln.pipeline.report.report import Sections, check_rows, html_page, markdown
from kiln.pipeline.report.plots import quality_deltas

# As the quality check writes them: ci of candidate - baseline, drop and drop_ci positive when worse.
ACC = CheckResult("acc", "quality", "greedy_match", Verdict.FAILED, 0.8, 0.9, "drop ≤ 0.05", ci=(-0.15, -0.05),
                  drop=0.1, drop_ci=(0.05, 0.15))
PPL = CheckResult("ppl", "quality", "perplexity", Verdict.INCONCLUSIVE, 11.0, 10.0, "drop ≤ 12% (relative)",
                  ci=(0.05, 0.15), drop=0.1, drop_ci=(0.05, 0.15))
SIZE = CheckResult("size", "size", "size_bytes", Verdict.SUCCESSFUL, 1.0, 4.0, "ratio ≤ 0.5")
CHECKS = {"acc": QualityCheckConfig(metric="greedy_match", margin=0.05, name="acc"),
          "ppl": QualityCheckConfig(metric="perplexity", margin=0.12, relative=True, name="ppl")}


def test_checks_table_shows_quality_intervals_as_the_drop_its_threshold_bounds():
    speed = CheckResult("speed", "performance", "decode_tok_s", Verdict.SUCCESSFUL, 1.1, 1.0, "ratio ≥ 0.85",
                        ci=(1.02, 1.18))
    rows = {r[1]: r for r in check_rows([ACC, PPL, speed, SIZE])}
    # accuracy fell: its difference interval [-0.15, -0.05] is a drop of [0.05, 0.15], read against 'drop ≤ 0.05'
    assert rows["acc"][4:6] == ["drop ≤ 0.05", "drop [0.05, 0.15]"]
    assert rows["ppl"][5] == "drop [5.00%, 15.00%]"  # a relative margin's drop: in percent of the baseline
    assert rows["speed"][2:4] == ["1.1x", "1x"] and rows["speed"][5] == "[1.02x, 1.18x]"  # a speed-up is a ratio
    assert rows["acc"][2:4] == ["80.0%", "90.0%"] and rows["size"][5] == "—"  # a fraction metric in percent


def test_quality_deltas_draws_one_row_per_quality_check_with_its_margin(tmp_path):
    path = quality_deltas([ACC, SIZE, PPL], CHECKS, tmp_path / "q.png")
    assert path.read_bytes()[:4] == b"\x89PNG"
    assert quality_deltas([SIZE], CHECKS, tmp_path / "none.png") is None and not (tmp_path / "none.png").exists()


def test_a_relative_drop_is_drawn_in_percent_as_the_report_gives_it(tmp_path, monkeypatch):
    """The figure said "drop 0.1 [0.05, 0.15] (fraction of baseline)" where the report said +10.00%."""
    from matplotlib.figure import Figure

    drawn = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: drawn.append(fig))
    quality_deltas([ACC, PPL], CHECKS, tmp_path / "q.png")
    acc, ppl = (ax.get_title() for ax in drawn[0].axes)
    assert ppl.startswith("ppl: drop +10% [+5%, +15%]") and "fraction" not in ppl, ppl
    assert acc.startswith("acc: drop +0.1 [+0.05, +0.15]"), acc  # an absolute drop keeps the metric's own unit
    assert [line.get_label() for line in drawn[0].axes[1].get_lines() if line.get_label().startswith("margin")] == ["margin 12%"]


def test_report_sections_in_order_with_embedded_plots_and_lineage(tmp_path):
    plot = quality_deltas([ACC, PPL], CHECKS, tmp_path / "plots" / "quality_deltas.png")
    outcome = GateOutcome(Verdict.FAILED, [ACC, PPL], ExitCode.GATE_FAILED, "any Failed fails")
    evidence = {"baseline": Evidence("baseline", metrics={"size_bytes": 4e8}),
                "candidate": Evidence("candidate", metrics={"size_bytes": 1e8})}
    lineage = [{"step": "recipe", "key": "abc123", "mlflow_run": "run0", "detail": "r.yaml"},
               {"step": "registry version", "key": "demo v3", "mlflow_run": "run0", "detail": "alias challenger"}]
    sections = Sections(plots={"quality deltas": plot}, lineage=lineage)
    md = markdown("demo", outcome, evidence, {}, sections)
    titles = re.findall(r"^## (.+)$", md, flags=re.M)
    assert titles == ["Checks", "Plots", "Memory and cost", "Metrics", "Lineage"]
    assert "`plots/quality_deltas.png`" in md and "| artifact size on disk (what optimize wrote) | 400.0 MB | 100.0 MB | 0.25x |" in md
    page = html_page("kiln: demo", outcome, evidence, sections)
    (data,) = re.findall(r'src="data:image/png;base64,([^"]+)"', page)
    assert base64.b64decode(data) == plot.read_bytes()
    assert page.index("<h2>Checks</h2>") < page.index("<h2>Plots</h2>") < page.index("<h2>Lineage</h2>")
    assert "demo v3" in page and "abc123" in page
