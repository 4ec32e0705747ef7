"""Figures of a load test: latency versus load, the latency-throughput curve, ceiling vs measured.

Built on `matplotlib.figure.Figure` directly (no pyplot, no global backend state, renders with
Agg). Each function returns the Figure (the lead logs it to MLflow) and saves a PNG when given
a path.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from matplotlib.figure import Figure

from kiln.evaluate.perf.metrics import Knee, Summary
from kiln.evaluate.roofline import CeilingRow


def _load(s: Summary) -> float:
    """The x position of a stage: the rate actually sent (open loop) or served (closed loop)."""
    return s.achieved_rate if s.target_rate else s.request_throughput


def _save(fig: Figure, path: Path | str | None) -> Figure:
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120, bbox_inches="tight")
    return fig


def latency_vs_rate(summaries: Sequence[Summary], knee: Knee | None = None, path: Path | str | None = None) -> Figure:
    """TTFT and TPOT (p50, p95) against request rate; the knee as a vertical line."""
    done = [s for s in summaries if s.completed]
    open_pts = sorted((s for s in done if s.target_rate), key=_load)
    closed = [s for s in done if not s.target_rate]
    fig = Figure(figsize=(10, 4))
    for ax, name, title in zip(fig.subplots(1, 2), ("ttft_ms", "tpot_ms"), ("TTFT", "TPOT")):
        for stat, style in (("p50", "o-"), ("p95", "s--")):
            ax.plot(
                [_load(s) for s in open_pts],
                [getattr(s, name)[stat] for s in open_pts],
                style,
                label=f"{title} {stat} (open loop)",
            )
        for s in closed:  # closed-loop probes are points, not part of the rate curve
            ax.plot([_load(s)], [getattr(s, name)["p50"]], "kx")
            ax.annotate(
                s.label, (_load(s), getattr(s, name)["p50"]), fontsize=7, xytext=(3, 3), textcoords="offset points"
            )
        if knee:
            ax.axvline(knee.rate, color="red", linestyle=":", label=f"knee {knee.rate:.3g} req/s")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(f"{title} (ms)")
        ax.set_title(f"{title} vs load")
        ax.grid(alpha=0.3)
        ax.legend()
    return _save(fig, path)


def latency_throughput(
    summaries: Sequence[Summary], knee: Knee | None = None, path: Path | str | None = None
) -> Figure:
    """Aggregate output tokens/s against each user's tokens/s (1000 / TPOT p50): the trade-off curve."""
    pts = sorted(
        (s for s in summaries if s.completed and s.tpot_ms["p50"] > 0), key=lambda s: s.output_token_throughput
    )
    fig = Figure(figsize=(6, 4.5))
    ax = fig.subplots()
    xs = [1000 / s.tpot_ms["p50"] for s in pts]
    ax.plot(xs, [s.output_token_throughput for s in pts], "o-", label="measured")
    for x, s in zip(xs, pts):
        ax.annotate(s.label, (x, s.output_token_throughput), fontsize=7, xytext=(3, 3), textcoords="offset points")
        if knee and s.label == knee.label:
            ax.plot([x], [s.output_token_throughput], "r*", markersize=16, label=f"knee ({knee.rate:.3g} req/s)")
    ax.set_xlabel("per-user speed (tokens/s)")
    ax.set_ylabel("throughput (output tokens/s)")
    ax.set_title("Latency-throughput trade-off")
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)


def ceiling_vs_measured(rows: Sequence[CeilingRow], path: Path | str | None = None) -> Figure:
    """Predicted decode ceiling per batch size, with measured TPOT beside it where known."""
    fig = Figure(figsize=(6, 4.5))
    ax = fig.subplots()
    ax.plot(
        [r.tokens_per_s_total for r in rows], [r.tokens_per_s_per_user for r in rows], "o-", label="roofline ceiling"
    )
    measured = [r for r in rows if r.measured_tpot_ms]
    if measured:
        per_user = [1000 / r.measured_tpot_ms for r in measured]  # type: ignore[operator]
        ax.plot([r.batch * u for r, u in zip(measured, per_user)], per_user, "s--", label="measured")
    for r in rows:
        ax.annotate(
            f"b={r.batch}",
            (r.tokens_per_s_total, r.tokens_per_s_per_user),
            fontsize=7,
            xytext=(3, 3),
            textcoords="offset points",
        )
    ax.set_xscale("log")
    ax.set_xlabel("aggregate tokens/s")
    ax.set_ylabel("tokens/s per user")
    ax.set_title("Decode ceiling vs measured")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    return _save(fig, path)


def result_figures(
    summaries: Sequence[Summary], knee: Knee | None, out_dir: Path | str | None = None
) -> dict[str, Figure]:
    """Both load figures, saved as PNGs under `out_dir` when given."""
    d = Path(out_dir) if out_dir is not None else None
    return {
        "latency_vs_rate": latency_vs_rate(summaries, knee, d / "latency_vs_rate.png" if d else None),
        "latency_throughput": latency_throughput(summaries, knee, d / "latency_throughput.png" if d else None),
    }
