"""The torch backend on a bfloat16 checkpoint: torch's own bfloat16 kernel against engine/torch_bf16.py's
float32 products (`widen`), on the machine this runs on.

One process loads the checkpoint once in bfloat16; the two variants differ only in the class of its
`nn.Linear` layers (`native`: torch's, `wide`: `WideLinear`), switched between rounds, A B B A ...
Per round and variant:
- `score_s`: one scoring pass over `--score-tokens` tokens (as a rolling perplexity window does);
- `ttft_s`: the first token of a `--prompt-tokens` prompt (its prefill);
- `decode_tok_s`: `--decode-tokens` more tokens of that request at batch 1 (few rows: both variants
  run torch's kernel there, so the two should agree).
Every figure is the median of the rounds with its [min, max]; the load average and the machine's
busyness (kiln.evaluate.contention) are recorded around the whole run. A checkpoint comes from
bench/scale.py (`--size 1b --plan-only` builds it without running kiln).

    python bench/torch_bf16.py --model /tmp/kiln-scale/models/1b --rounds 3

Writes bench/results/torch_bf16.json and prints a table.
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

OUT = Path(__file__).parent / "results" / "torch_bf16.json"
VARIANTS = ("native", "wide")
FIGURES = ("score_s", "ttft_s", "decode_tok_s")


def switch(model: Any, variant: str) -> None:
    import torch

    from kiln.engine.torch_bf16 import WideLinear, widen

    if variant == "wide":
        widen(model)
        return
    for module in model.modules():
        if type(module) is WideLinear:
            module.__class__ = torch.nn.Linear


def measure(engine: Any, ids: list[int], args: argparse.Namespace) -> dict[str, float]:
    from kiln.engine.base import GenerationRequest

    start = time.perf_counter()
    engine.score([(ids[:1], ids[1:args.score_tokens])])
    score_s = time.perf_counter() - start
    start = time.perf_counter()
    engine.add(GenerationRequest(ids[:args.prompt_tokens], args.decode_tokens + 1, ignore_eos=True))
    engine.step()
    first = time.perf_counter()
    steps = 0
    while engine.has_work():
        steps += len(engine.step())
    return {"score_s": score_s, "ttft_s": first - start, "decode_tok_s": steps / (time.perf_counter() - first)}


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=Path("/tmp/kiln-scale/models/1b"), help="a bfloat16 checkpoint")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--score-tokens", type=int, default=256)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--decode-tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=None, help="torch threads; default: torch's")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args()
    if not (args.model / "config.json").is_file():
        sys.exit(f"{args.model}: no checkpoint. Build one with `python bench/scale.py --size 1b --plan-only`.")

    import torch

    from kiln.core.files import atomic_write_json
    from kiln.engine.hf_torch import TorchEngine, TorchEngineConfig
    from kiln.engine.torch_bf16 import lacks_bf16_instructions
    from kiln.evaluate import contention

    engine = TorchEngine(args.model, TorchEngineConfig(dtype="bfloat16", threads=args.threads))
    seeded = torch.Generator().manual_seed(0)
    ids = torch.randint(0, engine.vocab_size, (args.score_tokens,), generator=seeded).tolist()
    load_start, busy_start = os.getloadavg(), contention.read()
    runs: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    for r in range(args.rounds):
        for variant in VARIANTS if r % 2 == 0 else reversed(VARIANTS):
            switch(engine.model, variant)
            runs[variant].append(measure(engine, ids, args))
            figures = ", ".join(f"{k} {v:.3f}" for k, v in runs[variant][-1].items())
            print(f"round {r} {variant}: {figures}", flush=True)
    busy = contention.between(busy_start, contention.read())
    rows = {v: {k: spread([run[k] for run in runs[v]]) for k in FIGURES} for v in VARIANTS}
    atomic_write_json(args.out, {
        "model": str(args.model), "machine": platform.processor() or platform.machine(),
        "lacks_bf16_instructions": lacks_bf16_instructions(), "torch_threads": torch.get_num_threads(),
        "cpus": os.cpu_count(), "load_average_start": load_start, "load_average_end": os.getloadavg(),
        "contention": busy, "args": {k: str(v) for k, v in vars(args).items()}, "runs": runs, "results": rows})
    print(f"\n{'variant':<8} " + " ".join(f"{k + ' median [min, max]':>28}" for k in FIGURES))
    for v in VARIANTS:
        print(f"{v:<8} " + " ".join(f"{rows[v][k]['median']:>10.3f} [{rows[v][k]['min']:.3f}, {rows[v][k]['max']:.3f}]"
                                    .rjust(28) for k in FIGURES))
    for k in ("score_s", "ttft_s"):
        print(f"{k}: native / wide {rows['native'][k]['median'] / rows['wide'][k]['median']:.2f}x")
    print(f"load average {load_start[0]:.2f} at the start, {os.getloadavg()[0]:.2f} at the end; steal "
          f"{busy['cpu_steal'] or 0:.1%}, CPU pressure {busy['cpu_pressure'] or 0:.1%}; wrote {args.out}")


if __name__ == "__main__":
    main()
