"""The `load` stage: each arm served over HTTP by the kiln server and driven by the load generator.

The served artifact is the evaluated artifact: requests go through the OpenAI endpoint that
`kiln serve` exposes (loopback, a random API key), not through the engine's Python API. The arms
run A, B, A, B, ... (`repeats`), each repeat the whole configured shape. A sweep finds each arm's
own saturation, so its headline numbers compare each arm at its own knee.

With `prefix` set, each arm also runs the prefix-sharing workload with its prompt cache and without
(evaluate/perf/prefix.py): TTFT both ways and the cache hit rate, the report's prefix-cache table;
with `prefix.router`, through `kiln route` in front of two more replicas of the arm's engine too,
placed by prefix and round-robin (`replicas_hit_rates`).

Beside the measurement sits the roofline: the predicted decode ceiling per batch size from the
checkpoint (weight bytes, KV bytes per token) and this machine's measured memory bandwidth, with
the measured TPOT and MBU where a closed-loop stage fixed the batch. The client and the server
share this process, so on a small CPU their overhead is part of the measured TPOT.
"""

from __future__ import annotations

import json
import math
import secrets
import statistics
from collections.abc import Mapping
from contextlib import ExitStack
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kiln.evaluate.perf.config import PerformanceConfig
from kiln.evaluate.perf.metrics import client_limited
from kiln.evaluate.perf.runner import LoadResult
from kiln.evaluate.roofline import CeilingRow
from kiln.core.errors import BadInput
from kiln.core.metrics import CLIENT_LIMITED, LOAD_PREFIX, METRICS

PLOTS = ("latency_vs_rate.png", "latency_throughput.png", "ceiling_vs_measured.png")
CEILING_BATCHES = (1, 2, 4, 8, 16)


def measure(engines: Mapping[str, Any], dirs: Mapping[str, Path], cfg: PerformanceConfig, out: Path) -> dict[str, Any]:
    """Run the load on every arm, write records and plots under `out`, return the stage result."""
    from kiln.evaluate.perf.plots import ceiling_vs_measured, result_figures
    from kiln.evaluate.roofline import measure_bandwidth

    runs, prefix = _run_arms(engines, cfg)
    bandwidth = measure_bandwidth()
    per_role, ceilings = {}, {}
    for role, repeats in runs.items():
        for k, run in enumerate(repeats):
            run.write_jsonl(out / "records" / f"{role}-r{k}.jsonl")
        ceilings[role] = roofline(dirs[role], repeats[0], bandwidth)
        per_role[role] = _role_result(repeats, ceilings[role])
        if role in prefix:
            per_role[role]["prefix"] = prefix[role]
            per_role[role]["metrics"].update(prefix[role]["metrics"])
            per_role[role]["repeats"].update(prefix[role]["repeats"])
            if cfg.prefix and cfg.prefix.router:
                routed = per_role[role]["prefix"]["router"] = replicas_hit_rates(dirs[role], cfg)
                per_role[role]["repeats"].update(routed["repeats"])
                per_role[role]["metrics"].update(routed["metrics"])
    result_figures({role: (r[0].summaries, r[0].knee) for role, r in runs.items()}, out_dir=out / "plots")
    if any(ceilings.values()):  # engines without a local checkpoint (remote) have no roofline
        ceiling_vs_measured({role: rows for role, rows in ceilings.items() if rows}, out / "plots" / PLOTS[2])
    metrics = {f"{role}.{k}": v for role, part in per_role.items() for k, v in part["metrics"].items()}
    metrics.update({f"{role}.roofline_b{r['batch']}_mbu": r["mbu"]
                    for role, part in per_role.items() for r in part["roofline"] if r["mbu"]})
    return {"metrics": metrics, "per_role": per_role, "bandwidth_gb_s": bandwidth, "repeats": cfg.repeats,
            "plots": [f"plots/{p}" for p in PLOTS if (out / "plots" / p).is_file()]}


def _run_arms(engines: Mapping[str, Any], cfg: PerformanceConfig) -> tuple[dict[str, list[LoadResult]], dict]:
    """Serve every arm at once on loopback and run the shape on each, interleaved across repeats; then
    the prefix workload, when the recipe asks for it (its result per role, else empty)."""
    from kiln.engine.serve.server_thread import ServerThread
    from kiln.evaluate.perf.prefix_run import run_prefix
    from kiln.evaluate.perf.runner import run_load

    key = secrets.token_urlsafe(24)
    runs: dict[str, list[LoadResult]] = {role: [] for role in engines}
    with ExitStack() as stack:
        urls = {role: stack.enter_context(ServerThread(engine, api_key=key, model_name=role)).url
                for role, engine in engines.items()}
        for k in range(cfg.repeats):
            for role, url in urls.items():
                try:
                    runs[role].append(run_load(url, cfg, api_key=key, model=role, salt=f"r{k}"))
                except RuntimeError as e:  # a sweep whose probes completed nothing: stages too short
                    raise BadInput(f"evaluate.load ({role}): {e}", [
                        "each stage must outlast several requests: raise duration_s, "
                        "or lower output_tokens or shape.max_concurrency"]) from e
        prefix = run_prefix(urls, cfg, key) if cfg.prefix else {}
    return runs, prefix


def replicas_hit_rates(engine_dir: Path, cfg: PerformanceConfig) -> dict[str, Any]:
    """Two replicas of an engine (each its own kiln serve) behind a real `kiln route`, the prefix workload
    with the cache on sent through it placed by prefix and round-robin, `cfg.repeats` times, which first
    alternating. Every run has system prompts new to both replicas (its own seed); the hit rates are the
    replicas' own, summed by the load client."""
    from kiln.deploy.config import RouterConfig
    from kiln.deploy.router_process import RouterProcess
    from kiln.engine.serve.server_thread import ServerThread
    from kiln.evaluate.perf.prefix import ROUND_ROBIN_HIT_RATE, ROUTED_HIT_RATE
    from kiln.evaluate.perf.prefix_run import prefix_load
    from kiln.evaluate.perf.runner import run_load

    rates: dict[str, list[float | None]] = {"prefix": [], "round-robin": []}
    sent: dict[str, list[list[int]]] = {"prefix": [], "round-robin": []}
    with ServerThread(engine_dir, model_name="replica") as a, ServerThread(engine_dir, model_name="replica") as b:
        for k in range(cfg.repeats):
            for j, balance in enumerate(("prefix", "round-robin") if k % 2 == 0 else ("round-robin", "prefix")):
                seeded = cfg.model_copy(update={"seed": cfg.seed + 1000 + 2 * k + j})
                with RouterProcess(RouterConfig(port=0, stable_url=f"{a.url},{b.url}", balance=balance)) as router:
                    run = run_load(router.url, prefix_load(seeded, True), model="replica", salt=f"x{k}")
                    sent[balance].append([r["sent"] for r in router.state()["replicas"]["stable"].values()])
                rates[balance].append(run.summary.cache_hit_rate)
    repeats = {name: rates[balance] for name, balance in ((ROUTED_HIT_RATE, "prefix"),
                                                          (ROUND_ROBIN_HIT_RATE, "round-robin"))
               if None not in rates[balance]}
    return {"cache_hit_rate": rates, "sent": sent, "repeats": repeats,
            "metrics": {name: statistics.median(v) for name, v in repeats.items()}}


def _role_result(repeats: list[LoadResult], ceiling: list[CeilingRow] | None) -> dict[str, Any]:
    """One arm: declared load metrics per repeat and their medians, error counts, stages, knee, roofline.

    The metrics are the headline stage's: the knee's in a sweep, else the only or last stage."""
    values = [_headline(run) for run in repeats]
    per_metric = {name: [v[name] for v in values if name in v] for name in values[0]}
    stages = [s for run in repeats for s in run.summaries]
    first = repeats[0]
    return {"metrics": {k: statistics.median(v) for k, v in per_metric.items() if v},
            "repeats": per_metric,
            "counts": {"error_rate": [sum(s.errors for s in stages), sum(s.requests - s.cancelled for s in stages)],
                       # headline stages whose load generator could not send the target rate
                       CLIENT_LIMITED: [sum(client_limited(run.summary) for run in repeats), len(repeats)]},
            "knee": asdict(first.knee) if first.knee else None,
            "headline": first.summary.label,
            "stages": [asdict(s) for s in first.summaries],
            "roofline": [asdict(r) | {"mbu": r.mbu} for r in ceiling or []]}


def _headline(run: LoadResult) -> dict[str, float]:
    """The declared `load_*` metrics of a run's headline stage (finite values only), plus its knee."""
    flat = run.summary.flat() | ({"knee_rate": run.knee.rate} if run.knee else {})
    return {LOAD_PREFIX + k: v for k, v in flat.items() if LOAD_PREFIX + k in METRICS and math.isfinite(v)}


def roofline(engine_dir: Path, run: LoadResult, bandwidth_gb_s: float) -> list[CeilingRow] | None:
    """Predicted ceiling per batch size for the engine's checkpoint, measured TPOT beside it.

    Weight bytes are the checkpoint's safetensors (each decode step reads them all); KV bytes
    per token come from its config at the engine's dtype; the context is the mean prompt plus half
    the output (the average KV length while decoding). A closed-loop stage at concurrency c runs
    batches of min(c, the engine's max batch). None for an engine without a local checkpoint.
    """
    from kiln.engine.loader import read_manifest
    from kiln.evaluate.roofline import manifest_ceiling

    manifest = read_manifest(engine_dir)
    checkpoint = Path(manifest.get("source", {}).get("path", ""))
    if not (checkpoint / "config.json").is_file():
        return None
    hf = json.loads((checkpoint / "config.json").read_text())
    spec = {"weight_bytes": sum(p.stat().st_size for p in checkpoint.glob("*.safetensors")),
            "num_layers": hf["num_hidden_layers"],
            "num_kv_heads": hf.get("num_key_value_heads") or hf["num_attention_heads"],
            "head_dim": hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
            "kv_dtype": manifest["config"].get("dtype", "float32")}
    max_batch = manifest["config"].get("max_batch_size") or math.inf
    measured = {min(s.concurrency, max_batch): s.tpot_ms["p50"] for s in run.summaries
                if s.concurrency and s.completed and math.isfinite(s.tpot_ms["p50"])}
    prompts = [r.input_tokens for s in run.stages for r in s.records if r.input_tokens]
    context = round((statistics.mean(prompts) if prompts else 0) + run.config.output_tokens / 2)
    batches = sorted({b for b in CEILING_BATCHES if b <= max_batch} | set(measured))
    return manifest_ceiling(spec, context, bandwidth_gb_s, batches=batches,
                            price_per_hour=run.config.price_per_hour, measured_tpot_ms=measured)
