"""A figure as a person reads it: a metric's value with its unit (core/metrics.py declares most units;
the rest follow kiln's naming: `*_bytes`, `*_s`, `*_ms`). One place, so the console, the report and
`kiln show` never print `size_bytes=5.416e+08` where a reader wants 541.6 MB.

Sizes on disk are decimal (MB, GB: what `ls -h --si` and a model card say); memory is binary (MiB, GiB:
what the kernel and `free` report); a fraction is a percentage; money is in the recipe's `currency`
(`money`), a speed-up a ratio ("7.32x"). Machine-read outputs (JSON, MLflow metrics) keep full precision;
these strings are for people."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from kiln.core.metrics import METRICS

MEMORY = ("rss", "pss", "memory", "ram")  # a `*_bytes` name holding one of these is memory, not a size
DEFAULT_CURRENCY = "USD"  # the recipe's `currency` when it names none
# ISO 4217 codes shown as the symbol a reader expects in front of the figure; any other code follows it
# ("12.50 CHF"), and a symbol given as the currency is put in front as it is.
SYMBOLS = {"USD": "$", "EUR": "€", "GBP": "£", "JPY": "¥", "CNY": "¥", "INR": "₹", "KRW": "₩"}


def amount(name: str, value: float | None, currency: str = DEFAULT_CURRENCY) -> str:
    """`value` of the metric `name`, with its unit: "541.6 MB", "263.8 MiB", "110.7 tok/s", "96.1%", "$0.24" (a
    price in `currency`). A role's figure (`baseline.decode_tok_s`) reads as its metric's."""
    name = name.rsplit(".", 1)[-1]
    if value is None:
        return "—"
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    unit = METRICS[name].unit if name in METRICS else ""
    if name.endswith("_bytes") or unit == "bytes":
        return _memory(value) if any(m in name for m in MEMORY) else _size(value)
    if unit == "fraction":
        return f"{value:.1%}"
    if unit == "currency":  # a price: in the recipe's `currency`
        return money(value, currency)
    if unit in ("ms", "nats") or unit.endswith("/s"):
        return f"{number(value)} {unit}"
    if name.endswith("_ms"):
        return f"{number(value)} ms"
    if name.endswith("_s") and not name.endswith("tok_s"):
        return f"{number(value)} s"
    return f"{number(value)} {unit}".rstrip()


def number(value: float) -> str:
    """Four significant figures, never in e-notation below a trillion: 0.0003473, 66.42, 1,019."""
    if value == 0 or 1e-4 <= abs(value) < 1e4:
        return f"{value:.4g}"
    if 1e4 <= abs(value) < 1e12:
        return f"{value:,.0f}"
    return f"{value:.3e}"


def money(value: float | None, currency: str = DEFAULT_CURRENCY) -> str:
    """A price as people write it: "$0.24", "€3.00", "12.50 CHF", "$24,090" (from a thousand on, cents no
    longer matter); below a cent, two significant figures ("$0.0024"), so a cheap token never reads as $0.00."""
    if value is None:
        return "—"
    if abs(value) >= 1000:
        digits = f"{abs(value):,.0f}"
    elif abs(value) >= 0.01:
        digits = f"{abs(value):,.2f}"
    else:
        digits = f"{abs(value):.2g}"
    sign = "-" if value < 0 else ""
    symbol = SYMBOLS.get(currency, currency if not currency.isalpha() else None)
    return f"{sign}{symbol}{digits}" if symbol else f"{sign}{digits} {currency}"


def currency_problem(currency: str) -> str | None:
    """Why `currency` cannot be shown (None when it can): an ISO 4217 code or a symbol, nothing else."""
    if re.fullmatch(r"[A-Z]{3}|[^\w\s]{1,3}", currency):
        return None
    return (f"{currency!r} is neither an ISO 4217 code (three capitals: USD, EUR, GBP) nor a currency symbol "
            "($, €, £); write e.g. EUR")


def ratio(value: float | None) -> str:
    """A speed-up or any candidate / baseline ratio: "7.32x", "0.96x"."""
    return "—" if value is None else f"{value:.3g}x"


def check_figures(check: Mapping[str, Any]) -> tuple[str, str, str]:
    """A gate check's (candidate, baseline, interval) as the report and the pull-request comment show them
    (`check`: kiln.core.gate.base.CheckResult.to_dict()): a speed check's ratio as 7.32x, a quality check's
    drop in percent of the baseline when its margin is relative, every other figure in its metric's unit."""
    metric, threshold = check.get("metric") or "", str(check.get("threshold") or "")
    speedup = check.get("kind") == "performance" and threshold.startswith("ratio")

    def figure(v: float | None) -> str:
        return ratio(v) if speedup else amount(metric, v)

    def drop(v: float) -> str:  # in the margin's terms: a relative margin is a share of the baseline
        return f"{v:.2%}" if "(relative)" in threshold else number(v)

    low_high = check.get("drop_ci") or check.get("ci")
    interval = "—" if not low_high else (f"drop [{drop(low_high[0])}, {drop(low_high[1])}]" if check.get("drop_ci")
                                         else f"[{figure(low_high[0])}, {figure(low_high[1])}]")
    return figure(check.get("observed")), figure(check.get("baseline")), interval


def _size(value: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:,.1f} {unit}"
    return f"{value:.0f} B"


def _memory(value: float) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if abs(value) >= 1 << shift:
            return f"{value / (1 << shift):,.1f} {unit}"
    return f"{value:.0f} B"
