"""A figure as a person reads it: a metric's value with its unit (core/metrics.py declares most units;
the rest follow kiln's naming: `*_bytes`, `*_s`, `*_ms`). One place, so the console, the report and
`kiln show` never print `size_bytes=5.416e+08` where a reader wants 541.6 MB.

Sizes on disk are decimal (MB, GB: what `ls -h --si` and a model card say); memory is binary (MiB, GiB:
what the kernel and `free` report); a fraction is a percentage."""

from __future__ import annotations

from kiln.core.metrics import METRICS

MEMORY = ("rss", "pss", "memory", "ram")  # a `*_bytes` name holding one of these is memory, not a size


def amount(name: str, value: float | None) -> str:
    """`value` of the metric `name`, with its unit: "541.6 MB", "263.8 MiB", "110.7 tok/s", "96.1%". A role's
    figure (`baseline.decode_tok_s`) reads as its metric's."""
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
