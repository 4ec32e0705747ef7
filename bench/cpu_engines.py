"""kiln's CPU engine backends side by side on the demo model, with torch fp32 as the reference row.

For each backend x precision: TTFT of a 512-token prompt, decode tok/s at batch 1 and batch 8
(prefill excluded), peak RSS, MBU = weight bytes read per decode step x steps/s / measured
bandwidth, and the speed-up over torch fp32. Bandwidth and the decode-rate method are the ones
bench/engines.py uses (numpy copy over the engine's thread count), so every row is measured the
same way. Engines are built once into kiln's engine cache (OpenVINO/CTranslate2 conversion takes
minutes) and each variant runs in its own process, so peak RSS (VmHWM) is its own; a llama.cpp row adds
llama-server's, where its weights and KV cache live.

The llama.cpp variants (`llama-q8_0`, ...) serve a GGUF file the `gguf` method made (cached under
$KILN_CACHE/bench-gguf). Their child also measures, in pairs back to back (PAIRS of them, in
alternating order, one kiln serve process for all):
- `kiln serve` over that engine: decode tok/s of one streamed batch-1 request over HTTP (what a
  client of kiln sees: kiln's server -> the llama_cpp engine -> llama-server), and the gaps between
  its tokens' arrivals (p10/p50/p90: tokens in bursts would inflate a first-to-last rate);
- `llama-bench` of the same build and the same file: `tg64` at the same threads and at the depth of the
  stream's prompt (`-d 16`: the same positions 16-79 the stream decodes; on the demo model `tg64` from
  position 0 reads ~5% faster), `tg64` from position 0 beside it, and `pp512` once.
The `llama-bench` figures print as their own rows, with kiln serve's decode over llama-bench's: the
median of the pairs' ratios in a round (each ratio's two sides seconds apart), then over the rounds.
With `--threads` above 1 the child measures that pair again at 1 thread (llama-server and
llama-bench both `-t 1`; on a 2-core machine that leaves a core to kiln's Python and the client):
printed on its own line, labelled, beside the ratio at `--threads`, which is the headline one.

Variants run in `--repeats` rounds in alternating order; every figure is the median of the rounds
with its [min, max]. The load average is recorded around every child, and how busy the machine was
during it (kiln.evaluate.contention: the hypervisor's steal, CPU pressure): the machine is shared, so
compare rows of one run, never across runs.

    python bench/cpu_engines.py                      # all default variants, 2 threads
    python bench/cpu_engines.py --only torch-fp32 --only llama-q8_0 --repeats 1

Writes bench/results/cpu_engines.json and prints a table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
import engines as common

from kiln.evaluate import contention

OUT = Path(__file__).parent / "results" / "cpu_engines.json"
VARIANTS = {
    "torch-fp32": {"backend": "torch", "dtype": "float32"},
    "ov-fp32": {"backend": "openvino", "weights": "fp32"},
    "ov-int8": {"backend": "openvino", "weights": "int8"},
    "ov-int4": {"backend": "openvino", "weights": "int4"},
    # bf16 activations need a KV cache other than f32 (OpenVINO: "expect kvcache type bf16, current: f32")
    "ov-int8-bf16": {"backend": "openvino", "weights": "int8", "activations": "bf16", "kv_cache_precision": "u8"},
    "ct2-fp32": {"backend": "ctranslate2", "quantization": "float32"},
    "ct2-int8f32": {"backend": "ctranslate2", "quantization": "int8_float32"},
    "ct2-int8": {"backend": "ctranslate2", "quantization": "int8"},
    # parallel 8: the batch-8 figure needs 8 server slots; 1024 context each holds the 512-token prompt
    "llama-q8_0": {"backend": "llama_cpp", "parallel": 8, "ctx_per_slot": 1024, "gguf": "q8_0"},
    "llama-q4_0": {"backend": "llama_cpp", "parallel": 8, "ctx_per_slot": 1024, "gguf": "q4_0"},
    "llama-q4_1": {"backend": "llama_cpp", "parallel": 8, "ctx_per_slot": 1024, "gguf": "q4_1"},
    "llama-q4_K_M": {"backend": "llama_cpp", "parallel": 8, "ctx_per_slot": 1024, "gguf": "q4_K_M"},
    "llama-q5_K_M": {"backend": "llama_cpp", "parallel": 8, "ctx_per_slot": 1024, "gguf": "q5_K_M"},
}
PAIRS = 3  # (kiln serve, llama-bench) pairs per round and thread count
METRICS = ("ttft_512_ms", "decode_tok_s_b1", "decode_tok_s_b8", "serve_tok_s_b1", "bench_tg_tok_s", "bench_pp512_tok_s",
           "serve_over_bench", "bench_tg_d0_tok_s", "serve_over_bench_d0", "serve_tok_s_b1_t1", "bench_tg_tok_s_t1",
           "serve_over_bench_t1", "bench_tg_d0_tok_s_t1", "serve_over_bench_d0_t1")


def gguf_artifact(checkpoint: Path, kind: str, threads: int) -> Path:
    """The gguf method's artifact of `checkpoint` at `kind`, made once into the cache."""
    from kiln.optimize.gguf import Gguf, GgufConfig
    from kiln.core.home import kiln_cache
    from kiln.core.files import atomic_write_json, cached_tree_hash

    out = kiln_cache() / "bench-gguf" / f"{cached_tree_hash(checkpoint, kiln_cache() / 'hashes.json')[:12]}-{kind}"
    if not (out / "kiln-artifact.json").is_file():
        manifest = Gguf(GgufConfig(type=kind, threads=threads)).quantize(checkpoint, out, None)
        atomic_write_json(out / "kiln-artifact.json", {"method": "gguf", **manifest})
    return out


@contextlib.contextmanager
def kiln_serve(engine_dir: Path) -> Iterator[str]:
    """A `kiln serve` process over `engine_dir` on a free loopback port, ready; its URL."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    kiln = str(Path(sys.executable).with_name("kiln"))
    no_key = {k: v for k, v in os.environ.items() if k != "KILN_API_KEY"}  # set to "", kiln serve refuses it
    proc = subprocess.Popen([kiln, "serve", str(engine_dir), "--port", str(port), "--request-log", "off"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=no_key)
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"kiln serve {engine_dir} did not become ready") from None
                time.sleep(0.2)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def stream_decode(url: str, prompt: list[int], n: int) -> tuple[float, list[float]]:
    """Decode tok/s of one streamed batch-1 request to kiln serve at `url` (first token excluded), and the
    gaps between its tokens' arrivals (s)."""
    body = json.dumps({"prompt": prompt, "max_tokens": n, "ignore_eos": True, "temperature": 0,
                       "stream": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    times = []
    with urllib.request.urlopen(req, timeout=300) as r:
        for line in r:
            if line.startswith(b"data: {") and b'"choices"' in line:
                times.append(time.perf_counter())
    return (len(times) - 1) / (times[-1] - times[0]), [b - a for a, b in zip(times, times[1:])]


def llama_bench(gguf_path: Path, threads: int, n: int, depth: int, prefill: bool = True) -> dict[str, float]:
    """`llama-bench` of the same build on the same file, tok/s: decode n tokens after `depth` tokens of
    context and from position 0 (and prompt 512 from position 0 if `prefill`)."""
    from kiln.core.llama_cpp_build import binary

    out = subprocess.run([str(binary("llama-bench")), "-m", str(gguf_path), "-t", str(threads),
                          "-p", "512" if prefill else "0", "-n", str(n), "-d", f"0,{depth}", "-r", "2", "-o", "json"],
                         capture_output=True, text=True, check=True)
    rows = json.loads(out.stdout)
    tg = {r["n_depth"]: r["avg_ts"] for r in rows if r["n_gen"] == n}
    pp = next((r for r in rows if r["n_prompt"] == 512 and r["n_depth"] == 0), None)
    return {"bench_tg_tok_s": round(tg[depth], 2), "bench_tg_d0_tok_s": round(tg[0], 2),
            **({"bench_pp512_tok_s": round(pp["avg_ts"], 2)} if pp else {})}


def measure(label: str, checkpoint: Path, threads: int, decode_tokens: int, order: int = 0) -> dict[str, Any]:
    """Child process: build (cached), load, measure one variant."""
    import random

    # Registers the backends even before kiln.engine's __init__ imports them.
    import kiln.engine.ctranslate2
    import kiln.engine.llama_cpp.backend
    import kiln.engine.openvino  # noqa: F401
    from kiln.engine.base import GenerationRequest
    from kiln.engine.cache import build_engine
    from kiln.engine.loader import engine_config, load_engine
    from kiln.core.home import kiln_cache
    from kiln.core.files import cached_tree_hash

    variant = dict(VARIANTS[label])
    started = time.perf_counter()
    if "gguf" in variant:  # llama.cpp serves the gguf method's artifact, at the bench's threads
        checkpoint = gguf_artifact(checkpoint, variant.pop("gguf"), threads)
        variant["threads"] = threads
    config = engine_config({"config": variant})
    checkpoint_hash = cached_tree_hash(checkpoint, kiln_cache() / "hashes.json")
    engine_dir = build_engine(config, checkpoint, checkpoint_hash, kiln_cache())
    build_s = time.perf_counter() - started
    started = time.perf_counter()
    engine = load_engine(engine_dir, threads=threads)
    load_s = time.perf_counter() - started
    rng = random.Random(0)
    prompt = lambda n: [rng.randrange(100, len(engine.tokenizer) - 100) for _ in range(n)]
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
    server = getattr(engine, "process", None)  # llama_cpp: the weights and KV cache live in llama-server
    rss_mb = common.peak_rss_mb() + (common.peak_rss_mb(server.pid) if server else 0)
    engine.close()
    row = {"label": label, "config": config.model_dump(mode="json"), "engine_dir": str(engine_dir),
           "build_or_cache_s": round(build_s, 1), "load_s": round(load_s, 2),
           "ttft_512_ms": round(statistics.median(ttfts) * 1000, 1), "decode_tok_s_b1": round(b1, 2),
           "decode_tok_s_b8": round(b8, 2), "weight_bytes": weight_bytes,
           "peak_rss_mb": rss_mb}
    if config.backend == "llama_cpp":
        gguf_file = engine_dir / engine.manifest["build"]["file"]
        row.update(serve_and_bench(engine_dir, gguf_file, threads, prompt(16), decode_tokens, order))
        if threads > 1:  # the same pair at 1 thread: an engine folder of its own (the GGUF is linked)
            one = engine_config({"config": {**variant, "threads": 1}})
            one_dir = build_engine(one, checkpoint, checkpoint_hash, kiln_cache())
            pair = serve_and_bench(one_dir, gguf_file, 1, prompt(16), decode_tokens, order)
            row.update({f"{k}_t1": v for k, v in pair.items() if k != "bench_pp512_tok_s"})
    return row


def serve_and_bench(engine_dir: Path, gguf_file: Path, threads: int, prompt: list[int], decode_tokens: int,
                    order: int, pairs: int = PAIRS) -> dict[str, Any]:
    """kiln serve's batch-1 decode and llama-bench's on the same file and threads, at the same positions
    (llama-bench `-d len(prompt)`): one kiln serve process and `pairs` back-to-back (stream, llama-bench)
    pairs in alternating order, so each ratio compares two measurements seconds apart (this VM's speed
    drifts by a fifth within a minute). Medians of the pairs."""
    serve, bench, ratios, gaps = [], [], [], []
    with kiln_serve(engine_dir) as url:
        stream_decode(url, prompt, decode_tokens)  # warms the server's path
        for i in range(pairs):
            stream_first = (i + order) % 2 == 0
            if stream_first:
                rate, stream_gaps = stream_decode(url, prompt, decode_tokens)
            row = llama_bench(gguf_file, threads, decode_tokens, len(prompt), prefill=i == 0)
            if not stream_first:
                rate, stream_gaps = stream_decode(url, prompt, decode_tokens)
            serve.append(rate)
            gaps += stream_gaps
            bench.append(row)
            ratios.append(rate / row["bench_tg_tok_s"])
    from_0 = [rate / row["bench_tg_d0_tok_s"] for rate, row in zip(serve, bench, strict=True)]
    deciles = statistics.quantiles(gaps, n=10)
    return {"serve_tok_s_b1": round(statistics.median(serve), 2),
            # p10 far below p50 would mean tokens arrive in bursts, which inflate a first-to-last rate
            "serve_gap_ms_p10_p50_p90": [round(deciles[i] * 1000, 2) for i in (0, 4, 8)],
            "bench_tg_tok_s": round(statistics.median(b["bench_tg_tok_s"] for b in bench), 2),
            "bench_tg_d0_tok_s": round(statistics.median(b["bench_tg_d0_tok_s"] for b in bench), 2),
            "bench_pp512_tok_s": bench[0]["bench_pp512_tok_s"],
            "serve_over_bench": round(statistics.median(ratios), 3),
            "serve_over_bench_d0": round(statistics.median(from_0), 3),
            "serve_over_bench_pairs": [round(r, 3) for r in ratios],
            "serve_over_bench_d0_pairs": [round(r, 3) for r in from_0]}


def cpu_identity() -> dict[str, str]:
    """The CPU's name, family and model from /proc/cpuinfo: a VM's name alone ("AMD EPYC") tells
    generations apart no better than platform.processor(), which is empty on Linux."""
    wanted = {"model name": "name", "cpu family": "family", "model": "model"}
    found: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in wanted and wanted[key.strip()] not in found:
                found[wanted[key.strip()]] = value.strip()
    return found


def run_child(label: str, args, round_: int) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", label, "--model", str(args.model), "--round", str(round_),
           "--threads", str(args.threads), "--decode-tokens", str(args.decode_tokens)]
    load_before, busy_before = os.getloadavg()[0], contention.read()
    out = subprocess.run(cmd, capture_output=True, text=True, check=False, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("KILN_BENCH_RESULT ")]
    if out.returncode != 0 or not lines:
        return {"label": label, "error": out.stderr.strip().splitlines()[-1:] or ["no output"]}
    return {**json.loads(lines[-1].split(" ", 1)[1]), "load_1min": [load_before, os.getloadavg()[0]],
            "contention": contention.between(busy_before, contention.read())}


def median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over the rounds, with its [min, max] and every round's value."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return runs[-1]
    row = dict(ok[0])
    row["rounds"] = len(ok)
    row["peak_rss_mb"] = min(r["peak_rss_mb"] for r in ok)  # a round that built the engine peaks higher
    row["load_1min"] = [round(x, 2) for r in ok for x in r["load_1min"]]
    row["contention"] = [r["contention"] for r in ok]
    for key in ("serve_over_bench_pairs", "serve_over_bench_pairs_t1", "serve_over_bench_d0_pairs",
                "serve_over_bench_d0_pairs_t1", "serve_gap_ms_p10_p50_p90", "serve_gap_ms_p10_p50_p90_t1"):
        if key in row:
            row[key] = [r[key] for r in ok]  # every round's pairs
    for key in METRICS:
        if key in row:
            values = [r[key] for r in ok]
            row[key] = round(statistics.median(values), 3)
            row[key + "_range"] = [min(values), max(values)]
            row[key + "_rounds"] = values
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


def _spread(r: dict[str, Any], key: str, fmt: str = ".1f") -> str:
    lo, hi = r[key + "_range"]
    return f"{r[key]:{fmt}} [{lo:{fmt}}, {hi:{fmt}}]"


def _times(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"  # None: no torch-fp32 row in this run


def _gaps(r: dict[str, Any], suffix: str = "") -> str:
    """The stream's inter-token gaps, p10/p50/p90 ms, each the median over the rounds."""
    rounds = r["serve_gap_ms_p10_p50_p90" + suffix]
    return "/".join(f"{statistics.median(g[i] for g in rounds):.1f}" for i in range(3))


def print_table(rows: list[dict[str, Any]], bw: float) -> None:
    print(f"\nmemory bandwidth (numpy copy): {bw:.1f} GB/s; medians of the rounds [min, max]")
    head = (f"{'variant':<18}{'weights':>8}{'TTFT 512 ms':>24}{'b1 tok/s':>22}{'b8 tok/s':>22}"
            f"{'RSS':>7}{'MBU b1':>7}{'x torch b1':>11}")
    print(head + "\n" + "-" * len(head))
    for r in rows:
        if "error" in r:
            print(f"{r['label']:<18} failed: {r['error']}")
            continue
        print(f"{r['label']:<18}{r['weight_bytes'] / 1e6:>6.0f}MB{_spread(r, 'ttft_512_ms', '.0f'):>24}"
              f"{_spread(r, 'decode_tok_s_b1'):>22}{_spread(r, 'decode_tok_s_b8'):>22}{r['peak_rss_mb']:>5.0f}MB"
              f"{r['mbu_b1']:>7.0%}{_times(r.get('speedup_b1_vs_torch')):>11}")
        if "serve_tok_s_b1" in r:
            name = "  kiln serve"
            print(f"{name:<18}{'':>8}{'':>24}{_spread(r, 'serve_tok_s_b1'):>22}"
                  f"   gaps between tokens p10/p50/p90 {_gaps(r)} ms")
            name = "  llama-bench"
            ttft = 512 / r["bench_pp512_tok_s"] * 1000
            print(f"{name:<18}{'':>8}{f'{ttft:.0f} (pp512)':>24}{_spread(r, 'bench_tg_tok_s'):>22}")
            print(f"{'':<18}kiln serve / llama-bench decode: {_spread(r, 'serve_over_bench', '.3f')}"
                  f" at {r['config']['threads']} threads (same positions; against tg from position 0 "
                  f"{_spread(r, 'bench_tg_d0_tok_s')}: {_spread(r, 'serve_over_bench_d0', '.3f')})")
            if "serve_over_bench_t1" in r:
                print(f"{'':<18}  at 1 thread (a core left to kiln): kiln serve {_spread(r, 'serve_tok_s_b1_t1')}, "
                      f"llama-bench {_spread(r, 'bench_tg_tok_s_t1')}, ratio {_spread(r, 'serve_over_bench_t1', '.3f')}"
                      f" (from position 0: {_spread(r, 'serve_over_bench_d0_t1', '.3f')}; gaps {_gaps(r, '_t1')} ms)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="fp32 HF checkpoint (default: the demo model)")
    p.add_argument("--only", action="append", choices=sorted(VARIANTS), help="variants to run (repeatable)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.model is None:
        from kiln.pipeline.demo.prepare import demo_model_dir

        args.model = demo_model_dir()
    if args.child:
        print("KILN_BENCH_RESULT " + json.dumps(measure(args.child, args.model, args.threads, args.decode_tokens, args.round % 2)))
        return
    from kiln.core.files import atomic_write_json

    labels = args.only or list(VARIANTS)
    load_start, busy_start = os.getloadavg(), contention.read()
    samples, runs = [common.bandwidth(args.threads)], {label: [] for label in labels}
    for r in range(args.repeats):
        for label in labels if r % 2 == 0 else reversed(labels):
            runs[label].append(run_child(label, args, r))
            print(json.dumps(runs[label][-1]), flush=True)
        samples.append(common.bandwidth(args.threads))
    bw = statistics.median(samples)
    rows = [median_of(runs[label]) for label in labels]
    finish(rows, bw)
    busy = contention.between(busy_start, contention.read())
    atomic_write_json(args.out, {"model": str(args.model), "machine": platform.processor() or platform.machine(),
                                 "cpu": cpu_identity(), "cpus": os.cpu_count(), "load_average_start": load_start,
                                 "load_average_end": os.getloadavg(), "contention": busy,
                                 "threads": args.threads,
                                 "bandwidth_gb_s": round(bw, 2),
                                 "bandwidth_samples_gb_s": [round(b, 2) for b in samples],
                                 "decode_tokens": args.decode_tokens, "repeats": args.repeats, "results": rows})
    print_table(rows, bw)
    print(f"\nload average {load_start[0]:.2f} at the start, {os.getloadavg()[0]:.2f} at the end; "
          f"steal {busy['cpu_steal'] or 0:.1%} of CPU time, CPU pressure {busy['cpu_pressure'] or 0:.1%} over the run")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
