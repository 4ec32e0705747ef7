"""The llama_cpp engine's two runtimes against `llama-bench`: batch-1 decode driven directly and
through kiln serve.

For each GGUF type, one engine folder per runtime (`server`: a llama-server process kiln streams
from; `library`: llama.cpp in kiln's process, batched by kiln), same file, threads and slots. A
round measures, in alternating order, each runtime's engine driven directly (what kiln's
evaluate stage measures: a median of three 64-token greedy decodes after a 16-token prompt, first
token excluded) and the median of three streams through a `kiln serve` process over it (the same
count, so neither side gets the steadier figure), each framed by a
`llama-bench` tg64 at depth 16 before and after (the same positions); a figure's ratio is to the
mean of its two frames. Each type other than `--reference` (q8_0) is also measured driven directly
in the library runtime between two `llama-bench` runs of the reference's file: how the type kiln
might pick decodes against plain llama.cpp at q8_0. Medians of the rounds with [min, max]; the
load average and the machine's contention (steal, CPU pressure) are recorded. Per runtime, kiln serve's
stream over the engine driven directly is also given, per round, as the ratio of the two figures' ratios to
their own llama-bench frames (each measured at its own moment, so a slower machine at one of them does not
count as kiln serve's cost).

    python bench/llama_cpp_runtimes.py                        # q4_0, q4_1, q8_0; 2 threads; 5 rounds
    python bench/llama_cpp_runtimes.py --type q4_0 --rounds 3 --threads 1
    python bench/llama_cpp_runtimes.py --model CHECKPOINT --type q8_0 --out bench/results/llama_cpp_runtimes-1b.json

Writes bench/results/llama_cpp_runtimes.json (or --out) and prints a table.
"""

from __future__ import annotations

import argparse
import contextlib
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

OUT = Path(__file__).parent / "results" / "llama_cpp_runtimes.json"
RUNTIMES = ("server", "library")
PROMPT = list(range(1000, 1016))


def engine_dirs(checkpoint: Path, kind: str, threads: int) -> dict[str, Path]:
    import kiln.engine.llama_cpp.backend  # noqa: F401  (registers the backend)
    from kiln.engine.cache import build_engine
    from kiln.engine.loader import engine_config
    from kiln.core.home import kiln_cache
    from kiln.core.files import cached_tree_hash

    artifact = cpu_engines.gguf_artifact(checkpoint, kind, threads)
    digest = cached_tree_hash(artifact, kiln_cache() / "hashes.json")
    return {rt: build_engine(engine_config({"config": {"backend": "llama_cpp", "runtime": rt, "threads": threads,
                                                        "parallel": 4}}), artifact, digest, kiln_cache())
            for rt in RUNTIMES}


def direct_rate(engine, n: int) -> float:
    from kiln.engine.base import GenerationRequest

    times = [e.time for e in engine.generate([GenerationRequest(PROMPT, n, ignore_eos=True, cache_prompt=False)])]
    return (len(times) - 1) / (times[-1] - times[0])


def measure(kind: str, checkpoint: Path, threads: int, rounds: int, n: int, reference: str | None) -> dict[str, Any]:
    from kiln.engine.loader import load_engine
    from kiln.optimize.gguf import GGUF_FILE

    dirs = engine_dirs(checkpoint, kind, threads)
    gguf = dirs["server"] / GGUF_FILE  # the engine links the artifact's file under the same name
    figures: dict[str, list[float]] = {f"{how}_{rt}": [] for rt in RUNTIMES for how in ("direct", "serve")}
    frame_of = dict.fromkeys(figures, gguf)
    if reference and reference != kind:  # this type through kiln against llama-bench of the reference type
        figures["versus_library"] = []
        frame_of["versus_library"] = cpu_engines.gguf_artifact(checkpoint, reference, threads) / GGUF_FILE
    ratios: dict[str, list[float]] = {k: [] for k in figures}
    frames: list[float] = []
    with contextlib.ExitStack() as stack:
        engines = {rt: load_engine(d) for rt, d in dirs.items()}
        for e in engines.values():
            stack.callback(e.close)
        urls = {rt: stack.enter_context(cpu_engines.kiln_serve(d)) for rt, d in dirs.items()}
        for rt in RUNTIMES:  # warm both paths
            direct_rate(engines[rt], 8)
            cpu_engines.stream_decode(urls[rt], PROMPT, 8)
        for r in range(rounds):
            order = list(figures) if r % 2 == 0 else list(figures)[::-1]
            for key in order:
                how, rt = key.split("_")
                frame = frame_of[key]
                before = cpu_engines.llama_bench(frame, threads, n, len(PROMPT), prefill=False)["bench_tg_tok_s"]
                rate = statistics.median(cpu_engines.stream_decode(urls[rt], PROMPT, n)[0] if how == "serve"
                                         else direct_rate(engines[rt], n) for _ in range(3))
                after = cpu_engines.llama_bench(frame, threads, n, len(PROMPT), prefill=False)["bench_tg_tok_s"]
                figures[key].append(round(rate, 2))
                ratios[key].append(round(rate / ((before + after) / 2), 3))
                if frame == gguf:
                    frames += [before, after]
    row: dict[str, Any] = {"type": kind, "threads": threads, "engine_dirs": {k: str(v) for k, v in dirs.items()},
                           "reference": reference if "versus_library" in figures else None,
                           "bench_tg_tok_s": _spread(frames), "bench_tg_tok_s_all": [round(f, 2) for f in frames]}
    for key in figures:
        row[f"{key}_tok_s"], row[f"{key}_over_bench"] = _spread(figures[key]), _spread(ratios[key])
        row[f"{key}_over_bench_rounds"], row[f"{key}_tok_s_rounds"] = ratios[key], figures[key]
    for rt in RUNTIMES:  # kiln serve's cost: its stream over the engine driven directly, each against its frame
        per_round = [round(s / d, 3) for s, d in zip(ratios[f"serve_{rt}"], ratios[f"direct_{rt}"])]
        row[f"serve_over_direct_{rt}"], row[f"serve_over_direct_{rt}_rounds"] = _spread(per_round), per_round
    return row


def _spread(xs: list[float]) -> list[float]:
    """[median, min, max]."""
    return [round(statistics.median(xs), 3), round(min(xs), 3), round(max(xs), 3)]


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'GGUF':<8}{'thr':>4}  {'llama-bench':>12}  " + "  ".join(f"{k:>26}" for k in
          ("direct server", "direct library", "kiln serve server", "kiln serve library")))
    for r in rows:
        cells = [f"{r[f'{k}_over_bench'][0]:.3f} [{r[f'{k}_over_bench'][1]:.3f}, {r[f'{k}_over_bench'][2]:.3f}]"
                 for k in ("direct_server", "direct_library", "serve_server", "serve_library")]
        head = f"{r['type']:<8}{r['threads']:>4}  {r['bench_tg_tok_s'][0]:>12.1f}  "
        print(head + "  ".join(f"{c:>26}" for c in cells))
    print("(each: decode tok/s over llama-bench's at the same positions, median of rounds [min, max])")
    for r in rows:
        print(f"{r['type']}: kiln serve over the engine driven directly, " + ", ".join(
            f"{rt} {v[0]:.3f} [{v[1]:.3f}, {v[2]:.3f}]" for rt in RUNTIMES for v in [r[f"serve_over_direct_{rt}"]]))
    for r in rows:
        if r["reference"]:
            v = r["versus_library_over_bench"]
            print(f"{r['type']} through kiln (library runtime, driven directly) over llama-bench of {r['reference']}: "
                  f"{v[0]:.3f} [{v[1]:.3f}, {v[2]:.3f}]")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="checkpoint (default: the demo model)")
    p.add_argument("--type", action="append", dest="types", help="GGUF type (repeatable)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--reference", default="q8_0", help="also frame each other type's library-runtime decode with "
                   "llama-bench of this type (the rate a pick must match); '' for none")
    p.add_argument("--out", type=Path, default=OUT, help=f"result JSON (default: {OUT})")
    args = p.parse_args()
    if args.model is None:
        from kiln.pipeline.demo.prepare import demo_model_dir

        args.model = demo_model_dir()
    checkpoint = args.model
    started, load0, busy0 = time.time(), os.getloadavg(), contention.read()
    rows = [measure(kind, checkpoint, args.threads, args.rounds, args.decode_tokens, args.reference or None)
            for kind in args.types or ["q4_0", "q4_1", "q8_0"]]
    from kiln.core.files import atomic_write_json

    result = {"machine": platform.processor() or platform.machine(), "cpu": cpu_engines.cpu_identity(),
              "cpus": os.cpu_count(), "model": str(checkpoint), "load_average_start": load0,
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
