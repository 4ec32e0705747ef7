"""Cold start of `kiln serve`: process start to ready, split into boot, engine load and warm-up.

Starts `kiln serve ENGINE_DIR` --runs times per engine (a fresh process each time, page cache warm
after the first), reads the server's own figures from /health once it answers 200, sends SIGTERM
and checks the process drains and exits 0. boot = interpreter, imports, server up; load = the
backend's `load_engine` (importing torch/transformers included); warm-up = one short generation
and one scoring pass. Writes bench/results/cold_start.json and prints a table (medians).

    python bench/cold_start.py ENGINE_DIR [ENGINE_DIR ...] [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from kiln.core.files import atomic_write_json, read_json

OUT = Path(__file__).parent / "results" / "cold_start.json"
PHASES = ("boot_s", "load_s", "warmup_s", "total_s")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _health(url: str) -> dict | None:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            return json.loads(r.read())
    except (urllib.error.URLError, ConnectionError):  # 503 while loading, or not listening yet
        return None


def one_start(engine_dir: Path, timeout_s: float = 600) -> dict[str, float]:
    """One `kiln serve` process: its cold-start figures, after checking it drains and exits 0."""
    port = _free_port()
    kiln = str(Path(sys.executable).with_name("kiln"))
    proc = subprocess.Popen([kiln, "serve", str(engine_dir), "--port", str(port), "--request-log", "off"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + timeout_s
        while (health := _health(f"http://127.0.0.1:{port}")) is None:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"kiln serve {engine_dir} did not become ready (exit {proc.poll()})")
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        if proc.wait(timeout=60) != 0:
            raise RuntimeError(f"kiln serve exited {proc.returncode} after SIGTERM")
        return health["cold_start"]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("engines", nargs="+", type=Path)
    p.add_argument("--runs", type=int, default=3)
    a = p.parse_args()
    results = []
    for engine in a.engines:
        manifest = read_json(engine / "kiln-engine.json")
        runs = [one_start(engine) for _ in range(a.runs)]
        median = {k: round(statistics.median(r[k] for r in runs), 2) for k in PHASES}
        size = sum(f.stat().st_size for f in Path(manifest["source"]["path"]).rglob("*") if f.is_file())
        results.append({"engine": str(engine), "backend": manifest["backend"], "model_mb": round(size / 2**20),
                        "runs": runs, "median": median})
    atomic_write_json(OUT, {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                                        "loadavg_1m": os.getloadavg()[0]}, "results": results})
    print(f"{'engine':<28} {'model MB':>8} " + " ".join(f"{k:>9}" for k in PHASES))
    for r in results:
        print(f"{Path(r['engine']).name:<28} {r['model_mb']:>8} " + " ".join(f"{r['median'][k]:>9.2f}" for k in PHASES))
    print(f"load average {os.getloadavg()[0]:.1f} ({os.cpu_count()} CPUs); written to {OUT}")


if __name__ == "__main__":
    main()
