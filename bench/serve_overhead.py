"""kiln serve against the engine it serves, for any backend: what the serving path costs a stream.

bench/llama_cpp_runtimes.py measures this for llama.cpp's two runtimes, framed by `llama-bench`.
This one takes any built engine folder (OpenVINO's, which the searches at 1B and 3B pick; a
llama.cpp one; CTranslate2's) and, round by round in alternating order, measures the engine driven
directly in this process (a 16-token prompt, then a greedy decode of `--decode-tokens`, first token
excluded: what the evaluate stage measures) and a stream of the same request through a `kiln serve`
process over the same folder with the openai-compatible endpoint (first token excluded), each the
median of three. kiln serve's cost is the stream over the engine driven directly, per round (the two
figures a minute apart at most). While each stream runs, another client asks `/health` every 50 ms:
the longest answer is how long the server's event loop was kept from running (a backend whose
`step()` holds the GIL keeps it for a whole step). Medians of the rounds with [min, max]; the load
average and the machine's contention are recorded.

    flock /tmp/kiln-heavy.lock .venv/bin/python bench/serve_overhead.py ENGINE_DIR --rounds 3

Writes bench/results/serve_overhead-<engine folder>.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
import cpu_engines
from llama_cpp_runtimes import PROMPT, _spread, direct_rate

from kiln.evaluate import contention

RESULTS = Path(__file__).parent / "results"


class HealthProbe:
    """`/health` asked every `interval_s` on a thread while the block runs; the longest answer (s)."""

    def __init__(self, url: str, interval_s: float = 0.05):
        self.url, self.interval_s, self.longest = url + "/health", interval_s, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            began = time.perf_counter()
            with urllib.request.urlopen(self.url, timeout=60) as r:
                r.read()
            self.longest = max(self.longest, time.perf_counter() - began)
            self._stop.wait(self.interval_s)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def served_rate(url: str, n: int, probes: list[float]) -> float:
    with HealthProbe(url) as probe:
        rate = cpu_engines.stream_decode(url, PROMPT, n)[0]
    probes.append(probe.longest)
    return rate


def measure(engine_dir: Path, rounds: int, n: int) -> dict[str, Any]:
    from kiln.engine.loader import load_engine

    figures: dict[str, list[float]] = {"direct": [], "serve": []}
    per_round: list[float] = []
    probes: list[float] = []
    engine = load_engine(engine_dir)
    try:
        with cpu_engines.kiln_serve(engine_dir) as url:
            direct_rate(engine, 8)  # warm both paths
            cpu_engines.stream_decode(url, PROMPT, 8)
            for r in range(rounds):
                got = {}
                for how in ("direct", "serve") if r % 2 == 0 else ("serve", "direct"):
                    got[how] = statistics.median(served_rate(url, n, probes) if how == "serve"
                                                 else direct_rate(engine, n) for _ in range(3))
                    figures[how].append(round(got[how], 2))
                per_round.append(round(got["serve"] / got["direct"], 3))
    finally:
        engine.close()
    return {"tok_s": {k: _spread(v) for k, v in figures.items()}, "tok_s_rounds": figures,
            "serve_over_direct": _spread(per_round), "serve_over_direct_rounds": per_round,
            "health_longest_s": _spread(probes), "health_longest_s_all": [round(p, 3) for p in probes]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("engine_dir", type=Path, help="a built engine folder (kiln-engine.json inside)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    manifest = json.loads((args.engine_dir / "kiln-engine.json").read_text())
    watch = contention.Watch()
    load_start = os.getloadavg()
    started = time.time()
    with watch:
        row = measure(args.engine_dir, args.rounds, args.decode_tokens)
    result = {"engine_dir": str(args.engine_dir), "backend": manifest.get("backend"), "config": manifest.get("config"),
              "source": manifest.get("source", {}).get("path"), "rounds": args.rounds, "decode_tokens": args.decode_tokens,
              "cpu": cpu_engines.cpu_identity(), "machine": platform.machine(), "cpus": os.cpu_count(),
              "load_average_start": load_start, "load_average_end": os.getloadavg(),
              "contention": contention.as_metrics(watch.figures()), "seconds": round(time.time() - started), **row}
    out = args.out or RESULTS / f"serve_overhead-{args.engine_dir.name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    t, v, h = row["tok_s"], row["serve_over_direct"], row["health_longest_s"]
    print(f"{result['backend']} {args.engine_dir.name}: engine {t['direct'][0]:.2f} tok/s [{t['direct'][1]}, "
          f"{t['direct'][2]}], kiln serve {t['serve'][0]:.2f} [{t['serve'][1]}, {t['serve'][2]}]")
    print(f"kiln serve over the engine driven directly, per round: {v[0]:.3f} [{v[1]:.3f}, {v[2]:.3f}] "
          f"({args.rounds} rounds)")
    print(f"longest /health answer during a stream: {h[0]:.3f} s [{h[1]:.3f}, {h[2]:.3f}]")
    print(f"load average {load_start[0]:.2f} -> {os.getloadavg()[0]:.2f}; {result['contention']}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
