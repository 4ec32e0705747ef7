"""kiln's CPU engine backends side by side on the demo model, with torch fp32 as the reference row.

For each backend x precision: TTFT of a 512-token prompt, decode tok/s at batch 1 and batch 8
(prefill excluded), peak RSS, MBU = weight bytes read per decode step x steps/s / measured
bandwidth, and the speed-up over torch fp32. Bandwidth and the decode-rate method are the ones
bench/engines.py uses (numpy copy over the engine's thread count), so every row is measured the
same way. Engines are built once into kiln's engine cache (OpenVINO/CTranslate2 conversion takes
minutes) and each variant runs in its own process, so peak RSS is its own. Variants run in
`--repeats` rounds in alternating order and each metric keeps its best round: the machine is
shared and noisy, so compare rows of one run, never across runs.

    python bench/cpu_engines.py                      # all default variants, 2 threads
    python bench/cpu_engines.py --only torch-fp32 --only ov-int8 --repeats 1

Writes bench/results/cpu_engines.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
import engines as common  # noqa: E402  (bench/engines.py: bandwidth, decode-rate method)

OUT = Path(__file__).parent / "results" / "cpu_engines.json"
VARIANTS = {
    "torch-fp32": {"backend": "torch", "dtype": "float32"},
    "ov-fp32": {"backend": "openvino", "weights": "fp32"},
    "ov-int8": {"backend": "openvino", "weights": "int8"},
    "ov-int4": {"backend": "openvino", "weights": "int4"},
    "ct2-fp32": {"backend": "ctranslate2", "quantization": "float32"},
    "ct2-int8f32": {"backend": "ctranslate2", "quantization": "int8_float32"},
    "ct2-int8": {"backend": "ctranslate2", "quantization": "int8"},
}


def measure(label: str, checkpoint: Path, threads: int, decode_tokens: int) -> dict[str, Any]:
    """Child process: build (cached), load, measure one variant."""
    import random

    # Registers the backends even before kiln.engine's __init__ imports them.
    import kiln.engine.ctranslate2  # noqa: F401
    import kiln.engine.openvino  # noqa: F401
    from kiln.engine.base import GenerationRequest
    from kiln.engine.cache import build_engine
    from kiln.engine.loader import engine_config, load_engine
    from kiln.pipeline.demo import cache_root
    from kiln.pipeline.files import cached_tree_hash

    config = engine_config({"config": VARIANTS[label]})
    started = time.perf_counter()
    checkpoint_hash = cached_tree_hash(checkpoint, cache_root() / "hashes.json")
    engine_dir = build_engine(config, checkpoint, checkpoint_hash, cache_root())
    build_s = time.perf_counter() - started
    started = time.perf_counter()
    engine = load_engine(engine_dir, threads=threads)
    load_s = time.perf_counter() - started
    rng = random.Random(0)
    prompt = lambda n: [rng.randrange(100, len(engine.tokenizer) - 100) for _ in range(n)]  # noqa: E731
    list(engine.generate([GenerationRequest(prompt(32), 4, ignore_eos=True)]))  # warm-up
    ttfts = []
    for _ in range(3):
        start = time.perf_counter()
        ttfts.append(next(engine.generate([GenerationRequest(prompt(512), 1)])).time - start)
        while engine.has_work():
            engine.step()
    b1 = common._decode_rate(engine, [prompt(16)], decode_tokens)
    b8 = common._decode_rate(engine, [prompt(16) for _ in range(8)], decode_tokens)
    weight_bytes = engine.manifest["build"].get("weight_bytes") or common.weight_bytes(engine, checkpoint)
    engine.close()
    return {"label": label, "config": config.model_dump(mode="json"), "engine_dir": str(engine_dir),
            "build_or_cache_s": round(build_s, 1), "load_s": round(load_s, 2),
            "ttft_512_ms": round(statistics.median(ttfts) * 1000, 1), "decode_tok_s_b1": round(b1, 2),
            "decode_tok_s_b8": round(b8, 2), "weight_bytes": weight_bytes,
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}


def run_child(label: str, args) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", label, "--model", str(args.model),
           "--threads", str(args.threads), "--decode-tokens", str(args.decode_tokens)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("KILN_BENCH_RESULT ")]
    if out.returncode != 0 or not lines:
        return {"label": label, "error": out.stderr.strip().splitlines()[-1:] or ["no output"]}
    return json.loads(lines[-1].split(" ", 1)[1])


def best_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return runs[-1]
    row = dict(ok[0])
    row["ttft_512_ms"] = min(r["ttft_512_ms"] for r in ok)
    row["peak_rss_mb"] = max(r["peak_rss_mb"] for r in ok)
    for key in ("decode_tok_s_b1", "decode_tok_s_b8"):
        row[key] = max(r[key] for r in ok)
        row[key + "_rounds"] = [r[key] for r in ok]
    return row


def finish(rows: list[dict[str, Any]], bandwidth_gb_s: float) -> None:
    ref = next((r for r in rows if r["label"] == "torch-fp32" and "error" not in r), None)
    for r in rows:
        if "error" in r:
            continue
        r["mbu_b1"] = round(r["weight_bytes"] / 1e9 * r["decode_tok_s_b1"] / bandwidth_gb_s, 3)
        if ref:
            r["speedup_b1_vs_torch"] = round(r["decode_tok_s_b1"] / ref["decode_tok_s_b1"], 2)
            r["speedup_b8_vs_torch"] = round(r["decode_tok_s_b8"] / ref["decode_tok_s_b8"], 2)


def print_table(rows: list[dict[str, Any]], bw: float) -> None:
    print(f"\nmemory bandwidth (numpy copy): {bw:.1f} GB/s")
    head = (f"{'variant':<13}{'weights':>9}{'TTFT512':>9}{'b1 tok/s':>9}{'b8 tok/s':>9}"
            f"{'RSS':>8}{'MBU b1':>7}{'x torch b1':>11}{'x b8':>6}")
    print(head + "\n" + "-" * len(head))
    for r in rows:
        if "error" in r:
            print(f"{r['label']:<13} failed: {r['error']}")
            continue
        print(f"{r['label']:<13}{r['weight_bytes'] / 1e6:>7.0f}MB{r['ttft_512_ms']:>7.0f}ms{r['decode_tok_s_b1']:>9.1f}"
              f"{r['decode_tok_s_b8']:>9.1f}{r['peak_rss_mb']:>6.0f}MB{r['mbu_b1']:>7.0%}"
              f"{r.get('speedup_b1_vs_torch', float('nan')):>10.2f}x{r.get('speedup_b8_vs_torch', float('nan')):>5.2f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="fp32 HF checkpoint (default: the demo model)")
    p.add_argument("--only", action="append", choices=sorted(VARIANTS), help="variants to run (repeatable)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.model is None:
        from kiln.pipeline.demo import demo_model_dir

        args.model = demo_model_dir()
    if args.child:
        print("KILN_BENCH_RESULT " + json.dumps(measure(args.child, args.model, args.threads, args.decode_tokens)))
        return
    from kiln.pipeline.files import atomic_write_json

    labels = args.only or list(VARIANTS)
    samples, runs = [common.bandwidth(args.threads)], {label: [] for label in labels}
    for r in range(args.repeats):
        for label in labels if r % 2 == 0 else reversed(labels):
            runs[label].append(run_child(label, args))
            print(json.dumps(runs[label][-1]), flush=True)
        samples.append(common.bandwidth(args.threads))
    bw = statistics.median(samples)
    rows = [best_of(runs[label]) for label in labels]
    finish(rows, bw)
    atomic_write_json(args.out, {"model": str(args.model), "machine": platform.processor() or platform.machine(),
                                 "cpus": os.cpu_count(), "load_average": os.getloadavg(), "threads": args.threads,
                                 "bandwidth_gb_s": round(bw, 2),
                                 "bandwidth_samples_gb_s": [round(b, 2) for b in samples],
                                 "decode_tokens": args.decode_tokens, "repeats": args.repeats, "results": rows})
    print_table(rows, bw)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
