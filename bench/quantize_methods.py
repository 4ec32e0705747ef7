"""Every CPU quantization method on the demo model, side by side, in one run.

For each method (baseline `none`, GPTQ 4-bit, torchao int8 weight-only; `gptq8` on request): quantize
wall time and peak RSS (each quantize runs in its own process, so its peak is its own), the
memory planner's estimate, size on disk, bits per weight, perplexity on ~2k held-out tokens
(sliding window) and decode speed at batch 1 with a plain KV-cache loop (not HF generate(),
pathologically slow on CPU), interleaved across methods so machine drift hits all alike.

The demo model's group size is 64: 576 (hidden_size) is not divisible by 128.
Writes bench/results/quantize_methods.json and prints a table. The machine is shared: trust
ratios more than absolute numbers.

    python bench/quantize_methods.py [--model DIR] [--methods none,gptq4,...] [--repeats 3] [--reuse gptq4]

GPTQ on the 135M demo model takes minutes on 2 idle cores and over an hour on a loaded one;
`--reuse` keeps checkpoints already in --work (their quantize time and RSS come from the
result file the worker wrote, or are left empty if there is none) and re-measures the rest.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

OUT = Path(__file__).parent / "results" / "quantize_methods.json"
METHODS = {
    "none": {"method": "none"},
    "gptq4": {"method": "gptq", "bits": 4, "group_size": 64},
    "gptq8": {"method": "gptq", "bits": 8, "group_size": 64},
    "int8_weight_only": {"method": "int8_weight_only"},
}


def quantize_worker(model: Path, spec: dict, out: Path) -> dict:
    """Runs in a child process: check, calibrate, quantize; returns timings, RSS and the manifest fields."""
    from pydantic import TypeAdapter

    from kiln.optimize import QUANTIZERS
    from kiln.optimize.calibration import build_calibration
    from kiln.optimize.checkpoint import read_config
    from kiln.optimize.memory import plan_memory
    from kiln.core.files import atomic_dir
    from kiln.pipeline.stages.optimize import calibration_text
    from kiln.pipeline.stages.base import peak_rss_bytes

    config = TypeAdapter(QUANTIZERS.config_union()).validate_python(spec)
    quantizer = QUANTIZERS.create(config)
    quantizer.check(read_config(model))
    plan = plan_memory(read_config(model), config)
    start = time.perf_counter()
    calibration = build_calibration(config.calibration, model, calibration_text(config.calibration.dataset)) \
        if quantizer.needs_calibration else None
    calib_s = time.perf_counter() - start
    with atomic_dir(out) as scratch:
        fields = quantizer.quantize(model, scratch, calibration)
    return {"quantize_s": time.perf_counter() - start - calib_s, "calibration_s": calib_s,
            "peak_rss_bytes": peak_rss_bytes(),  # this worker's own VmHWM (ru_maxrss carries the parent's)
            "planned_quantize_bytes": plan.steps[0].total if len(plan.steps) > 1 else 0.0,
            "planned_serve_bytes": plan.steps[-1].total, "manifest": fields}


def perplexity(model, ids: list[int], window: int = 512, stride: int = 256) -> float:
    """Sliding-window perplexity: every token scored once, with up to `window` tokens of context."""
    import torch

    nll, count, prev_end = 0.0, 0, 0
    for begin in range(0, len(ids) - 1, stride):
        end = min(begin + window, len(ids))
        chunk = torch.tensor([ids[begin:end]])
        with torch.no_grad():
            logits = model(chunk).logits[0, :-1].float()
        targets = chunk[0, 1:]
        losses = torch.nn.functional.cross_entropy(logits, targets, reduction="none")
        new = end - max(prev_end, begin + 1)  # tokens not scored by an earlier window
        nll += float(losses[-new:].sum())
        count += new
        prev_end = end
        if end == len(ids):
            break
    return float(torch.exp(torch.tensor(nll / count)))


def decode_tok_s(model, prompt: list[int], new_tokens: int) -> float:
    """Greedy batch-1 decode with a KV cache; tokens per second after the prefill."""
    import torch
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.no_grad():
        out = model(torch.tensor([prompt]), past_key_values=cache, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        start = time.perf_counter()
        for _ in range(new_tokens):
            out = model(token, past_key_values=out.past_key_values, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
        return new_tokens / (time.perf_counter() - start)


def evaluate(dirs: dict[str, Path], eval_ids: list[int], prompt: list[int], new_tokens: int, repeats: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    models = {n: AutoModelForCausalLM.from_pretrained(str(d)).eval() for n, d in dirs.items()}
    result = {n: {"dtype": str(m.dtype).removeprefix("torch."), "perplexity": perplexity(m, eval_ids)}
              for n, m in models.items()}
    for m in models.values():  # warm-up: lazy kernel setup and first allocations must not count
        decode_tok_s(m, prompt, 4)
    speeds: dict[str, list[float]] = {n: [] for n in models}
    for r in range(repeats):
        for n in (list(models) if r % 2 == 0 else list(reversed(models))):
            speeds[n].append(decode_tok_s(models[n], prompt, new_tokens))
    for n in models:
        result[n]["decode_tok_s"] = statistics.median(speeds[n])
        result[n]["decode_tok_s_runs"] = speeds[n]
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="fp32 HF checkpoint (default: the demo model)")
    ap.add_argument("--methods", default="none,gptq4,int8_weight_only", help=f"from {', '.join(METHODS)}")
    ap.add_argument("--reuse", default="", help="methods whose checkpoints already in --work are kept, e.g. gptq4")
    ap.add_argument("--work", type=Path, default=Path(__file__).parent / "results" / "quantize_methods")
    ap.add_argument("--eval-tokens", type=int, default=2048)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, help="torch threads for the evaluation (1 avoids OpenMP spin-waits "
                                                  "slowing decode several-fold on a machine other jobs load)")
    ap.add_argument("--worker", nargs=3, metavar=("MODEL", "SPEC", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        model, spec, out = args.worker
        result = quantize_worker(Path(model), json.loads(spec), Path(out))
        from kiln.core.files import atomic_write_json

        atomic_write_json(Path(out).with_suffix(".result.json"), result)
        print("KILN-RESULT " + json.dumps(result))
        return
    from kiln.pipeline.demo.prepare import demo_model_dir, prepare_demo_data

    model = args.model or demo_model_dir()
    rows, dirs = {}, {}
    for name in args.methods.split(","):
        out = args.work / name
        dirs[name] = out
        if name in args.reuse.split(",") and out.is_dir():
            rows[name] = reused(model, out)
            print(f"reusing: {name} ({out})", flush=True)
            continue
        print(f"quantizing: {name} ...", flush=True)
        proc = subprocess.run([sys.executable, __file__, "--worker", str(model), json.dumps(METHODS[name]), str(out)],
                              capture_output=True, text=True)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("KILN-RESULT ")), None)
        if proc.returncode or line is None:
            sys.exit(f"{name} failed:\n{proc.stderr[-3000:]}")
        rows[name] = json.loads(line.removeprefix("KILN-RESULT "))
    eval_ids, prompt = _texts(model, prepare_demo_data().eval_text, args.eval_tokens)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    quality = evaluate(dirs, eval_ids, prompt, args.new_tokens, args.repeats)
    report(model, rows, quality, dirs, args)


def reused(model: Path, out: Path) -> dict:
    """A checkpoint quantized by an earlier run: its worker's result, or only what the files show."""
    from kiln.optimize.checkpoint import bits_per_weight, param_count
    from kiln.core.files import read_json

    result = out.with_suffix(".result.json")
    if result.is_file():
        return {**read_json(result), "reused": True}
    return {"quantize_s": None, "calibration_s": None, "peak_rss_bytes": None, "planned_quantize_bytes": None,
            "reused": True, "manifest": {"bits_per_weight": bits_per_weight(out, param_count(model))}}


def _texts(model: Path, eval_text: Path, n: int) -> tuple[list[int], list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    ids = tok(eval_text.read_text()[: n * 8], add_special_tokens=False)["input_ids"][:n]
    return ids, ids[:32]


def report(model: Path, rows: dict, quality: dict, dirs: dict, args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    from kiln.optimize.checkpoint import safetensors_files
    from kiln.optimize.memory import human
    from kiln.core.files import atomic_write_json

    base = quality.get("none") or next(iter(quality.values()))
    t = Table("method", "dtype", "quantize s", "peak RSS", "planned", "weights on disk", "bits/weight",
              "ppl", "Δppl", "decode tok/s", "× baseline", title=f"quantization methods on {model.name}")
    for name, row in rows.items():
        q = quality[name]
        row.update(q, weights_bytes=sum(p.stat().st_size for p in safetensors_files(dirs[name])),
                   perplexity_delta=q["perplexity"] - base["perplexity"],
                   decode_speed_ratio=q["decode_tok_s"] / base["decode_tok_s"])
        t.add_row(name, q["dtype"], _fmt(row["quantize_s"], "{:.1f}"), _fmt(row["peak_rss_bytes"], human),
                  _fmt(row["planned_quantize_bytes"], human), human(row["weights_bytes"]),
                  f"{row['manifest']['bits_per_weight']:.2f}", f"{q['perplexity']:.2f}",
                  f"{row['perplexity_delta']:+.2f}", f"{q['decode_tok_s']:.1f}", f"{row['decode_speed_ratio']:.2f}")
    Console(width=200).print(t)
    import torch

    atomic_write_json(OUT, {"model": str(model), "eval_tokens": args.eval_tokens, "new_tokens": args.new_tokens,
                            "repeats": args.repeats, "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
                            "methods": rows})
    print(f"wrote {OUT}")


def _fmt(value, how) -> str:
    if value is None:
        return "—"
    return how.format(value) if isinstance(how, str) else how(value)


if __name__ == "__main__":
    main()
