"""Prefix caching measured where it acts (issue 53, points 3 and 6), on the demo checkpoint's GGUF
through kiln serve over the llama_cpp engine's server runtime (llama-server's prompt cache).

1. TTFT with and without the cache: one kiln serve (2 threads, one slot) and the load stage's
   prefix-sharing workload (evaluate/perf/prefix.py): a shared system prompt of `--system-tokens`,
   then a distinct user turn of `--user-tokens`, one user, `--requests` requests, the same workload
   sent with `cache_prompt: true` and `false`, which one first alternating round by round.
2. Placement by prefix against round-robin: two kiln serve replicas (1 thread, one slot each) behind
   `kiln route`, `--prefixes` system prompts, each request drawing one, `--users` closed-loop users.
   Each round runs both balances, alternating which first, each with system prompts new to both
   replicas (its own seed).

The hit rate is the servers' own: `usage.prompt_tokens_details.cached_tokens` over prompt tokens
(llama-server's `cache_n`), summed by the load client. Every figure is the median of the rounds with
[min, max]; each cell records the load average and the machine's contention (CPU pressure, steal).

    flock /tmp/kiln-heavy.lock .venv/bin/python bench/prefix_cache.py --rounds 3

Writes bench/results/prefix_cache.json (or --out) and prints a table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
import cpu_engines

from kiln.evaluate import contention

OUT = Path(__file__).parent / "results" / "prefix_cache.json"


def engine_dir(checkpoint: Path, kind: str, threads: int) -> Path:
    """The llama_cpp server runtime over the gguf method's artifact, one slot, built once into the cache."""
    import kiln.engine.llama_cpp.backend  # noqa: F401  (registers the backend)
    from kiln.core.files import cached_tree_hash
    from kiln.engine.cache import build_engine
    from kiln.engine.loader import engine_config
    from kiln.core.home import kiln_cache

    artifact = cpu_engines.gguf_artifact(checkpoint, kind, threads)
    digest = cached_tree_hash(artifact, kiln_cache() / "hashes.json")
    config = engine_config({"config": {"backend": "llama_cpp", "runtime": "server", "threads": threads, "parallel": 1}})
    return build_engine(config, artifact, digest, kiln_cache())


def load_config(args: argparse.Namespace, seed: int, prefixes: int, users: int):
    from kiln.evaluate.perf.config import PerformanceConfig

    return PerformanceConfig.model_validate({
        "seed": seed, "repeats": 1, "workload": {"input_tokens": {"mean": args.system_tokens}},
        "prefix": {"user_tokens": args.user_tokens, "prefixes": prefixes, "concurrency": users,
                   "requests": args.requests, "output_tokens": args.output_tokens}})


def measured(run_or_summary: Any, started: tuple[float, contention.Reading]) -> dict[str, Any]:
    s = run_or_summary
    return {"ttft_p50_ms": s.ttft_ms["p50"], "ttft_p95_ms": s.ttft_ms["p95"], "cache_hit_rate": s.cache_hit_rate,
            "errors": s.errors, "completed": s.completed, "load_average": os.getloadavg()[0],
            **contention.between(started[1], contention.read())}


def cache_on_off(url: str, args: argparse.Namespace, round_: int) -> dict[str, dict[str, Any]]:
    from kiln.evaluate.perf.prefix_run import prefix_load
    from kiln.evaluate.perf.runner import run_load

    cfg, out = load_config(args, 0, 1, 1), {}
    for cache in (True, False) if round_ % 2 == 0 else (False, True):
        started = (time.time(), contention.read())
        run = run_load(url, prefix_load(cfg, cache), salt=f"r{round_}{cache}")
        out["cached" if cache else "uncached"] = measured(run.summary, started)
    return out


def balances(urls: list[str], args: argparse.Namespace, round_: int) -> dict[str, dict[str, Any]]:
    from kiln.deploy.config import RouterConfig
    from kiln.deploy.router_process import RouterProcess
    from kiln.evaluate.perf.prefix_run import prefix_load
    from kiln.evaluate.perf.runner import run_load

    out = {}
    order = ("prefix", "round-robin") if round_ % 2 == 0 else ("round-robin", "prefix")
    for k, balance in enumerate(order):
        cfg = load_config(args, 1000 + 2 * round_ + k, args.prefixes, args.users)  # prompts new to both replicas
        with RouterProcess(RouterConfig(port=0, stable_url=",".join(urls), balance=balance)) as router:
            started = (time.time(), contention.read())
            run = run_load(router.url, prefix_load(cfg, True), salt=f"r{round_}")
            out[balance] = measured(run.summary, started) | {
                "sent": [s["sent"] for s in router.state()["replicas"]["stable"].values()]}
    return out


def median_spread(values: list[float | None]) -> dict[str, float | None]:
    xs = [v for v in values if v is not None]
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)} if xs else {"median": None}


def summarize(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    return {variant: {key: median_spread([r[variant][key] for r in rounds])
                      for key in ("ttft_p50_ms", "ttft_p95_ms", "cache_hit_rate", "load_average", "cpu_pressure")
                      if key in rounds[0][variant]}
            for variant in rounds[0]}


def _cell(figure: dict[str, Any], fmt: str) -> str:
    if figure.get("median") is None:
        return "—"
    return f"{figure['median']:{fmt}} [{figure['min']:{fmt}}, {figure['max']:{fmt}}]"


def print_table(result: dict[str, Any]) -> None:
    print(f"\n{result['cpu']}, {result['cpus']} CPUs, {result['rounds']} rounds; median [min, max]")
    print(f"{'what':<34} {'TTFT p50 (ms)':<24} {'TTFT p95 (ms)':<24} {'cache hit rate':<22} {'CPU pressure':<20}")
    for part, title in (("cache", "one server, cache {}"), ("router", "2 replicas, balance {}")):
        for variant, fig in result[part]["summary"].items():
            print(f"{title.format(variant):<34} {_cell(fig['ttft_p50_ms'], '.1f'):<24} "
                  f"{_cell(fig['ttft_p95_ms'], '.1f'):<24} {_cell(fig['cache_hit_rate'], '.2f'):<22} "
                  f"{_cell(fig.get('cpu_pressure', {}), '.2f'):<20}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="checkpoint (default: the demo model)")
    p.add_argument("--kind", default="q8_0", help="the GGUF type served")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--system-tokens", type=int, default=512)
    p.add_argument("--user-tokens", type=int, default=32)
    p.add_argument("--output-tokens", type=int, default=4)
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--prefixes", type=int, default=4)
    p.add_argument("--users", type=int, default=2)
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args()
    if args.model is None:
        from kiln.pipeline.demo.prepare import demo_model_dir

        args.model = demo_model_dir()
    load0 = os.getloadavg()
    cache_rounds, router_rounds = [], []
    with cpu_engines.kiln_serve(engine_dir(args.model, args.kind, 2)) as url:
        for r in range(args.rounds):
            cache_rounds.append(cache_on_off(url, args, r))
    replica = engine_dir(args.model, args.kind, 1)
    with contextlib.ExitStack() as stack:
        urls = [stack.enter_context(cpu_engines.kiln_serve(replica)) for _ in range(2)]
        for r in range(args.rounds):
            router_rounds.append(balances(urls, args, r))
    result = {"cpu": cpu_engines.cpu_identity().get("name", "?"), "cpus": os.cpu_count(), "rounds": args.rounds,
              "model": str(args.model), "kind": args.kind, "args": {k: str(v) for k, v in vars(args).items()},
              "load_average_start": load0, "load_average_end": os.getloadavg(),
              "cache": {"rounds": cache_rounds, "summary": summarize(cache_rounds)},
              "router": {"rounds": router_rounds, "summary": summarize(router_rounds)}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print_table(result)


if __name__ == "__main__":
    main()
