"""Does `kiln serve`'s default admission keep latency under overload? (issue #16)

A real `kiln serve` process on the demo model (torch backend, `max_batch_size` B, 2 threads), one
variant at a time, variants interleaved round by round (A B A B ...):

- `default`: what `kiln serve ENGINE` does now: slots = the engine's batch, a queue bounded by
  the estimated wait (`--queue-wait auto`: half the median slot-to-first-token time);
- `old-default`: the previous defaults, `--max-running 32 --max-queue 64 --queue-wait off`.

Each variant is measured in two phases against the same server:
1. at capacity: B closed-loop users (the batch kept full, nothing queues in front of it) for
   `--seconds`; its completions per second are the capacity, its TTFT p50 the reference;
2. 3x overload: Poisson arrivals at 3 x that capacity for `--seconds`; the TTFT of admitted
   requests (HTTP 200) that arrived after the first quarter (the queue has filled by then).

Per round it records the ratio overload TTFT p50 / at-capacity TTFT p50 (the target: <= 1.5 for
`default`), how many requests were refused, their Retry-After and the server's estimated wait
(from its request log), and for requests that queued, the wait that followed over the wait
estimated when they arrived (1.0 = the estimate Retry-After is made of was right).
Streams are 64-token prompts (token ids) and 32 greedy tokens, `ignore_eos`.

Writes bench/results/overload.json (every round, medians with min-max, the machine's load) and
prints a table. One heavy job at a time: run it alone (`flock /tmp/kiln-heavy.lock ...`).

    python bench/overload.py                 # 2 rounds, 40 s phases, B = 16
    python bench/overload.py --quick         # 1 round, 20 s phases, B = 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kiln.evaluate import contention  # noqa: E402

VARIANTS = {
    "default": [],
    "old-default": ["--max-running", "32", "--max-queue", "64", "--queue-wait", "off"],
}
PROMPT_TOKENS, MAX_TOKENS = 64, 32


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_engine(batch: int, cache: Path) -> Path:
    from kiln.engine.cache import build_engine as build
    from kiln.engine.hf_torch import TorchEngineConfig
    from kiln.pipeline.recipe.model_source import resolve_model

    model = resolve_model("demo", cache)
    return build(TorchEngineConfig(threads=2, max_batch_size=batch), model.path, model.sha256, cache)


class Server:
    def __init__(self, engine: Path, args: list[str], log: Path):
        self.port, self.log = _free_port(), log
        self.url = f"http://127.0.0.1:{self.port}"
        kiln = str(Path(sys.executable).with_name("kiln"))
        no_key = {k: v for k, v in os.environ.items() if k != "KILN_API_KEY"}  # set to "", kiln serve refuses it
        self.proc = subprocess.Popen([kiln, "serve", str(engine), "--port", str(self.port), "--request-log", str(log),
                                      *args], stdout=subprocess.DEVNULL, env=no_key)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError("kiln serve did not become ready")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(60)


async def _one(s: aiohttp.ClientSession, url: str, rng: random.Random, sent: float) -> dict:
    body = {"prompt": [rng.randrange(1000, 10000) for _ in range(PROMPT_TOKENS)], "max_tokens": MAX_TOKENS,
            "ignore_eos": True, "temperature": 0, "stream": True}
    async with s.post(url + "/v1/completions", json=body) as r:
        if r.status != 200:
            await r.read()
            return {"sent": sent, "status": r.status, "retry_after": r.headers.get("Retry-After")}
        first = None
        async for line in r.content:
            if first is None and line.startswith(b"data: {") and b'"text"' in line:
                first = time.perf_counter()
        return {"sent": sent, "status": 200, "ttft": first - sent if first else None, "done": time.perf_counter()}


async def at_capacity(url: str, users: int, seconds: float, seed: int) -> list[dict]:
    rng, out, end = random.Random(seed), [], time.perf_counter() + seconds

    async def user(s: aiohttp.ClientSession) -> None:
        while time.perf_counter() < end:
            out.append(await _one(s, url, rng, time.perf_counter()))

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        await asyncio.gather(*(user(s) for _ in range(users)))
    return out


async def open_loop(url: str, rate: float, seconds: float, seed: int) -> list[dict]:
    rng, tasks = random.Random(seed), []
    start = time.perf_counter()
    t = start
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        while (t := t + rng.expovariate(rate)) < start + seconds:
            await asyncio.sleep(max(0.0, t - time.perf_counter()))
            tasks.append(asyncio.create_task(_one(s, url, rng, time.perf_counter())))
        results = await asyncio.gather(*tasks)
    for r in results:
        r["offset"] = r["sent"] - start
    return results


def _p50(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def measure(engine: Path, variant: str, batch: int, seconds: float, seed: int, work: Path) -> dict:
    log = work / f"{variant}-{seed}.log"
    server = Server(engine, VARIANTS[variant], log)
    before = contention.read()
    try:
        cap = asyncio.run(at_capacity(server.url, batch, seconds, seed))
        done = [r for r in cap if r["status"] == 200]
        capacity_rps = len(done) / seconds
        cap_ttft = _p50([r["ttft"] for r in done if r["ttft"] is not None])
        log_start = log.stat().st_size
        over = asyncio.run(open_loop(server.url, 3 * capacity_rps, seconds, seed + 1))
    finally:
        server.stop()
    machine = contention.between(before, contention.read())
    admitted = [r for r in over if r["status"] == 200 and r["offset"] >= seconds / 4 and r["ttft"] is not None]
    refused = [r for r in over if r["status"] == 429]
    with log.open() as f:
        f.seek(log_start)
        lines = [json.loads(x) for x in f if x.startswith("{")]
    served = [x for x in lines if x.get("status") == 200 and x.get("queue_ms") is not None]
    queued_ms = [x["queue_ms"] for x in served if x["queue_ms"] > 5]
    estimates = [x["estimated_wait_s"] for x in lines if x.get("status") == 429 and x.get("estimated_wait_s")]
    # queued and admitted: the wait estimated on arrival against the wait that followed
    told = [x["queue_ms"] / 1000 / x["estimated_wait_s"] for x in served if x.get("estimated_wait_s")]
    over_ttft = _p50([r["ttft"] for r in admitted])
    return {
        "variant": variant, "seed": seed, "capacity_rps": capacity_rps, "offered_rps": 3 * capacity_rps,
        "capacity_ttft_p50_s": cap_ttft, "overload_ttft_p50_s": over_ttft,
        "ttft_ratio": over_ttft / cap_ttft if over_ttft and cap_ttft else None,
        "overload_requests": len(over), "admitted": sum(r["status"] == 200 for r in over), "refused": len(refused),
        "retry_after_p50_s": _p50([float(r["retry_after"]) for r in refused if r.get("retry_after")]),
        "estimated_wait_p50_s": _p50(estimates),
        "queued_admitted": len(queued_ms), "queue_wait_p50_s": _p50(queued_ms) and _p50(queued_ms) / 1000,
        "real_over_estimated_wait_p50": _p50(told),
        "machine": machine,
    }


def _spread(values: list[float]) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    return f"{statistics.median(values):.2f} [{min(values):.2f}, {max(values):.2f}]"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seconds", type=float, default=40)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--quick", action="store_true")
    a = p.parse_args()
    if a.quick:
        a.rounds, a.seconds, a.batch = 1, 20, 8
    from kiln.core.home import kiln_cache

    cache = kiln_cache()
    engine = build_engine(a.batch, cache)
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for round_ in range(a.rounds):
            order = list(VARIANTS) if round_ % 2 == 0 else list(reversed(VARIANTS))
            for variant in order:
                row = measure(engine, variant, a.batch, a.seconds, 1000 * round_ + 7, Path(work))
                rows.append(row)
                print(json.dumps(row), flush=True)
    out = ROOT / "bench" / "results" / "overload.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    summary = {}
    for variant in VARIANTS:
        mine = [r for r in rows if r["variant"] == variant]
        summary[variant] = {k: _spread([r[k] for r in mine]) for k in
                            ("capacity_rps", "capacity_ttft_p50_s", "overload_ttft_p50_s", "ttft_ratio",
                             "retry_after_p50_s", "estimated_wait_p50_s", "queue_wait_p50_s",
                             "real_over_estimated_wait_p50")}
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps({"batch": a.batch, "seconds": a.seconds, "rounds": a.rounds,
                               "prompt_tokens": PROMPT_TOKENS, "max_tokens": MAX_TOKENS,
                               "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
                               "runs": rows, "summary": summary}, indent=1))
    tmp.replace(out)
    keys = ("capacity_rps", "capacity_ttft_p50_s", "overload_ttft_p50_s", "ttft_ratio", "retry_after_p50_s",
            "estimated_wait_p50_s", "queue_wait_p50_s", "real_over_estimated_wait_p50")
    print(f"\nB = {a.batch}, {a.rounds} round(s) of {a.seconds:g} s phases; median [min, max] over rounds")
    print(f"{'':>30}" + "".join(f"{v:>26}" for v in VARIANTS))
    for k in keys:
        print(f"{k:>30}" + "".join(f"{summary[v][k]:>26}" for v in VARIANTS))
    loads = [r["machine"].get("cpu_pressure") for r in rows]
    print(f"cpu pressure per run: {', '.join('-' if x is None else f'{x:.2f}' for x in loads)}")
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
