"""The concrete stages of `kiln run`, each a call to `run_stage` with its content-addressed inputs."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from kiln.optimize.base import QUANTIZERS, ModelArtifact
from kiln.pipeline.files import atomic_write_json, dir_size, read_json
from kiln.pipeline.gate.base import Evidence
from kiln.pipeline.gate.policy import GateOutcome, judge
from kiln.pipeline.model_source import ResolvedModel
from kiln.pipeline.stages import RunContext, peak_rss_bytes, run_stage
from kiln.pipeline.versions import library_versions


def optimize_both(ctx: RunContext, model: ResolvedModel) -> dict[str, ModelArtifact]:
    baseline_cfg = QUANTIZERS.config("none")()
    return {role: quantize(ctx, role, cfg, model)
            for role, cfg in (("baseline", baseline_cfg), ("candidate", ctx.recipe.optimize))}


def quantize(ctx: RunContext, role: str, cfg: Any, model: ResolvedModel) -> ModelArtifact:
    """One optimize stage: check before any work, calibrate if needed, quantize, write the manifest."""
    quantizer = QUANTIZERS.create(cfg)
    quantizer.check(model.config)
    calibration = _calibration(ctx, cfg, model) if quantizer.needs_calibration else None
    inputs = {"method": cfg.model_dump(mode="json"), "source": model.sha256,
              "calibration": calibration.sha256 if calibration else None}

    def compute(out: Path) -> dict[str, Any]:
        import time as _t

        start = _t.perf_counter()
        fields = quantizer.quantize(model.path, out / "model", calibration)
        manifest = {"method": cfg.method, "params": cfg.model_dump(mode="json"), "source": str(model.path),
                    "source_sha256": model.sha256, "calibration_sha256": inputs["calibration"],
                    "libraries": library_versions(), "wall_s": _t.perf_counter() - start,
                    "peak_rss_bytes": peak_rss_bytes(), "size_bytes": dir_size(out / "model"), **fields}
        from kiln.pipeline.files import sha256_tree

        manifest["sha256"] = sha256_tree(out / "model")
        atomic_write_json(out / "model" / "kiln-artifact.json", manifest)
        metrics = {k: manifest[k] for k in ("wall_s", "size_bytes", "peak_rss_bytes", "bits_per_weight") if k in manifest}
        return {"metrics": metrics, "manifest": manifest}

    o = run_stage(ctx, "optimize", role, inputs, compute, artifacts=("model/kiln-artifact.json",), portable=False)
    return ModelArtifact(path=o.path / "model", manifest=o.result["manifest"])


def _calibration(ctx: RunContext, cfg: Any, model: ResolvedModel):
    from kiln.optimize.calibration import load_calibration

    return load_calibration(cfg.calibration, model.path, eval_text=ctx.recipe.evaluate.quality.perplexity.text)


def engine(ctx: RunContext, role: str, art: ModelArtifact) -> Path:
    from kiln.engine.cache import build_engine

    cfg = ctx.recipe.engine
    outcome = run_stage(ctx, "engine", role, {"backend": cfg.model_dump(mode="json"), "artifact": art.manifest["sha256"]},
                        lambda out: {"engine_dir": str(build_engine(cfg, art.path, art.manifest["sha256"], ctx.cache)),
                                     "metrics": {}}, portable=False)
    return Path(outcome.result["engine_dir"])


def _text(spec: str, which: str) -> str:
    if spec == "demo":
        from kiln.pipeline.demo import prepare_demo_data

        return Path(getattr(prepare_demo_data(), which)).read_text()
    return Path(spec).read_text()


def evaluate(ctx: RunContext, model: ResolvedModel, arts: dict[str, ModelArtifact],
             engines: dict[str, Path]) -> dict[str, Evidence]:
    from kiln.engine.loader import load_engine
    from kiln.evaluate.quality.base import documents

    q = ctx.recipe.evaluate.quality
    loaded = LazyEngines(engines, load_engine)
    docs = documents(_tokenizer(engines["baseline"]), _text(q.perplexity.text, "eval_text"),
                     q.perplexity.seq_len, q.perplexity.max_documents)
    text_inputs = {"text": q.perplexity.text, "docs_hash": _hash_docs(docs)}
    evidence = {role: Evidence(role) for role in engines}
    for role in engines:
        _perplexity(ctx, role, loaded[role], engines[role], docs, text_inputs, evidence[role])
        evidence[role].metrics["size_bytes"] = arts[role].manifest["size_bytes"]
    if q.agreement:
        _agreement(ctx, loaded, engines, docs, text_inputs, evidence["candidate"])
    _benchmark(ctx, loaded, engines, evidence)
    loaded.close()
    return evidence


class LazyEngines(dict):
    """Engines loaded on first use: a fully cached run loads no model at all."""

    def __init__(self, dirs: dict[str, Path], load: Any):
        super().__init__()
        self.dirs, self.load = dirs, load

    def __missing__(self, role: str) -> Any:
        self[role] = self.load(self.dirs[role])
        return self[role]

    def close(self) -> None:
        for engine in self.values():
            engine.close()


def _tokenizer(engine_dir: Path) -> Any:
    from transformers import AutoTokenizer

    from kiln.engine.loader import read_manifest

    return AutoTokenizer.from_pretrained(read_manifest(engine_dir)["source"]["path"])


def _hash_docs(docs: list[list[int]]) -> str:
    from kiln.pipeline.files import hash_of

    return hash_of(docs)


def _perplexity(ctx, role, eng, engine_dir, docs, text_inputs, ev: Evidence) -> None:
    from kiln.evaluate.quality.perplexity import perplexity

    def compute(out: Path) -> dict[str, Any]:
        res = perplexity(eng, docs)
        res.write(out)
        return {"metrics": res.metrics}

    o = run_stage(ctx, "quality", role, {"engine": _engine_key(engine_dir), **text_inputs, "eval": "perplexity"},
                  compute, artifacts=("perplexity.jsonl",))
    recs = _records(o.path / "perplexity.jsonl")
    ev.metrics.update(o.result["metrics"])
    ev.samples["nll"] = {str(r["doc_id"]): r["nll"] for r in recs}
    ev.samples["tokens"] = {str(r["doc_id"]): r["tokens"] for r in recs}


def _agreement(ctx, loaded, engines, docs, text_inputs, ev: Evidence) -> None:
    from kiln.evaluate.quality.agreement import agreement

    def compute(out: Path) -> dict[str, Any]:
        res = agreement(loaded["baseline"], loaded["candidate"], docs)
        res.write(out)
        return {"metrics": res.metrics}

    o = run_stage(ctx, "agreement", "candidate",
                  {"baseline": _engine_key(engines["baseline"]), "candidate": _engine_key(engines["candidate"]),
                   **text_inputs}, compute, artifacts=("agreement.jsonl",))
    recs = _records(o.path / "agreement.jsonl")
    ev.metrics.update(o.result["metrics"])
    for key in ("kl_mean", "kl_p99", "top1_agreement", "greedy_match"):
        ev.samples[key] = {str(r["doc_id"]): r[key] for r in recs}


def _benchmark(ctx, loaded, engines, evidence: dict[str, Evidence]) -> None:
    from kiln.engine.cache import hardware_fingerprint
    from kiln.evaluate.decode_bench import interleaved

    b = ctx.recipe.evaluate.benchmark
    prompts = _prompts(b.prompts, b.num_prompts, _tokenizer(engines["baseline"]))

    def compute(out: Path) -> dict[str, Any]:
        per_arm = interleaved({role: loaded[role] for role in engines}, prompts, b.max_new_tokens, b.batch_sizes, b.repeats)
        atomic_write_json(out / "repeats.json", per_arm)
        metrics = {f"{role}.{k}": _median([r[k] for r in reps]) for role, reps in per_arm.items() for k in reps[0]}
        return {"metrics": metrics, "repeats": per_arm}

    o = run_stage(ctx, "benchmark", "pair",
                  {"engines": {r: _engine_key(p) for r, p in engines.items()}, "config": b.model_dump(mode="json"),
                   "hardware": hardware_fingerprint(), "prompts": _hash_docs(prompts)},
                  compute, artifacts=("repeats.json",))
    for role, reps in o.result["repeats"].items():
        for k in reps[0]:
            evidence[role].repeats[k] = [r[k] for r in reps]
            evidence[role].metrics[k] = _median(evidence[role].repeats[k])


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if len(s) % 2 else (s[len(s) // 2 - 1] + s[len(s) // 2]) / 2


def _prompts(spec: str, n: int, tokenizer) -> list[list[int]]:
    if spec == "demo":
        from kiln.pipeline.demo import prepare_demo_data

        spec = str(prepare_demo_data().prompts)
    rows = _records(Path(spec))
    texts = [r["prompt"] for r in rows[:n]]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def _engine_key(engine_dir: Path) -> str:
    return Path(engine_dir).name


def gate(ctx: RunContext, evidence: dict[str, Evidence]) -> GateOutcome:
    outcome = judge(ctx.recipe.gate, evidence["candidate"], evidence["baseline"])
    run_id = ctx.tracker.start("gate", {"kiln.stage": "gate", "kiln.role": "candidate",
                                        "kiln.recipe_hash": ctx.recipe.digest(), "kiln.verdict": outcome.verdict.value},
                               parent=ctx.parent_run)
    atomic_write_json(ctx.run_dir / "verdict.json", outcome.to_dict())
    ctx.tracker.log(run_id, tags={f"kiln.check.{r.name}": r.verdict.value for r in outcome.results},
                    metrics={f"{r.name}.observed": r.observed for r in outcome.results if r.observed is not None})
    ctx.tracker.log_artifacts(run_id, ctx.run_dir / "verdict.json")
    ctx.tracker.end(run_id)
    return outcome
