"""Engine backends side by side on the demo model: TTFT, decode speed, memory, MBU.

For each variant (backend x precision): TTFT of a 512-token prompt, decode tok/s at batch 1 and
batch 8, peak RSS, and MBU = weight bytes read per decode step x steps/s / measured bandwidth.
Bandwidth is a numpy copy of a 512 MiB array split over as many threads as the engine uses: one
thread cannot saturate a many-core socket (on a 16-core Xeon one thread copied ~20 GB/s while the
engine on 16 threads streamed its weights faster than that), so a single-thread figure would put
MBU above 100%. Each variant runs in its own process so peak RSS is its own. Writes
bench/results/engines.json and prints a table.

    python bench/engines.py                                   # torch fp32 on the demo model
    python bench/engines.py --variant torch-bf16=torch,dtype=bfloat16 \\
        --variant torch-int8=torch@/path/to/int8/checkpoint --threads 2

A variant is LABEL=BACKEND[,key=value...][@CHECKPOINT]; the checkpoint defaults to --model.
Numbers from a shared, noisy machine: compare variants measured in the same run, not across runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

OUT = Path(__file__).parent / "results" / "engines.json"


def parse_variant(text: str, model: str) -> dict[str, Any]:
    label, _, rest = text.partition("=")
    spec, _, checkpoint = rest.partition("@")
    backend, *pairs = spec.split(",")
    config: dict[str, Any] = {"backend": backend}
    for pair in pairs:
        key, _, value = pair.partition("=")
        try:
            config[key] = json.loads(value)
        except json.JSONDecodeError:
            config[key] = value
    return {"label": label, "config": config, "checkpoint": checkpoint or model}


def bandwidth(threads: int, size_mb: int = 512, repeats: int = 5) -> float:
    """GB/s of a numpy copy split over `threads` threads (numpy releases the GIL while copying);
    a copy reads and writes every byte, so one pass moves 2 x size. Best of `repeats`."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    src = np.ones(size_mb * 2**20 // 8)
    dst = np.empty_like(src)
    parts = list(zip(np.array_split(src, threads), np.array_split(dst, threads), strict=True))
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda p: np.copyto(p[1], p[0]), parts))  # first touch of every page
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            list(pool.map(lambda p: np.copyto(p[1], p[0]), parts))
            best = min(best, time.perf_counter() - start)
    return 2 * src.nbytes / best / 1e9


def weight_bytes(engine, checkpoint: Path) -> int:
    """Bytes of weights one decode step reads: the loaded tensors for torch (tied weights once),
    else the checkpoint's safetensors files."""
    model = getattr(engine, "model", None)
    if model is not None:
        tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
        return sum(t.numel() * t.element_size() for t in tensors.values())
    return sum(p.stat().st_size for p in checkpoint.glob("*.safetensors"))


def peak_rss_mb(pid: int | str = "self") -> int:
    """A process's own peak resident set in MB (VmHWM; ru_maxrss would carry the parent's)."""
    from kiln.pipeline.stages.base import peak_rss_bytes

    return round(peak_rss_bytes(pid) / 2**20)


def _decode_rate(engine, prompts: list[list[int]], n: int) -> float:
    """Tokens/s after every sequence has its first token (prefill excluded)."""
    from kiln.engine.base import GenerationRequest

    for p in prompts:
        engine.add(GenerationRequest(p, n, ignore_eos=True))
    first = [ev for ev in engine.step()]
    while len(first) < len(prompts):  # backends that prefill a few per step
        first += engine.step()
    start, count, last = max(ev.time for ev in first), 0, 0.0
    while engine.has_work():
        for ev in engine.step():
            count, last = count + 1, ev.time
    return count / (last - start)


def measure(variant: dict[str, Any], threads: int | None, decode_tokens: int) -> dict[str, Any]:
    """Runs in the child process: build, load, measure one variant."""
    import random

    from kiln.engine.base import GenerationRequest
    from kiln.engine.cache import write_engine
    from kiln.engine.loader import engine_config, load_engine

    config = engine_config({"config": {**variant["config"], **({"threads": threads} if threads else {})}})
    checkpoint = Path(variant["checkpoint"])
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        write_engine(config, checkpoint, "bench", Path(tmp))
        engine = load_engine(Path(tmp))
        load_s = time.perf_counter() - t0
        vocab = len(engine.tokenizer)
        rng = random.Random(0)
        prompt = lambda n: [rng.randrange(100, vocab - 100) for _ in range(n)]  # noqa: E731
        list(engine.generate([GenerationRequest(prompt(32), 4, ignore_eos=True)]))  # warm-up
        ttfts = []
        for _ in range(3):
            start = time.perf_counter()
            ev = next(engine.generate([GenerationRequest(prompt(512), 1)]))
            ttfts.append(ev.time - start)
            while engine.has_work():
                engine.step()
        b1 = _decode_rate(engine, [prompt(16)], decode_tokens)
        b8 = _decode_rate(engine, [prompt(16) for _ in range(8)], decode_tokens)
        wbytes = weight_bytes(engine, checkpoint)
        engine.close()
    rss_mb = peak_rss_mb()
    return {"label": variant["label"], "config": config.model_dump(mode="json"), "checkpoint": str(checkpoint),
            "load_s": round(load_s, 2), "ttft_512_ms": round(statistics.median(ttfts) * 1000, 1),
            "ttft_512_ms_all": [round(t * 1000, 1) for t in ttfts],
            "decode_tok_s_b1": round(b1, 2), "decode_tok_s_b8": round(b8, 2),
            "peak_rss_mb": round(rss_mb), "weight_bytes": wbytes}


def _child(args) -> None:
    result = measure(json.loads(args.child), args.threads, args.decode_tokens)
    print("KILN_BENCH_RESULT " + json.dumps(result), flush=True)


def _run_variant(variant: dict[str, Any], args) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", json.dumps(variant), "--decode-tokens", str(args.decode_tokens)]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("KILN_BENCH_RESULT ")]
    if out.returncode != 0 or not lines:
        return {"label": variant["label"], "error": out.stderr.strip().splitlines()[-1:] or ["no output"]}
    return json.loads(lines[-1].split(" ", 1)[1])


def add_mbu(row: dict[str, Any], bandwidth_gb_s: float) -> None:
    if "error" in row:
        return
    per_step = row["weight_bytes"] / 1e9  # GB read per decode step, whatever the batch size
    row["mbu_b1"] = round(per_step * row["decode_tok_s_b1"] / bandwidth_gb_s, 3)
    row["mbu_b8"] = round(per_step * row["decode_tok_s_b8"] / 8 / bandwidth_gb_s, 3)


def print_table(rows: list[dict[str, Any]], bw: float, threads: int, single: float) -> None:
    print(f"\nmemory bandwidth (numpy copy, {threads} threads): {bw:.1f} GB/s (1 thread: {single:.1f} GB/s)")
    head = f"{'variant':<14}{'TTFT 512':>10}{'tok/s b1':>10}{'tok/s b8':>10}{'peak RSS':>10}{'MBU b1':>8}{'MBU b8':>8}"
    print(head + "\n" + "-" * len(head))
    for r in rows:
        if "error" in r:
            print(f"{r['label']:<14} failed: {r['error']}")
            continue
        print(f"{r['label']:<14}{r['ttft_512_ms']:>8.0f}ms{r['decode_tok_s_b1']:>10.1f}{r['decode_tok_s_b8']:>10.1f}"
              f"{r['peak_rss_mb']:>8.0f}MB{r['mbu_b1']:>8.0%}{r['mbu_b8']:>8.0%}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="fp32 checkpoint folder (default: the demo model)")
    p.add_argument("--variant", action="append", help="LABEL=BACKEND[,key=value...][@CHECKPOINT]")
    p.add_argument("--threads", type=int, help="engine threads (torch.set_num_threads)")
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return _child(args)

    from kiln.core.files import atomic_write_json

    model = args.model or str(_demo_model())
    variants = [parse_variant(v, model) for v in (args.variant or ["torch-fp32=torch,dtype=float32"])]
    threads = args.threads or os.cpu_count() or 1
    single, samples = bandwidth(1), [bandwidth(threads)]
    rows = []
    for v in variants:
        rows.append(_run_variant(v, args))
        samples.append(bandwidth(threads))  # the VM is noisy: sample between variants too
    bw = statistics.median(samples)
    for r in rows:
        add_mbu(r, bw)
    atomic_write_json(args.out, {"model": model, "machine": platform.processor() or platform.machine(),
                                 "cpus": os.cpu_count(), "bandwidth_gb_s": round(bw, 2),
                                 "bandwidth_threads": threads, "bandwidth_samples_gb_s": [round(b, 2) for b in samples],
                                 "bandwidth_one_thread_gb_s": round(single, 2), "threads": args.threads,
                                 "decode_tokens": args.decode_tokens, "results": rows})
    print_table(rows, bw, threads, single)
    print(f"\nwrote {args.out}")


def _demo_model() -> Path:
    from kiln.pipeline.demo.prepare import demo_model_dir

    return demo_model_dir()


if __name__ == "__main__":
    main()
