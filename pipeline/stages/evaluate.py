"""The evaluate stages in their phases: perplexity of each arm, token agreement between them, the
decode benchmark, then the served text, the lm-eval tasks and the load stage."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from kiln.core.files import hash_of
from kiln.pipeline.demo.prepare import prepare_demo_data
from kiln.pipeline.stages.phases import PHASES
from kiln.pipeline.stages.benchmark import benchmark, load_stage, speculation_sweep
from kiln.pipeline.stages.inputs import LazyEngines, cached_prompts, text_path, token_ids
from kiln.pipeline.stages.lossless import checked as lossless_checked, lossless
from kiln.pipeline.stages.base import RunContext, run_stage

EVALUATE_PHASES = PHASES[1:]  # every phase but the build, which is the optimize and engine stages


def evaluate(ctx: RunContext, engines: dict[str, Path], phases: tuple[str, ...] = EVALUATE_PHASES,
             loaded: LazyEngines | None = None) -> None:
    """Perplexity of each arm (quality), token agreement between them (agreement), the interleaved
    decode benchmark (speed), then the served text, lm-eval tasks and load over HTTP (rest): the cheap
    checks first, so a search stops a candidate that failed one before its expensive stages."""
    from kiln.engine.loader import load_engine
    from kiln.evaluate.quality.base import documents

    q = ctx.recipe.evaluate.quality
    own = loaded is None
    loaded = LazyEngines(engines, load_engine) if loaded is None else loaded
    if "quality" in phases or ("agreement" in phases and q.agreement):
        text = text_path(q.perplexity.text).read_text()
        docs = token_ids(ctx, engines["baseline"], {"documents": hash_of(text), "seq_len": q.perplexity.seq_len,
                                                    "max_documents": q.perplexity.max_documents},
                         lambda tok: documents(tok, text, q.perplexity.seq_len, q.perplexity.max_documents))
        text_inputs = {"text": q.perplexity.text, "docs_hash": hash_of(docs)}
        if "quality" in phases:
            for role in engines:
                loaded.keep_only(role)  # each arm scored alone, from the stage's start
                _perplexity(ctx, role, loaded, engines[role], docs, text_inputs)
        if "agreement" in phases and q.agreement:
            _agreement(ctx, loaded, engines, docs, text_inputs)
    if "speed" in phases:
        benchmark(ctx, loaded, engines)
    if "rest" in phases:
        if q.served:
            _served(ctx, loaded, engines, q.served)
        if lossless_checked(ctx):  # speculative decoding's text against its plain twin's, after both answered
            lossless(ctx, loaded, engines)
        speculation_sweep(ctx, loaded, engines)  # a speculating candidate: where it stops beating its plain twin
        if q.lmeval:
            for role in engines:
                loaded.keep_only(role)
                _lmeval(ctx, role, loaded, engines[role], q.lmeval)
        if ctx.recipe.evaluate.load:
            load_stage(ctx, loaded, engines)
    if own:
        loaded.close()


def _perplexity(ctx: RunContext, role: str, loaded: LazyEngines, engine_dir: Path, docs, text_inputs) -> None:
    from kiln.evaluate.quality.perplexity import perplexity

    def compute(out: Path) -> dict[str, Any]:
        res = perplexity(loaded[role], docs)
        res.write(out)
        return {"metrics": res.metrics, "samples": {"file": "perplexity.jsonl", "columns": ["nll", "tokens"]}}

    run_stage(ctx, "quality", role, {"engine": engine_dir.name, **text_inputs, "eval": "perplexity"},
              compute)


def _lmeval(ctx: RunContext, role: str, loaded: LazyEngines, engine_dir: Path, cfg: Any) -> None:
    """lm-eval tasks through the engine; keyed by each task's content fingerprint."""
    from kiln.evaluate.quality.lmeval import evaluate_lmeval, prepare_tasks
    from kiln.evaluate.tasks import needs_data

    data = prepare_demo_data() if needs_data(cfg.tasks) else None  # user YAMLs alone need no demo data
    with tempfile.TemporaryDirectory() as tmp:
        fingerprints = prepare_tasks(cfg.tasks, Path(tmp), data).fingerprints()

    def compute(out: Path) -> dict[str, Any]:
        results = evaluate_lmeval(loaded[role], cfg, out, data)
        samples = [{"file": f"{r.name}.jsonl",
                    "columns": sorted({k for rec in r.records for k in rec if k.startswith(f"{r.name}_")})}
                   for r in results]
        return {"metrics": {k: v for r in results for k, v in r.metrics.items()}, "samples": samples}

    run_stage(ctx, "lmeval", role, {"engine": engine_dir.name, "tasks": fingerprints, "limit": cfg.limit},
              compute)


def _agreement(ctx: RunContext, loaded: LazyEngines, engines: dict[str, Path], docs, text_inputs) -> None:
    from kiln.evaluate.quality.agreement import agreement

    def compute(out: Path) -> dict[str, Any]:
        res = agreement(loaded["baseline"], loaded["candidate"], docs)
        res.write(out)
        return {"metrics": res.metrics, "samples": {"file": "agreement.jsonl", "columns": [
            "kl_mean", "kl_p99", "top1_agreement", "greedy_match"]}}

    run_stage(ctx, "agreement", "candidate",
              {"baseline": engines["baseline"].name, "candidate": engines["candidate"].name, **text_inputs},
              compute)


def _served(ctx: RunContext, loaded: LazyEngines, engines: dict[str, Path], cfg: Any) -> None:
    """The candidate's own `kiln serve` (its engine loaded again, by the server) under concurrent
    mixed-length requests, against the baseline one request at a time. The run's own copy of the
    candidate (the benchmark's) is closed first: the stage holds its weights once."""
    from kiln.engine.loader import load_engine, read_manifest
    from kiln.evaluate.parity import SHORTEST_TEXTS
    from kiln.evaluate.quality.served import served_text

    prompts = cached_prompts(ctx, engines["baseline"], ctx.recipe.evaluate.benchmark.prompts, cfg.num_prompts,
                             "evaluate.quality.served.num_prompts")

    def compute(out: Path) -> dict[str, Any]:
        loaded.keep_only("baseline")
        res = served_text(loaded["baseline"], lambda: load_engine(engines["candidate"]),
                          read_manifest(engines["candidate"])["source"]["path"], prompts, cfg)
        res.write(out)
        return {"metrics": res.metrics, "samples": {"file": "served.jsonl", "columns": ["served_match", "served_prefix"]}}

    run_stage(ctx, "served", "candidate",
              {"baseline": engines["baseline"].name, "candidate": engines["candidate"].name,
               "config": cfg.model_dump(mode="json"), "prompts": hash_of(prompts), "shortest": SHORTEST_TEXTS},
              compute)
