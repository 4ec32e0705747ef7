"""Speculative decoding where it acts (issue 53, point 4): the demo checkpoint's q8_0 GGUF through kiln's
llama_cpp engine (server runtime, one slot) without speculation and with each speculative type, on the
two prompt sets kiln ships, against `llama-bench` q8_0 of the same file.

- workloads: 'demo-copy' (rewrite an Austen passage, fixing its typos: greedy output copies the prompt)
  and 'demo' (GSM8K questions), the first --prompts of each, as the benchmark tokenizes them (no chat
  template), greedy, --tokens new tokens with the end token passed (the decode benchmark's request);
- variants: plain (the twin), ngram-simple, ngram-mod, and draft (a q4_0 GGUF of the same checkpoint
  drafting for the q8_0);
- each round runs every prompt on every variant back to back, in an order that alternates prompt by
  prompt, then `llama-bench` tg at the prompts' mean depth (the same file, threads, positions).

Per workload and variant: decode tok/s (the benchmark's: tokens after the first over their time), the
paired ratio to plain per prompt and round, the ratio to llama-bench, tokens drafted and accepted, and
how many greedy texts are identical to plain's. Medians with [min, max]; the load average and the
machine's contention (steal, CPU pressure) recorded.

    python bench/levers.py                       # 8 prompts, 128 tokens, 3 rounds, 2 threads
    python bench/levers.py --prompts 4 --rounds 2 --variant plain --variant ngram-simple

Writes bench/results/levers.json (or --out) and prints a table.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
import cpu_engines

from kiln.evaluate import contention

OUT = Path(__file__).parent / "results" / "levers.json"
WORKLOADS = ("demo-copy", "demo")
VARIANTS: dict[str, dict[str, Any] | None] = {
    "plain": None, "ngram-simple": {"type": "ngram-simple"}, "ngram-mod": {"type": "ngram-mod"},
    "draft": {"type": "draft"},  # draft_model filled in: the q4_0 GGUF
}


def engines(checkpoint: Path, threads: int, variants: list[str]) -> dict[str, Any]:
    """One loaded engine per variant, each its own llama-server over the same q8_0 file."""
    import kiln.engine.llama_cpp.backend  # noqa: F401  (registers the backend)
    from kiln.core.files import cached_tree_hash
    from kiln.engine.cache import build_engine
    from kiln.engine.loader import engine_config, load_engine
    from kiln.optimize.gguf import GGUF_FILE
    from kiln.core.home import kiln_cache

    artifact = cpu_engines.gguf_artifact(checkpoint, "q8_0", threads)
    digest = cached_tree_hash(artifact, kiln_cache() / "hashes.json")
    out = {}
    for name in variants:
        spec = VARIANTS[name]
        if spec and spec["type"] == "draft":
            spec = {**spec, "draft_model": str(cpu_engines.gguf_artifact(checkpoint, "q4_0", threads) / GGUF_FILE)}
        config = {"backend": "llama_cpp", "runtime": "server", "threads": threads, "parallel": 1,
                  **({"speculative": spec} if spec else {})}
        out[name] = load_engine(build_engine(engine_config({"config": config}), artifact, digest, kiln_cache()))
    out["_gguf"] = out["plain"].gguf_path  # the file every variant serves, for llama-bench
    return out


def one(engine: Any, prompt: list[int], n: int) -> dict[str, Any]:
    """The decode benchmark's request: greedy, n tokens, end token passed, prompt prefilled in full."""
    from kiln.engine.base import GenerationRequest

    events = list(engine.generate([GenerationRequest(prompt, n, ignore_eos=True, cache_prompt=False)]))
    stats = events[-1].stats or {}
    return {"tok_s": (len(events) - 1) / (events[-1].time - events[0].time), "tokens": [e.token_id for e in events],
            "drafted": stats.get("draft_tokens", 0), "accepted": stats.get("draft_accepted", 0)}


def copied(tokens: list[int], prompt: list[int], k: int = 8) -> float:
    """Share of the output's k-grams found in the prompt: how much of the answer is a copy."""
    grams = {tuple(tokens[i:i + k]) for i in range(len(tokens) - k + 1)}
    return len(grams & {tuple(prompt[i:i + k]) for i in range(len(prompt) - k + 1)}) / max(1, len(grams))


def measure(workload: str, loaded: dict[str, Any], names: list[str], n_prompts: int, n: int, rounds: int,
            threads: int) -> dict[str, Any]:
    from kiln.pipeline.stages.inputs import tokenized_prompts

    prompts = tokenized_prompts(workload, n_prompts, loaded[names[0]].tokenizer)
    depth = round(statistics.mean(map(len, prompts)))
    runs: dict[str, list[list[dict[str, Any]]]] = {v: [] for v in names}
    bench: list[float] = []
    pair = 0
    for _ in range(rounds):
        for v in names:
            runs[v].append([])
        for p in prompts:
            for v in names if pair % 2 == 0 else names[::-1]:
                runs[v][-1].append(one(loaded[v], p, n))
            pair += 1
        bench.append(cpu_engines.llama_bench(loaded["_gguf"], threads, n, depth, prefill=False)["bench_tg_tok_s"])
    return summarize(workload, runs, bench, prompts)


def summarize(workload: str, runs: dict[str, list[list[dict[str, Any]]]], bench: list[float],
              prompts: list[list[int]]) -> dict[str, Any]:
    plain = runs["plain"]
    row: dict[str, Any] = {"workload": workload, "llama_bench_tg_tok_s": _spread(bench), "variants": {},
                           "copied_8grams_plain": round(statistics.mean(
                               copied(r["tokens"], p) for r, p in zip(plain[0], prompts)), 3)}
    for v, rounds in runs.items():
        per_round = [statistics.median(r["tok_s"] for r in rnd) for rnd in rounds]
        paired = [r["tok_s"] / b["tok_s"] for rnd, base in zip(rounds, plain) for r, b in zip(rnd, base)]
        drafted = sum(r["drafted"] for rnd in rounds for r in rnd)
        accepted = sum(r["accepted"] for rnd in rounds for r in rnd)
        row["variants"][v] = {
            "tok_s": _spread(per_round), "over_plain": _spread(paired),
            "over_llama_bench": _spread([t / b for t, b in zip(per_round, bench)]),
            "draft_tokens": drafted, "draft_accepted": accepted,
            "acceptance_rate": round(accepted / drafted, 3) if drafted else None,
            "identical_to_plain": sum(r["tokens"] == b["tokens"] for rnd, base in zip(rounds, plain)
                                      for r, b in zip(rnd, base)),
            "requests": sum(len(rnd) for rnd in rounds)}
    return row


def _spread(xs: list[float]) -> list[float]:
    """[median, min, max]."""
    return [round(statistics.median(xs), 3), round(min(xs), 3), round(max(xs), 3)]


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'workload':<10}{'variant':<14}{'tok/s':>24}{'x plain (paired)':>24}{'x llama-bench':>24}"
          f"{'accepted':>10}{'same text':>11}")
    for row in rows:
        for v, f in row["variants"].items():
            cells = [f"{x[0]:.3g} [{x[1]:.3g}, {x[2]:.3g}]" for x in (f["tok_s"], f["over_plain"], f["over_llama_bench"])]
            acc = "—" if f["acceptance_rate"] is None else f"{f['acceptance_rate']:.0%}"
            print(f"{row['workload']:<10}{v:<14}" + "".join(f"{c:>24}" for c in cells)
                  + f"{acc:>10}{f['identical_to_plain']:>6}/{f['requests']}")
        print(f"{'':<10}llama-bench q8_0 tg: {row['llama_bench_tg_tok_s']}; plain output's 8-grams found in the "
              f"prompt: {row['copied_8grams_plain']:.0%}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="checkpoint (default: the demo model)")
    p.add_argument("--variant", action="append", dest="variants", choices=list(VARIANTS),
                   help="repeatable (default: all); plain is always measured, as the twin")
    p.add_argument("--workload", action="append", dest="workloads", choices=WORKLOADS)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args()
    if args.model is None:
        from kiln.pipeline.demo.prepare import demo_model_dir

        args.model = demo_model_dir()
    names = ["plain", *[v for v in args.variants or VARIANTS if v != "plain"]]
    started, load0, busy0 = time.time(), os.getloadavg(), contention.read()
    loaded = engines(args.model, args.threads, names)
    try:
        rows = [measure(w, loaded, names, args.prompts, args.tokens, args.rounds, args.threads)
                for w in args.workloads or WORKLOADS]
    finally:
        for v in names:
            loaded[v].close()
    from kiln.core.files import atomic_write_json

    result = {"machine": platform.processor() or platform.machine(), "cpu": cpu_engines.cpu_identity(),
              "cpus": os.cpu_count(), "model": str(args.model), "threads": args.threads, "prompts": args.prompts,
              "tokens": args.tokens, "rounds": args.rounds, "load_average_start": load0,
              "load_average_end": os.getloadavg(), "contention": contention.between(busy0, contention.read()),
              "seconds": round(time.time() - started), "rows": rows}
    atomic_write_json(args.out, result)
    print_table(rows)
    busy = result["contention"]
    print(f"load average {load0[0]:.2f} at the start, {result['load_average_end'][0]:.2f} at the end; steal "
          f"{busy['cpu_steal'] or 0:.1%} of CPU time, CPU pressure {busy['cpu_pressure'] or 0:.1%} over the run")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
