"""Does the load generator's achieved rate match what the server saw, and whom does it blame? (issue #18)

Server: kiln's fake engine with unlimited capacity and no latency (`ttft_ms=0, tpot_ms=0`), in its
own process, so whatever limits the rate is CPU: the client's or the server's. Client:
`kiln.evaluate.perf.runner.run_load` at constant open-loop rates, rates interleaved round by round.

Per run it records the generator's `achieved_rate`, the rate the server saw arrive in the same
measurement window (the fake's own arrival log: time.monotonic, the CLOCK_MONOTONIC that the
client's time.perf_counter reads on Linux), the send lag (actual - scheduled send), the transit
from the client's send to the server's handler (i-th arrival - i-th send), the CPU each process
used per second, `limited_by` and the stop reason. When the server falls behind reading what the
client sent, transit grows and the two rates part: that is the server's limit, and the stage
should say "server"; when sends are late it should say "client".

Writes bench/results/loadgen_send_rate.json (every run, medians with [min, max], the load
average) and prints a table. Heavy: run it under the lock.

    flock /tmp/kiln-heavy.lock .venv/bin/python bench/loadgen_send_rate.py            # 150 200 400 800, 3 rounds
    flock /tmp/kiln-heavy.lock .venv/bin/python bench/loadgen_send_rate.py --quick    # 2 rounds, 4 s stages
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import time
from pathlib import Path

from kiln.engine.serve.fake import FakeEngineConfig, FakeServer
from kiln.evaluate.perf.config import PerformanceConfig
from kiln.evaluate.perf.metrics import achieved_rate
from kiln.evaluate.perf.runner import run_load
from kiln.core.files import atomic_write_json

OUT = Path(__file__).resolve().parent / "results" / "loadgen_send_rate.json"


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


def one_run(server: FakeServer, rate: float, duration: float, output_tokens: int, prompt_tokens: int) -> dict:
    cfg = PerformanceConfig.model_validate({
        "shape": {"kind": "constant", "rate": rate}, "duration_s": duration,
        "warmup": {"seconds": 1}, "cooldown": {"seconds": 1}, "output_tokens": output_tokens,
        "workload": {"input_tokens": {"mean": prompt_tokens}}})
    server.arrivals(reset=True)
    load1 = os.getloadavg()[0]
    s0, c0, t0 = _cpu_s(server.pid), _own_cpu_s(), time.monotonic()
    result = run_load(server.url, cfg)
    wall = time.monotonic() - t0
    server_cpu, client_cpu = (_cpu_s(server.pid) - s0) / wall, (_own_cpu_s() - c0) / wall
    arrivals = sorted(server.arrivals(reset=True))
    stage, s = result.stages[0], result.summary
    w0, w1 = stage.window
    sends = sorted(r.sent for r in stage.records if r.sent)
    transit = sorted(a - b for a, b in zip(arrivals, sends))
    return {
        "rate": rate, "reported_rate": s.achieved_rate,
        "server_rate": achieved_rate([t for t in arrivals if w0 <= t < w1]),
        "send_lag_ms": s.send_lag_ms, "transit_p50_ms": 1000 * transit[len(transit) // 2] if transit else None,
        "transit_max_ms": 1000 * transit[-1] if transit else None, "limited_by": s.limited_by,
        "stopped_early": s.stopped_early, "sent": len(sends), "server_requests": len(arrivals),
        "server_cpu": server_cpu, "client_cpu": client_cpu, "load1": load1,
    }


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rates", type=float, nargs="+", default=[150, 200, 400, 800])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=6.0, help="length of each stage (1 s warm-up, 1 s cool-down)")
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--quick", action="store_true", help="2 rounds of 4 s stages")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.seconds = 2, 4.0
    runs: list[dict] = []
    start_load = os.getloadavg()
    with FakeServer(FakeEngineConfig(ttft_ms=0, tpot_ms=0)) as server:
        for k in range(args.rounds):
            for rate in args.rates:
                runs.append({"round": k, **one_run(server, rate, args.seconds, args.output_tokens, args.prompt_tokens)})
                r = runs[-1]
                print(f"round {k} {rate:>5g}/s: reported {r['reported_rate']:7.1f}, server saw {r['server_rate']:7.1f}, "
                      f"lag p99 {r['send_lag_ms']['p99']:7.1f} ms, limited_by {r['limited_by']}", flush=True)
    per_rate = {}
    for rate in args.rates:
        mine = [r for r in runs if r["rate"] == rate]
        per_rate[f"{rate:g}"] = {
            "reported_rate": _spread([r["reported_rate"] for r in mine]),
            "server_rate": _spread([r["server_rate"] for r in mine]),
            "send_lag_p99_ms": _spread([r["send_lag_ms"]["p99"] for r in mine]),
            "limited_by": [r["limited_by"] for r in mine],
        }
    atomic_write_json(OUT, {
        "args": vars(args), "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                        "load_start": start_load, "load_end": os.getloadavg()},
        "per_rate": per_rate, "runs": runs})
    print(f"\n{'rate':>6} {'reported':>24} {'server saw':>24} {'lag p99 ms':>24}  limited_by")
    for rate, p in per_rate.items():
        cells = [f"{p[k]['median']:7.1f} [{p[k]['min']:.1f}, {p[k]['max']:.1f}]"
                 for k in ("reported_rate", "server_rate", "send_lag_p99_ms")]
        print(f"{rate:>6} " + " ".join(f"{c:>24}" for c in cells) + f"  {p['limited_by']}")
    print(f"\nwrote {OUT}")


if __name__ == "__main__":
    main()
