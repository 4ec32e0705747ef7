"""Decode-ceiling tables: the seed essay's worked example, and the demo model on this machine.

1. Reproduces the essay's table (8B model, 16-bit, H100 SXM 3.35 TB/s, 0.27 GB KV per sequence,
   $3/h) and checks it digit for digit against the essay's printed output.
2. Measures this machine's memory bandwidth (numpy copies) and predicts the decode ceiling of
   the demo model (SmolLM2-135M: 134.5M params, 30 layers, 3 KV heads, head_dim 64) in fp32 and
   int8 weights at 512 tokens of context. Pass `--measured-tpot-ms 1=25.0,8=40.0` to put
   measured TPOTs beside the ceiling and get MBU and a reading of the gap.

Writes bench/results/roofline_table.json and prints the tables.
"""

from __future__ import annotations

import argparse
import platform
from pathlib import Path

from kiln.evaluate.roofline import (
    DATASHEET_GB_S,
    ceiling_table,
    explain_gap,
    format_table,
    kv_bytes_per_token,
    measure_bandwidth,
)
from kiln.core.files import atomic_write_json

OUT = Path(__file__).parent / "results" / "roofline_table.json"
ESSAY = """\
batch   1:  206 tok/s per user,   206 tok/s total, $4.05 per 1M tokens
batch   8:  184 tok/s per user,  1476 tok/s total, $0.56 per 1M tokens
batch  64:  101 tok/s per user,  6442 tok/s total, $0.13 per 1M tokens"""
DEMO = {"params": 134.5e6, "num_layers": 30, "num_kv_heads": 3, "head_dim": 64}


def parse_measured(text: str | None) -> dict[int, float]:
    if not text:
        return {}
    return {int(b): float(ms) for b, ms in (pair.split("=") for pair in text.split(","))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bandwidth-gb-s", type=float, help="skip the measurement and use this bandwidth")
    ap.add_argument("--context", type=int, default=512, help="tokens of context per sequence (demo table)")
    ap.add_argument("--measured-tpot-ms", help="batch=ms pairs measured on the fp32 demo engine, e.g. 1=25,8=40")
    args = ap.parse_args()

    essay_rows = ceiling_table(16e9, 0.27e9, DATASHEET_GB_S["H100-SXM"], (1, 8, 64), price_per_hour=3.0)
    essay_text = format_table(essay_rows)
    print("Seed essay: 8B, 16-bit, H100 SXM (3.35 TB/s), 0.27 GB KV/sequence, $3/h")
    print(essay_text)
    print("matches the essay exactly" if essay_text == ESSAY else "DOES NOT MATCH the essay")

    bw = args.bandwidth_gb_s or measure_bandwidth()
    kv_seq = kv_bytes_per_token(DEMO["num_layers"], DEMO["num_kv_heads"], DEMO["head_dim"], 4) * args.context
    measured = parse_measured(args.measured_tpot_ms)
    demo = {}
    for name, bytes_per_param in (("fp32", 4), ("int8", 1)):
        rows = ceiling_table(
            DEMO["params"] * bytes_per_param,
            kv_seq,
            bw,
            (1, 4, 8, 16),
            measured_tpot_ms=measured if name == "fp32" else None,
        )
        print(
            f"\nDemo model SmolLM2-135M, {name} weights, fp32 KV, {args.context} tokens of context, "
            f"{bw:.1f} GB/s {'(given)' if args.bandwidth_gb_s else '(measured: numpy copy, noisy on a shared VM)'}"
        )
        print(format_table(rows))
        for r in rows:
            if r.measured_tpot_ms:
                print("  " + explain_gap(r))
        demo[name] = [vars(r) | {"mbu": r.mbu} for r in rows]

    atomic_write_json(
        OUT,
        {
            "essay": {"rows": [vars(r) for r in essay_rows], "text": essay_text, "matches": essay_text == ESSAY},
            "bandwidth_gb_s": bw,
            "bandwidth_measured": args.bandwidth_gb_s is None,
            "demo_context_tokens": args.context,
            "demo": demo,
            "machine": platform.platform(),
        },
    )
    print(f"\nwrote {OUT}")


if __name__ == "__main__":
    main()
