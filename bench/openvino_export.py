"""OpenVINO's build of a checkpoint, alone in a process: its wall time and its peak resident memory above
the process's start, beside what `kiln plan-memory` plans for that step (the engine step less kiln's
runtime: the IR it writes, and the export's own hold, `optimize/memory.py`).

It is the engine stage's export without the stage around it, for a size whose search kiln refuses as a
whole (8B here: OpenVINO's benchmark step does not fit 24 GiB), so the plan's export model is measured
where a run cannot reach it. The IR is written to a scratch folder and deleted afterwards.

    python bench/openvino_export.py --model /tmp/kiln-scale/models/8b --out bench/results/openvino_export-8b.json

Writes JSON (default bench/results/openvino_export.json) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

OUT = Path(__file__).parent / "results" / "openvino_export.json"
GIB = 1 << 30


def planned(config: dict[str, Any], weights: str) -> dict[str, float]:
    """The plan's engine step for an OpenVINO arm at `weights`, less kiln's runtime: the IR, the export."""
    from kiln.optimize.memory import plan_memory, source_dtype
    from kiln.pipeline.stages.memory_plan import with_pipeline_steps

    compressed = {"int8": "int8", "fp32": "float32"}.get(weights)
    plan = plan_memory(config, None, engine_dtype=compressed)
    export = source_dtype(config) if weights != "fp32" else "float32"
    steps = with_pipeline_steps(plan, config, None, reference=None, export=export).steps
    engine = next(s for s in steps if s.step == "engine")
    parts = [c for c in engine.components if not c.name.startswith("runtime")]
    return {"ir_bytes": parts[0].bytes, "above_start_bytes": sum(c.bytes for c in parts)}


def import_first() -> None:
    """What the build imports, imported before its start: a kiln run's engine stage starts with them loaded
    (the plan counts them in kiln's runtime), so the peak above the start is the build's own working set."""
    import nncf  # noqa: F401
    import openvino.frontend.pytorch  # noqa: F401
    import openvino.opset13  # noqa: F401
    import torch  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401

    import kiln.engine.openvino  # noqa: F401  (registers the backend)


def measure(model: Path, weights: str, threads: int, scratch: Path) -> dict[str, Any]:
    """The engine stage's two phases, each's peak above the process's start: the build (trace, compress,
    write the IR), then the engine loaded from that IR and generating (the CPU plugin compiles it)."""
    from kiln.engine.base import GenerationRequest, engine_config
    from kiln.engine.cache import write_engine
    from kiln.engine.loader import load_engine
    from kiln.pipeline.stages.rss import peak_rss_bytes, reset_peak_rss, return_freed_memory, rss_bytes

    import_first()
    config = engine_config({"config": {"backend": "openvino", "weights": weights, "threads": threads}})
    out = scratch / "engine"
    out.mkdir()
    return_freed_memory()
    start = rss_bytes()
    reset = reset_peak_rss()
    t0 = time.perf_counter()
    manifest = write_engine(config, model, "bench", out)
    wall = time.perf_counter() - t0
    built = peak_rss_bytes()
    return_freed_memory()
    reset_peak_rss()
    t0 = time.perf_counter()
    engine = load_engine(out)
    for _ in engine.generate([GenerationRequest(list(range(1000, 1016)), 8, ignore_eos=True)]):
        pass
    load_wall = time.perf_counter() - t0
    loaded = peak_rss_bytes()
    engine.close()
    return {"start_bytes": start, "peak_reset": reset, "wall_s": round(wall, 1), "load_wall_s": round(load_wall, 1),
            "build_above_start_bytes": built - start, "load_above_start_bytes": loaded - start,
            "above_start_bytes": max(built, loaded) - start,
            "ir_bytes": (out / "openvino_model.bin").stat().st_size, "build": manifest["build"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True, help="a checkpoint folder (safetensors, config.json)")
    p.add_argument("--weights", default="int8", choices=("int8", "int4", "fp32"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--scratch", type=Path, default=None, help="where the IR is written (deleted after)")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args()
    from kiln.core.files import atomic_write_json
    from kiln.evaluate import contention

    config = json.loads((args.model / "config.json").read_text())
    load0, busy0 = os.getloadavg(), contention.read()
    scratch = Path(tempfile.mkdtemp(prefix="kiln-ov-export-", dir=args.scratch))
    try:
        measured = measure(args.model, args.weights, args.threads, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    plan = planned(config, args.weights)
    ratio = round(plan["above_start_bytes"] / measured["above_start_bytes"], 3)
    result = {"model": str(args.model), "weights": args.weights, "threads": args.threads, "measured": measured,
              "planned": plan, "plan_over_measured": ratio,
              "load_average_start": load0, "load_average_end": os.getloadavg(),
              "contention": contention.between(busy0, contention.read())}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out, result)
    m = measured
    ir, held = (m["ir_bytes"], plan["ir_bytes"]), (m["above_start_bytes"], plan["above_start_bytes"])
    print("| model | weights | build (s) | load (s) | IR (GiB): measured / planned | above start (GiB): build "
          "| load | the step: measured / planned | plan / measured |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    print(f"| {args.model.name} | {args.weights} | {m['wall_s']} | {m['load_wall_s']} | {ir[0] / GIB:.2f} / "
          f"{ir[1] / GIB:.2f} | {m['build_above_start_bytes'] / GIB:.2f} | {m['load_above_start_bytes'] / GIB:.2f} "
          f"| {held[0] / GIB:.2f} / {held[1] / GIB:.2f} | {ratio} |")
    print(f"start {m['start_bytes'] / GIB:.2f} GiB (peak reset: {m['peak_reset']}); "
          f"load average {load0[0]:.2f} -> {result['load_average_end'][0]:.2f}; wrote {args.out}")


if __name__ == "__main__":
    main()
