"""kiln serve against a bare llama-server under concurrency: does serving keep up with its engine?

Three servers over the same GGUF (the demo checkpoint's, made by the gguf method as the other llama.cpp
benches make it), the same threads and the same 4 slots: a bare `llama-server` started with the flags
kiln's server runtime gives it (`server_command`), `kiln serve` over the `llama_cpp` engine's library
runtime, and `kiln serve` over its server runtime. Each cell is one server at one concurrency: that
many closed-loop clients (aiohttp, in this process) each send a streamed /v1/completions request, a
fresh seeded prompt of `--prompt-tokens` random token ids, 64 greedy new tokens with ignore_eos (every
request produces the same count), and send the next as soon as the last ended. After `--warmup-s`
the cell counts `--seconds`: aggregate tok/s (tokens that arrived in the window, from each stream's
chunks and its final usage count), and over the requests that ended in the window their latency
p50/p95, TTFT p50/p95, TPOT p50 and goodput: tok/s of the requests within the TTFT and TPOT
objectives (`--ttft-slo-ms`, `--tpot-slo-ms`). Servers alternate within a round (A B C, then C B A),
concurrencies run in order within each; every figure is the median of the rounds with [min, max].
Each cell records the load average and the machine's contention (CPU pressure, steal).

    flock /tmp/kiln-heavy.lock .venv/bin/python bench/serve_vs_llama_server.py --rounds 2 --seconds 15

Writes bench/results/serve_vs_llama_server.json (or --out) and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
import cpu_engines
from llama_cpp_runtimes import _spread, engine_dirs

from kiln.evaluate import contention

OUT = Path(__file__).parent / "results" / "serve_vs_llama_server.json"
VARIANTS = ("llama-server", "kiln-library", "kiln-server")
NEW_TOKENS = 64


@contextlib.contextmanager
def bare_llama_server(engine_dir: Path) -> Iterator[str]:
    """llama-server over the engine folder's GGUF with the flags kiln's server runtime gives it; its URL."""
    import subprocess

    from kiln.core.llama_cpp_build import binary
    from kiln.engine.llama_cpp.config import LlamaCppConfig
    from kiln.engine.llama_cpp.server import server_command
    from kiln.engine.remote import free_port, stop_process, wait_healthy

    manifest = json.loads((engine_dir / "kiln-engine.json").read_text())
    config = LlamaCppConfig(**manifest["config"])
    port = free_port()
    with tempfile.TemporaryFile() as log:
        cmd = server_command(binary("llama-server"), engine_dir / manifest["build"]["file"], port, config)
        process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)
        try:
            wait_healthy(f"http://127.0.0.1:{port}", 120, process, "llama-server", log)
            yield f"http://127.0.0.1:{port}"
        finally:
            stop_process(process, 30)


async def one_request(session, url: str, prompt: list[int]) -> dict[str, Any]:
    """One streamed greedy completion: when it was sent, each token's arrival, when it ended."""
    body = {"prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    sent, times, total = time.perf_counter(), [], None
    async with session.post(url + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            now, chunk = time.perf_counter(), json.loads(line[6:])
            # a chunk per token; llama-server ends with one more, empty, chunk: the usage count settles it
            if any(c.get("finish_reason") is None for c in chunk.get("choices", [])):
                times.append(now)
            if chunk.get("usage"):
                total = chunk["usage"]["completion_tokens"]
                times += [now] * (total - len(times))
    return {"sent": sent, "times": times, "ended": time.perf_counter(), "tokens": total or len(times)}


async def closed_loop(url: str, clients: int, warmup_s: float, seconds: float, seed: int,
                      prompt_tokens: int) -> list[dict[str, Any]]:
    """`clients` closed-loop clients for warmup_s + seconds; every finished request's record."""
    import aiohttp

    rng, done = random.Random(seed), []
    stop_at = time.perf_counter() + warmup_s + seconds

    async def client(session) -> None:
        while time.perf_counter() < stop_at:
            done.append(await one_request(session, url, [rng.randrange(1000, 40000) for _ in range(prompt_tokens)]))

    # a connection per request: llama-server closes a streamed response's connection, so a reused one fails
    connector = aiohttp.TCPConnector(limit=clients, force_close=True)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
        await asyncio.gather(*(client(session) for _ in range(clients)))
    return done


def summarize(records: list[dict[str, Any]], start: float, end: float, slo: tuple[float, float]) -> dict[str, Any]:
    """Aggregate tok/s in [start, end]; latency, TTFT, TPOT and goodput of the requests that ended in it."""
    span = end - start
    arrived = sum(start <= t <= end for r in records for t in r["times"])
    ended = [r for r in records if start <= r["ended"] <= end and r["times"]]
    ttft = [r["times"][0] - r["sent"] for r in ended]
    tpot = [(r["times"][-1] - r["times"][0]) / max(1, len(r["times"]) - 1) for r in ended]
    latency = [r["ended"] - r["sent"] for r in ended]
    good = sum(r["tokens"] for r, f, p in zip(ended, ttft, tpot, strict=True) if f <= slo[0] and p <= slo[1])
    q = lambda xs, k: round(statistics.quantiles(xs, n=20, method="inclusive")[k] * 1000, 1) if len(xs) > 1 else None
    return {"tok_s": round(arrived / span, 2), "goodput_tok_s": round(good / span, 2), "requests": len(ended),
            "tokens_per_request": sorted({r["tokens"] for r in ended}), "latency_p50_ms": q(latency, 9),
            "latency_p95_ms": q(latency, 18), "ttft_p50_ms": q(ttft, 9), "ttft_p95_ms": q(ttft, 18),
            "tpot_p50_ms": q(tpot, 9)}


def cell(url: str, clients: int, args, seed: int) -> dict[str, Any]:
    load0, busy0 = os.getloadavg()[0], contention.read()
    began = time.perf_counter()
    records = asyncio.run(closed_loop(url, clients, args.warmup_s, args.seconds, seed, args.prompt_tokens))
    busy = contention.between(busy0, contention.read())
    row = summarize(records, began + args.warmup_s, began + args.warmup_s + args.seconds,
                    (args.ttft_slo_ms / 1000, args.tpot_slo_ms / 1000))
    return {**row, "load_1min": [load0, os.getloadavg()[0]], "cpu_pressure": busy["cpu_pressure"],
            "cpu_steal": busy["cpu_steal"]}


def measure(urls: dict[str, str], args) -> dict[str, dict[int, list[dict[str, Any]]]]:
    cells: dict[str, dict[int, list[dict[str, Any]]]] = {v: {c: [] for c in args.concurrency} for v in urls}
    for url in urls.values():  # warm every path once
        asyncio.run(closed_loop(url, 1, 0, 0.1, 0, args.prompt_tokens))
    for r in range(args.rounds):
        for variant in list(urls) if r % 2 == 0 else list(urls)[::-1]:
            for c in args.concurrency:
                cells[variant][c].append(cell(urls[variant], c, args, seed=1000 * r + c))
                got = cells[variant][c][-1]
                print(f"round {r} {variant:<13} c={c}: {got['tok_s']:.1f} tok/s, p50 {got['latency_p50_ms']} ms, "
                      f"load {got['load_1min'][1]:.2f}", flush=True)
    return cells


def rows_of(cells, base: str = "llama-server") -> list[dict[str, Any]]:
    """Per variant and concurrency: each figure's median of the rounds with [min, max], and the ratio
    of its aggregate tok/s to the bare llama-server's in the same round."""
    rows = []
    for variant, by_c in cells.items():
        for c, runs in by_c.items():
            row: dict[str, Any] = {"variant": variant, "concurrency": c, "rounds": runs}
            for key in ("tok_s", "goodput_tok_s", "latency_p50_ms", "latency_p95_ms", "ttft_p50_ms", "ttft_p95_ms",
                        "tpot_p50_ms"):
                values = [r[key] for r in runs if r[key] is not None]
                row[key] = _spread(values) if values else None
            ratios = [r["tok_s"] / b["tok_s"] for r, b in zip(runs, cells[base][c], strict=True)]
            row["over_llama_server"] = _spread(ratios)
            rows.append(row)
    return rows


def print_table(rows: list[dict[str, Any]], args) -> None:
    fmt = lambda s, f=".1f": "-" if s is None else f"{s[0]:{f}} [{s[1]:{f}}, {s[2]:{f}}]"
    print(f"\n{'server':<14}{'c':>3}{'tok/s':>22}{'x llama-server':>24}{'p50 ms':>10}{'p95 ms':>10}"
          f"{'TTFT p50':>10}{'TPOT p50':>10}{'goodput tok/s':>22}")
    for r in rows:
        med = lambda k: "-" if r[k] is None else f"{r[k][0]:.0f}"
        print(f"{r['variant']:<14}{r['concurrency']:>3}{fmt(r['tok_s']):>22}{fmt(r['over_llama_server'], '.3f'):>24}"
              f"{med('latency_p50_ms'):>10}{med('latency_p95_ms'):>10}{med('ttft_p50_ms'):>10}{med('tpot_p50_ms'):>10}"
              f"{fmt(r['goodput_tok_s']):>22}")
    print(f"(medians of {args.rounds} rounds [min, max]; goodput: tok/s of requests with TTFT <= {args.ttft_slo_ms:g} ms"
          f" and TPOT <= {args.tpot_slo_ms:g} ms; x llama-server: per round, same concurrency)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="checkpoint (default: the demo model)")
    p.add_argument("--type", default="q8_0", help="GGUF type (the gguf method's)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seconds", type=float, default=15)
    p.add_argument("--warmup-s", type=float, default=2)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--ttft-slo-ms", type=float, default=1000)
    p.add_argument("--tpot-slo-ms", type=float, default=50)
    p.add_argument("--only", action="append", choices=VARIANTS, help="servers to run (llama-server always runs)")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args()
    if args.model is None:
        from kiln.pipeline.demo.prepare import demo_model_dir

        args.model = demo_model_dir()
    dirs = engine_dirs(args.model, args.type, args.threads)
    wanted = ["llama-server", *[v for v in VARIANTS[1:] if not args.only or v in args.only]]
    started, load0, busy0 = time.time(), os.getloadavg(), contention.read()
    with contextlib.ExitStack() as stack:
        servers = {"llama-server": lambda: bare_llama_server(dirs["server"]),
                   "kiln-library": lambda: cpu_engines.kiln_serve(dirs["library"]),
                   "kiln-server": lambda: cpu_engines.kiln_serve(dirs["server"])}
        urls = {v: stack.enter_context(servers[v]()) for v in wanted}
        cells = measure(urls, args)
    rows = rows_of(cells)
    from kiln.core.files import atomic_write_json

    busy = contention.between(busy0, contention.read())
    atomic_write_json(args.out, {"model": str(args.model), "type": args.type, "threads": args.threads, "slots": 4,
                                 "new_tokens": NEW_TOKENS, "cpu": cpu_engines.cpu_identity(), "cpus": os.cpu_count(),
                                 "settings": {k: v for k, v in vars(args).items() if k not in ("model", "out")},
                                 "engine_dirs": {k: str(v) for k, v in dirs.items()}, "load_average_start": load0,
                                 "load_average_end": os.getloadavg(), "contention": busy,
                                 "seconds": round(time.time() - started), "rows": rows})
    print_table(rows, args)
    print(f"load average {load0[0]:.2f} -> {os.getloadavg()[0]:.2f}; steal {busy['cpu_steal'] or 0:.1%}, "
          f"CPU pressure {busy['cpu_pressure'] or 0:.1%} over the run; wrote {args.out}")


if __name__ == "__main__":
    main()
