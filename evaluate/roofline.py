"""Decode-ceiling prediction (the roofline for memory-bound decode), put beside measurement.

Every decode step reads all the weights once plus each sequence's KV cache, so with peak memory
bandwidth B the fastest a step can be is

    step_time = (weight_bytes + batch * kv_bytes_per_sequence) / B
    kv_bytes_per_sequence = context_tokens * 2 * layers * kv_heads * head_dim * bytes_per_element

giving 1 / step_time tokens/s per user and batch / step_time in aggregate. A measured TPOT turns
into achieved bandwidth (bytes per step / TPOT); over peak, that is MBU. The gap is what the
engine loses to everything that is not streaming bytes: launches, attention math, sampling,
scheduling, the host.

The bandwidth is either a datasheet value (`DATASHEET_GB_S`) or measured on this machine with
`measure_bandwidth()` (numpy copies; a CPU engine's ceiling).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kiln.core.units import DEFAULT_CURRENCY, money
from kiln.evaluate.capacity import cost_per_million
from kiln.core.errors import BadInput

# Peak HBM bandwidth, GB/s (vendor datasheets).
DATASHEET_GB_S = {
    "A100-40GB": 1555.0,
    "A100-80GB-SXM": 2039.0,
    "L4": 300.0,
    "L40S": 864.0,
    "H100-PCIe": 2000.0,
    "H100-SXM": 3350.0,
    "H200": 4800.0,
    "B200": 8000.0,
}
_DTYPE_BYTES = {
    "float32": 4,
    "fp32": 4,
    "float16": 2,
    "fp16": 2,
    "bfloat16": 2,
    "bf16": 2,
    "float8": 1,
    "fp8": 1,
    "int8": 1,
    "int4": 0.5,
}


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, bytes_per_element: float) -> float:
    """K and V for one token across all layers: 2 x layers x kv_heads x head_dim x bytes."""
    return 2 * layers * kv_heads * head_dim * bytes_per_element


def manifest_bytes(manifest: Mapping[str, Any]) -> tuple[float, float]:
    """(weight bytes read per step, KV bytes per token) from an engine manifest-like dict.

    Accepts `weight_bytes` or `params` with `bytes_per_param`; and `kv_bytes_per_token` or
    `num_layers`, `num_kv_heads`, `head_dim` with `kv_bytes_per_element` or `kv_dtype`.
    """
    m = dict(manifest)
    if "weight_bytes" in m:
        weights = float(m["weight_bytes"])
    elif "params" in m and "bytes_per_param" in m:
        weights = float(m["params"]) * float(m["bytes_per_param"])
    else:
        raise BadInput("engine manifest: give 'weight_bytes', or 'params' and 'bytes_per_param', for the roofline")
    if "kv_bytes_per_token" in m:
        return weights, float(m["kv_bytes_per_token"])
    missing = [k for k in ("num_layers", "num_kv_heads", "head_dim") if k not in m]
    per_el = m.get("kv_bytes_per_element", _DTYPE_BYTES.get(str(m.get("kv_dtype", "")).replace("torch.", "")))
    if missing or per_el is None:
        need = missing + ([] if per_el is not None else ["kv_bytes_per_element (or a known kv_dtype)"])
        raise BadInput(
            f"engine manifest: missing {', '.join(need)} for KV bytes per token (or give 'kv_bytes_per_token')"
        )
    return weights, kv_bytes_per_token(int(m["num_layers"]), int(m["num_kv_heads"]), int(m["head_dim"]), float(per_el))


@dataclass
class CeilingRow:
    batch: int
    step_ms: float
    tokens_per_s_per_user: float
    tokens_per_s_total: float
    cost_per_1m_tokens: float | None = None
    measured_tpot_ms: float | None = None

    @property
    def mbu(self) -> float | None:
        """Achieved / peak bandwidth = ceiling step time / measured step time (TPOT)."""
        return self.step_ms / self.measured_tpot_ms if self.measured_tpot_ms else None


def decode_ceiling(
    weight_bytes: float,
    kv_bytes_per_sequence: float,
    bandwidth_bytes_per_s: float,
    batch: int = 1,
    price_per_hour: float | None = None,
) -> CeilingRow:
    step_s = (weight_bytes + batch * kv_bytes_per_sequence) / bandwidth_bytes_per_s
    total = batch / step_s
    return CeilingRow(batch, step_s * 1000, 1 / step_s, total, cost_per_million(price_per_hour, total))


def ceiling_table(
    weight_bytes: float,
    kv_bytes_per_sequence: float,
    bandwidth_gb_s: float,
    batches: Sequence[int] = (1, 8, 64),
    price_per_hour: float | None = None,
    measured_tpot_ms: Mapping[int, float] | None = None,
) -> list[CeilingRow]:
    """One row per batch size; `measured_tpot_ms` (batch -> TPOT) fills the measured column."""
    rows = [
        decode_ceiling(weight_bytes, kv_bytes_per_sequence, bandwidth_gb_s * 1e9, b, price_per_hour) for b in batches
    ]
    for r in rows:
        r.measured_tpot_ms = (measured_tpot_ms or {}).get(r.batch)
    return rows


def manifest_ceiling(
    manifest: Mapping[str, Any], context_tokens: int, bandwidth_gb_s: float, **kw: Any
) -> list[CeilingRow]:
    weights, kv_token = manifest_bytes(manifest)
    return ceiling_table(weights, kv_token * context_tokens, bandwidth_gb_s, **kw)


def format_table(rows: Sequence[CeilingRow], currency: str = DEFAULT_CURRENCY) -> str:
    """Rows in the seed essay's layout, plus measured TPOT and MBU where known; costs in `currency`."""
    out = []
    for r in rows:
        line = f"batch {r.batch:>3}: {r.tokens_per_s_per_user:4.0f} tok/s per user, "
        line += f"{r.tokens_per_s_total:5.0f} tok/s total"
        if r.cost_per_1m_tokens is not None:
            line += f", {money(r.cost_per_1m_tokens, currency)} per 1M tokens"
        if r.measured_tpot_ms:
            line += f" | measured TPOT {r.measured_tpot_ms:.2f} ms vs ceiling {r.step_ms:.2f} ms, MBU {r.mbu:.0%}"
        out.append(line)
    return "\n".join(out)


def explain_gap(row: CeilingRow) -> str:
    """A short reading of measured versus ceiling for one batch size."""
    if not row.measured_tpot_ms or row.mbu is None:
        return f"batch {row.batch}: ceiling {row.tokens_per_s_per_user:.0f} tok/s per user; no measurement to compare."
    head = (
        f"batch {row.batch}: measured {1000 / row.measured_tpot_ms:.0f} tok/s per user against a ceiling of "
        f"{row.tokens_per_s_per_user:.0f} (MBU {row.mbu:.0%}). "
    )
    if row.mbu > 1.05:
        return head + (
            "Faster than the bandwidth allows: the bytes per step are overstated (weights cached on chip, "
            "smaller KV than assumed, speculative tokens) or the bandwidth figure is too low."
        )
    if row.mbu >= 0.7:
        return head + (
            "Close to the roofline: decode is streaming memory nearly flat out; "
            "only fewer bytes per token (quantization, smaller KV) will help."
        )
    if row.mbu >= 0.4:
        return head + (
            "Typical of a tuned engine: the rest goes to attention math, kernel launches and sampling. "
            "CUDA graphs, fused kernels or larger batches close some of it."
        )
    return head + (
        "Far below the roofline: per-step overhead (framework, launches, host-side scheduling, "
        "unfused or compute-bound kernels, thread contention on CPU) dominates, not memory traffic."
    )


def measure_bandwidth(size_mb: int = 256, repeats: int = 5) -> float:
    """Memory bandwidth of this machine in GB/s: best of `repeats` numpy copies of `size_mb`.

    A copy reads and writes each byte, so it moves 2 x size per pass. Noisy on a shared VM:
    report it beside the result, do not hard-code it.
    """
    import numpy as np

    src = np.ones(size_mb * 2**20 // 8, dtype=np.float64)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # touch the pages once so first-touch faults do not count
    best = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.nbytes / best / 1e9
