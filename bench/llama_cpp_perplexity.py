"""Does kiln's perplexity through the llama_cpp engine agree with `llama-perplexity` on the same files?

For each GGUF type (f32, q8_0, q4_K_M of the demo model, made by the `gguf` method) the same
held-out text is scored two ways:
- `llama-perplexity -c 512 -b 512`: llama.cpp's own tool, on chunks of 512 tokens, each scored on
  its second half (tokens 257..511 given the ones before);
- kiln: the llama_cpp engine's `score()` (in-process, engine/llama_cpp/scoring.py) on the same
  chunks, the same halves, from the HF tokenizer's ids (the gguf method checked they match);
and, for reference, kiln's perplexity evaluator as the demo recipe runs it (24 windows of 256).
What the gate uses is the ratio to f32, so the figure is |ratio(kiln) / ratio(llama-perplexity) - 1|.

    python bench/llama_cpp_perplexity.py [--chunks 8] [--threads 2]

Writes bench/results/llama_cpp_perplexity.json and prints a table.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from cpu_engines import gguf_artifact

OUT = Path(__file__).parent / "results" / "llama_cpp_perplexity.json"
TYPES = ("f32", "q8_0", "q4_K_M")
CTX = 512


def llama_perplexity(gguf_path: Path, text: Path, chunks: int, threads: int) -> float:
    from kiln.core.llama_cpp_build import binary

    out = subprocess.run([str(binary("llama-perplexity")), "-m", str(gguf_path), "-f", str(text), "-c", str(CTX),
                          "-b", str(CTX), "--chunks", str(chunks), "-t", str(threads)],
                         capture_output=True, text=True, check=True)
    return float(re.search(r"Final estimate: PPL = ([0-9.]+)", out.stdout + out.stderr).group(1))


def kiln_perplexities(artifact: Path, text: str, chunks: int, threads: int) -> dict[str, float]:
    from kiln.engine.cache import write_engine
    from kiln.engine.llama_cpp.backend import LlamaCppConfig
    from kiln.engine.loader import load_engine
    from kiln.evaluate.quality.base import documents
    from kiln.evaluate.quality.perplexity import perplexity

    with tempfile.TemporaryDirectory() as tmp:
        write_engine(LlamaCppConfig(threads=threads, parallel=1, ctx_per_slot=CTX), artifact, "bench", Path(tmp))
        engine = load_engine(Path(tmp))
        try:
            ids = engine.tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
            cut = [ids[i * CTX:(i + 1) * CTX] for i in range(chunks)]
            first = CTX // 2  # what llama-perplexity scores: tokens first+1 .. CTX-1
            scores = engine.score([(c[:first + 1], c[first + 1:]) for c in cut])
            nll = -sum(s.logprob for s in scores) / sum(len(s.token_logprobs) for s in scores)
            evaluator = perplexity(engine, documents(engine.tokenizer, text, 256, 24)).metrics["perplexity"]
        finally:
            engine.close()
    return {"kiln_ppl": math.exp(nll), "kiln_evaluator_ppl": evaluator}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args()
    from kiln.pipeline.demo.prepare import demo_model_dir, prepare_demo_data
    from kiln.core.files import atomic_write_json

    checkpoint = demo_model_dir()
    text = prepare_demo_data().eval_text.read_text()  # the same held-out text in every data version
    rows: dict[str, dict[str, Any]] = {}
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as f:
        f.write(text)
        f.flush()
        for kind in TYPES:
            artifact = gguf_artifact(checkpoint, kind, args.threads)
            rows[kind] = {"llama_perplexity_ppl": llama_perplexity(artifact / "model.gguf", Path(f.name),
                                                                   args.chunks, args.threads),
                          **kiln_perplexities(artifact, text, args.chunks, args.threads)}
    for kind, r in rows.items():
        for key in ("llama_perplexity_ppl", "kiln_ppl", "kiln_evaluator_ppl"):
            r[key.replace("_ppl", "_ratio")] = r[key] / rows["f32"][key]
        r["ratio_rel_diff"] = r["kiln_ratio"] / r["llama_perplexity_ratio"] - 1
        r["ppl_rel_diff"] = r["kiln_ppl"] / r["llama_perplexity_ppl"] - 1
    atomic_write_json(args.out, {"model": str(checkpoint), "ctx": CTX, "chunks": args.chunks, "threads": args.threads,
                                 "load_average": os.getloadavg(), "results": rows})
    print(f"\n{'type':<8}{'llama-perplexity':>17}{'kiln':>10}{'ratio lp':>10}{'ratio kiln':>11}{'diff':>9}"
          f"{'evaluator':>11}{'ratio ev':>10}")
    for kind, r in rows.items():
        print(f"{kind:<8}{r['llama_perplexity_ppl']:>17.4f}{r['kiln_ppl']:>10.4f}{r['llama_perplexity_ratio']:>10.4f}"
              f"{r['kiln_ratio']:>11.4f}{r['ratio_rel_diff']:>+9.2e}{r['kiln_evaluator_ppl']:>11.4f}"
              f"{r['kiln_evaluator_ratio']:>10.4f}")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
