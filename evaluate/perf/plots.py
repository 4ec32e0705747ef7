"""Figures of a load test: latency versus load, the latency-throughput curve, ceiling vs measured.

Built on `matplotlib.figure.Figure` directly (no pyplot, no global backend state, renders with
Agg). Each function takes one arm's results or a mapping of arms (baseline and candidate drawn
on the same axes, one colour each), returns the Figure and saves a PNG when given a path.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from kiln.evaluate.perf.metrics import Knee, Summary
from kiln.evaluate.roofline import CeilingRow

Arm = tuple[Sequence[Summary], Knee | None]
COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:purple")


def _arms(data: Sequence[Summary] | Mapping[str, Arm], knee: Knee | None = None) -> dict[str, Arm]:
    """One arm (summaries and knee) or a mapping of named arms, as a mapping."""
    return dict(data) if isinstance(data, Mapping) else {"": (data, knee)}


def _label(arm: str, text: str) -> str:
    return f"{arm} {text}" if arm else text


def _load(s: Summary) -> float:
    """The x position of a stage: the rate actually sent (open loop) or served (closed loop)."""
    return s.achieved_rate if s.target_rate else s.request_throughput


def _save(fig: Figure, path: Path | str | None) -> Figure:
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110, bbox_inches="tight")
    return fig


def latency_vs_rate(data: Sequence[Summary] | Mapping[str, Arm], knee: Knee | None = None,
                    path: Path | str | None = None) -> Figure:
    """TTFT and TPOT (p50, p95) against request rate; each arm's knee as a vertical line."""
    fig = Figure(figsize=(11, 4.2))
    axes = fig.subplots(1, 2)
    for color, (arm, (summaries, arm_knee)) in zip(COLORS, _arms(data, knee).items()):
        done = [s for s in summaries if s.completed]
        open_pts = sorted((s for s in done if s.target_rate), key=_load)
        closed = [s for s in done if not s.target_rate]
        for ax, name, title in zip(axes, ("ttft_ms", "tpot_ms"), ("TTFT", "TPOT")):
            for stat, style in (("p50", "o-"), ("p95", "s--")):
                ax.plot([_load(s) for s in open_pts], [getattr(s, name)[stat] for s in open_pts], style,
                        color=color, alpha=1.0 if stat == "p50" else 0.6, label=_label(arm, f"{stat} (open loop)"))
            for s in closed:  # closed-loop probes are points, not part of the rate curve
                ax.plot([_load(s)], [getattr(s, name)["p50"]], "x", color=color, markersize=8)
                ax.annotate(s.label, (_load(s), getattr(s, name)["p50"]), fontsize=7, color=color,
                            xytext=(3, 3), textcoords="offset points")
            if arm_knee:
                ax.axvline(arm_knee.rate, color=color, linestyle=":",
                           label=_label(arm, f"knee {arm_knee.rate:.3g} req/s"))
    for ax, title in zip(axes, ("TTFT", "TPOT")):
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(f"{title} (ms)")
        ax.set_title(f"{title} vs load (x: closed-loop probe, p50)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return _save(fig, path)


def latency_throughput(data: Sequence[Summary] | Mapping[str, Arm], knee: Knee | None = None,
                       path: Path | str | None = None) -> Figure:
    """Aggregate output tokens/s against each user's tokens/s (1000 / TPOT p50): the trade-off curve."""
    fig = Figure(figsize=(6.5, 4.8))
    ax = fig.subplots()
    for color, (arm, (summaries, arm_knee)) in zip(COLORS, _arms(data, knee).items()):
        # in order of per-user speed: the curve runs from light load (fast users) to heavy load
        pts = sorted((s for s in summaries if s.completed and s.tpot_ms["p50"] > 0), key=lambda s: s.tpot_ms["p50"])
        xs = [1000 / s.tpot_ms["p50"] for s in pts]
        ax.plot(xs, [s.output_token_throughput for s in pts], "o-", color=color, label=_label(arm, "measured"))
        for x, s in zip(xs, pts):
            ax.annotate(s.label, (x, s.output_token_throughput), fontsize=7, color=color,
                        xytext=(3, 3), textcoords="offset points")
            if arm_knee and s.label == arm_knee.label:
                ax.plot([x], [s.output_token_throughput], "*", color="red", markeredgecolor=color, markersize=16,
                        label=_label(arm, f"knee ({arm_knee.rate:.3g} req/s)"))
    ax.set_xlabel("per-user speed (tokens/s)")
    ax.set_ylabel("throughput (output tokens/s)")
    ax.set_title("Latency-throughput trade-off")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return _save(fig, path)


def ceiling_vs_measured(rows: Sequence[CeilingRow] | Mapping[str, Sequence[CeilingRow]],
                        path: Path | str | None = None) -> Figure:
    """Predicted decode ceiling per batch size, with measured TPOT (and MBU) beside it where known."""
    fig = Figure(figsize=(6.5, 4.8))
    ax = fig.subplots()
    arms = dict(rows) if isinstance(rows, Mapping) else {"": rows}
    for i, (color, (arm, arm_rows)) in enumerate(zip(COLORS, arms.items())):
        offset = (3, 4 - 12 * i)  # each arm's labels on their own line, so two arms do not overprint
        ax.plot([r.tokens_per_s_total for r in arm_rows], [r.tokens_per_s_per_user for r in arm_rows], "o-",
                color=color, label=_label(arm, "roofline ceiling"))
        for r in arm_rows:
            ax.annotate(f"b={r.batch}", (r.tokens_per_s_total, r.tokens_per_s_per_user), fontsize=7, color=color,
                        xytext=offset, textcoords="offset points")
        measured = [r for r in arm_rows if r.measured_tpot_ms]
        per_user = [1000 / r.measured_tpot_ms for r in measured]  # type: ignore[operator]
        ax.plot([r.batch * u for r, u in zip(measured, per_user)], per_user, "s--", color=color,
                alpha=0.7, label=_label(arm, "measured (TPOT p50)"))
        for r, u in zip(measured, per_user):
            ax.annotate(f"b={r.batch} MBU {r.mbu:.0%}", (r.batch * u, u), fontsize=7, color=color,
                        xytext=offset, textcoords="offset points")
    ax.set_xscale("log")
    ax.set_yscale("log")
    for axis in (ax.xaxis, ax.yaxis):  # log scales with plain numbers, not 4x10^2
        axis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        axis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("aggregate tokens/s")
    ax.set_ylabel("tokens/s per user")
    ax.set_title("Decode ceiling (roofline) vs measured")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    return _save(fig, path)


def result_figures(data: Sequence[Summary] | Mapping[str, Arm], knee: Knee | None = None,
                   out_dir: Path | str | None = None) -> dict[str, Any]:
    """Both load figures, saved as PNGs under `out_dir` when given."""
    d = Path(out_dir) if out_dir is not None else None
    return {
        "latency_vs_rate": latency_vs_rate(data, knee, d / "latency_vs_rate.png" if d else None),
        "latency_throughput": latency_throughput(data, knee, d / "latency_throughput.png" if d else None),
    }
