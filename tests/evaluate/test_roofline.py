"""The decode-ceiling model, checked against the seed essay's worked table to the digit."""

from __future__ import annotations

import math

import pytest

from kiln.evaluate.roofline import (
    CeilingRow,
    ceiling_table,
    decode_ceiling,
    explain_gap,
    format_table,
    kv_bytes_per_token,
    manifest_bytes,
    manifest_ceiling,
    measure_bandwidth,
)
from kiln.core.errors import BadInput

# The essay (shared/seeds/004): an 8B model in 16-bit on one H100 SXM (3.35 TB/s), 0.27 GB of KV
# cache per sequence, $3 per GPU-hour. Its printed output, verbatim:
ESSAY_TABLE = """\
batch   1:  206 tok/s per user,   206 tok/s total, $4.05 per 1M tokens
batch   8:  184 tok/s per user,  1476 tok/s total, $0.56 per 1M tokens
batch  64:  101 tok/s per user,  6442 tok/s total, $0.13 per 1M tokens"""


def test_reproduces_the_essay_table_exactly():
    rows = ceiling_table(
        weight_bytes=8e9 * 2, kv_bytes_per_sequence=0.27e9, bandwidth_gb_s=3350, batches=(1, 8, 64), price_per_hour=3.0
    )
    assert format_table(rows) == ESSAY_TABLE
    # And the essay's prose: reading the 16 GB of weights takes about 4.8 ms; batch 64
    # multiplies throughput by about 31 while each stream slows from ~206 to ~101 tok/s.
    assert decode_ceiling(16e9, 0.0, 3.35e12).step_ms == pytest.approx(4.8, abs=0.05)
    assert rows[2].tokens_per_s_total / rows[0].tokens_per_s_total == pytest.approx(31, abs=0.5)


def test_kv_bytes_per_token_llama31_8b():
    # 32 layers, 8 KV heads, head_dim 128, bf16: the essay's "about 128 KB per token".
    assert kv_bytes_per_token(32, 8, 128, 2) == 128 * 1024
    # 2,000 tokens of context: 0.26 GB, the essay's "about 0.27 GB".
    assert kv_bytes_per_token(32, 8, 128, 2) * 2000 / 1e9 == pytest.approx(0.27, abs=0.01)


def test_manifest_forms():
    full = {
        "params": 8e9,
        "bytes_per_param": 2,
        "num_layers": 32,
        "num_kv_heads": 8,
        "head_dim": 128,
        "kv_dtype": "bfloat16",
    }
    assert manifest_bytes(full) == (16e9, 131072)
    assert manifest_bytes({"weight_bytes": 5, "kv_bytes_per_token": 7}) == (5, 7)
    rows = manifest_ceiling(full, context_tokens=2000, bandwidth_gb_s=3350, batches=(1,))
    assert rows[0].tokens_per_s_per_user == pytest.approx(3350e9 / (16e9 + 131072 * 2000))
    with pytest.raises(BadInput, match="weight_bytes"):
        manifest_bytes({"num_layers": 2})
    with pytest.raises(BadInput, match="num_kv_heads, head_dim"):
        manifest_bytes({"weight_bytes": 1, "num_layers": 2, "kv_bytes_per_element": 2})


def test_mbu_and_gap_text():
    rows = ceiling_table(16e9, 0.27e9, 3350, (1, 8), measured_tpot_ms={1: 9.71})
    assert rows[0].mbu == pytest.approx(rows[0].step_ms / 9.71) and rows[1].mbu is None
    assert "MBU 50%" in explain_gap(rows[0]) and "tuned engine" in explain_gap(rows[0])
    assert "no measurement" in explain_gap(rows[1])
    slow = CeilingRow(1, 5.0, 200, 200, measured_tpot_ms=50.0)
    assert "overhead" in explain_gap(slow)
    fast = CeilingRow(1, 5.0, 200, 200, measured_tpot_ms=4.0)
    assert "Faster than the bandwidth allows" in explain_gap(fast)
    assert "measured TPOT 9.71 ms" in format_table(rows)


def test_measure_bandwidth_is_a_positive_rate():
    gb_s = measure_bandwidth(size_mb=16, repeats=2)
    assert math.isfinite(gb_s) and 0.1 < gb_s < 10_000
