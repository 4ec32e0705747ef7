"""The report's figures: quality deltas from the gate, and the load stage's plots gathered beside it.

Figures are PNG files under `<run dir>/plots/` (the Markdown report names them, the parent MLflow
run holds them); the HTML report embeds the same files as base64, so it stands alone.
"""

from __future__ import annotations

import base64
import html
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from kiln.core.gate.base import CheckResult

VERDICT_COLORS = {"Successful": "#1a7f37", "Failed": "#cf222e", "Inconclusive": "#9a6700", "Error": "#6e7781"}
LOAD_PLOTS = {"latency_vs_rate.png": "TTFT and TPOT vs rate", "latency_throughput.png": "latency-throughput curve",
              "ceiling_vs_measured.png": "decode ceiling vs measured"}


def quality_deltas(results: Sequence[CheckResult], checks: Mapping[str, Any], path: Path) -> Path | None:
    """One row per quality check: its drop with the confidence interval, and the margin line.

    `checks` maps a check's label to its config (for the margin and whether it is relative).
    None when the gate has no quality check with an interval.
    """
    rows = [(r, checks[r.name], (r.drop, *r.drop_ci)) for r in results
            if r.kind == "quality" and r.name in checks and r.drop is not None and r.drop_ci]
    if not rows:
        return None
    fig = Figure(figsize=(7, 0.3 + 1.6 * len(rows)))
    for ax, (r, cfg, (drop, low, high)) in zip(fig.subplots(len(rows), 1, squeeze=False)[:, 0], rows):
        color = VERDICT_COLORS[r.verdict.value]
        # A relative drop reads as the report gives it, in percent of the baseline (-0.80%, not -0.00799).
        scale, unit = (100, "%") if cfg.relative else (1, "")
        drop, low, high, margin = drop * scale, low * scale, high * scale, cfg.margin * scale
        ax.errorbar([drop], [0], xerr=[[drop - low], [high - drop]], fmt="o", color=color, capsize=6)
        ax.axvline(margin, color="#cf222e", linestyle="--", label=f"margin {margin:g}{unit}")
        ax.axvline(0, color="#888", linewidth=0.8)
        span = max(abs(low), abs(high), margin) * 1.3 or 1.0
        ax.set_xlim(min(low, 0) - 0.1 * span, span)
        ax.set_yticks([])
        ax.set_title(f"{r.name}: drop {drop:+.3g}{unit} [{low:+.3g}{unit}, {high:+.3g}{unit}] — {r.verdict.value}",
                     fontsize=9, color=color)
        ax.legend(fontsize=7, loc="lower right")
        ax.grid(alpha=0.3, axis="x")
        ax.set_xlabel(f"drop{' in % of the baseline' if unit else ''} (candidate worse →) with its confidence interval",
                      fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return path


def pareto(search: Mapping[str, Any], path: Path) -> Path | None:
    """Every candidate that reached the benchmark: perplexity change (worse ↑) against speed-up,
    coloured by verdict, the winner ringed; the front is the upper left to lower right edge."""
    points = [(c, c["confirmed"] or c["screened"], c["perplexity"]) for c in search["candidates"]]
    unplotted = [c for c, s, q in points if not (s and q)]
    points = [(c, s, q) for c, s, q in points if s and q]
    if not points:
        return None
    fig = Figure(figsize=(7, 4.5))
    ax = fig.subplots()
    for c, speed, ppl in points:
        color = VERDICT_COLORS.get(c["verdict"] or "Error", "#6e7781")
        ax.errorbar([speed["ratio"]], [100 * ppl["change"]], fmt="o", color=color, capsize=4,
                    xerr=[[speed["ratio"] - speed["low"]], [speed["high"] - speed["ratio"]]],
                    yerr=[[100 * (ppl["change"] - ppl["low"])], [100 * (ppl["high"] - ppl["change"])]])
        if c["name"] == search["winner"]:
            ax.plot([speed["ratio"]], [100 * ppl["change"]], "o", markersize=16, fillstyle="none", color=color)
        ax.annotate(c["name"], (speed["ratio"], 100 * ppl["change"]), textcoords="offset points", xytext=(6, 6), fontsize=8)
    ax.axvline(1.0, color="#888", linewidth=0.8)
    ax.axhline(0.0, color="#888", linewidth=0.8)
    at = f"{search['confidence']:.2%}".replace(".00%", "%")  # the confidence the verdicts were taken at
    ax.set_xlabel(f"speed-up over the baseline ({search['objective']}), {at} interval")
    ax.set_ylabel("perplexity change, % (worse ↑)")
    ax.set_title("the search: every candidate against the baseline", fontsize=10)
    if unplotted:  # stopped before the benchmark: no speed to place them by
        ax.text(0.01, 0.01, "stopped before the speed benchmark: " + "; ".join(
            c["name"] + (f" (perplexity {c['perplexity']['change']:+.1%})" if c["perplexity"] else "")
            for c in unplotted), transform=ax.transAxes, fontsize=7, color="#6e7781", va="bottom")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return path


def gather(run_dir: Path, results: Sequence[CheckResult], checks: Mapping[str, Any],
           load_dir: Path | None) -> dict[str, Path]:
    """Every report figure as title -> PNG under `run_dir/plots`: quality deltas, then load plots."""
    plots = {}
    if path := quality_deltas(results, checks, run_dir / "plots" / "quality_deltas.png"):
        plots["quality deltas"] = path
    for name, title in LOAD_PLOTS.items():
        if load_dir and (load_dir / "plots" / name).is_file():
            (run_dir / "plots").mkdir(exist_ok=True)  # a gate without quality checks drew nothing before
            plots[title] = Path(shutil.copy2(load_dir / "plots" / name, run_dir / "plots" / name))
    return plots


def embedded(title: str, path: Path) -> str:
    """An <img> carrying the PNG itself, so the HTML report needs no other file."""
    data = base64.b64encode(Path(path).read_bytes()).decode()
    title = html.escape(title)
    return f'<figure><img alt="{title}" src="data:image/png;base64,{data}"><figcaption>{title}</figcaption></figure>'
