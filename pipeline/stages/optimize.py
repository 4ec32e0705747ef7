"""The stages that make what is measured: the optimize stage (calibrate, quantize, write the manifest),
the engine stage (build, then a parity smoke check against the torch reference) and the tune stage."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from kiln.core.files import atomic_write_json, cached_tree_hash, dir_size, hash_of, read_json, sha256_tree
from kiln.core.versions import library_versions
from kiln.optimize.base import QUANTIZERS, ModelArtifact
from kiln.optimize.memory import source_dtype
from kiln.pipeline.demo.prepare import prepare_demo_data
from kiln.pipeline.recipe.model_source import ResolvedModel, resolve_model
from kiln.pipeline.stages.rss import return_freed_memory
from kiln.pipeline.stages.inputs import read_prompts, text_path, tokenized_prompts, tokenizer_of
from kiln.pipeline.stages.base import RunContext, StageOutcome, peak_rss_bytes, run_stage


def optimize_both(ctx: RunContext, model: ResolvedModel) -> dict[str, ModelArtifact]:
    baseline_cfg = QUANTIZERS.config("none")()
    return {role: quantize(ctx, role, cfg, model)
            for role, cfg in (("baseline", baseline_cfg), ("candidate", ctx.recipe.optimize))}


def quantize(ctx: RunContext, role: str, cfg: Any, model: ResolvedModel) -> ModelArtifact:
    """One optimize stage: check before any work, calibrate if needed, quantize, write the manifest."""
    quantizer = QUANTIZERS.create(cfg)
    quantizer.check(model.config)
    _plan_memory(ctx, cfg, model).check()  # refuse with the numbers before loading anything
    calibration = _calibration(ctx, cfg, model) if quantizer.needs_calibration else None
    inputs = {"method": cfg.model_dump(mode="json"), "source": model.sha256,
              "calibration": calibration.sha256 if calibration else None}

    def compute(out: Path) -> dict[str, Any]:
        start = time.perf_counter()
        fields = quantizer.quantize(model.path, out / "model", calibration)
        manifest = {"method": cfg.method, "params": cfg.model_dump(mode="json"), "source": str(model.path),
                    "source_sha256": model.sha256, "calibration_sha256": inputs["calibration"],
                    "libraries": library_versions(), "wall_s": time.perf_counter() - start,
                    "peak_rss_bytes": peak_rss_bytes(), "size_bytes": dir_size(out / "model"), **fields}
        from kiln.optimize.checkpoint import canonicalize_safetensors

        if quantizer.artifact_format == "safetensors":  # a GGUF file is written by llama.cpp, byte-stable itself
            canonicalize_safetensors(out / "model")  # same weights, same bytes: the hash chain holds
        manifest["sha256"] = sha256_tree(out / "model")
        atomic_write_json(out / "model" / "kiln-artifact.json", manifest)
        metrics = {"quantize_s": manifest["wall_s"], "size_bytes": manifest["size_bytes"],
                   "peak_rss_bytes": manifest["peak_rss_bytes"], "bits_per_weight": manifest.get("bits_per_weight")}
        return {"metrics": metrics, "manifest": manifest}

    o = run_stage(ctx, "optimize", role, inputs, compute, artifacts=("model/kiln-artifact.json",), portable=False)
    return ModelArtifact(path=o.path / "model", manifest=o.result["manifest"])


def _plan_memory(ctx: RunContext, cfg: Any, model: ResolvedModel) -> Any:
    from kiln.optimize.memory import plan_memory
    from kiln.pipeline.stages.memory_plan import run_context

    context, batch = run_context(ctx.recipe)
    return plan_memory(model.config, cfg, context=context, batch=batch)


def _calibration(ctx: RunContext, cfg: Any, model: ResolvedModel):
    """Calibration samples, refused if they overlap the text the candidate is evaluated on."""
    from kiln.optimize.calibration import build_calibration, check_disjoint

    text = calibration_text(cfg.calibration.dataset)
    check_disjoint(text, text_path(ctx.recipe.evaluate.quality.perplexity.text))
    return build_calibration(cfg.calibration, model.path, text)


def calibration_text(dataset: str) -> Path:
    """The calibration file a recipe names: 'demo' (kiln's Austen calibration text) or a local file."""
    from kiln.optimize.calibration import resolve_dataset

    if dataset == "demo":
        return Path(prepare_demo_data().calibration_text)
    return resolve_dataset(dataset)


def engine(ctx: RunContext, role: str, art: ModelArtifact) -> Path:
    """The role's engine, built once per config and artifact: `engine`, or for the baseline
    `baseline.engine` when the recipe sets one (then the two arms may run on different backends).

    With `tune` set, both roles on that engine get the knobs tuned on the candidate (`tune_engine`): the
    gate then compares the two models served the same way, so what it sees comes from the
    optimization, not from knobs that happen to suit one arm. Tuning the baseline separately
    would confound the two."""
    from kiln.engine.base import BACKENDS, MANIFEST as ENGINE_MANIFEST
    from kiln.engine.cache import build_engine
    from kiln.evaluate import parity
    from kiln.evaluate.tune import with_knobs

    cfg = ctx.recipe.engine_for(role)
    if ctx.recipe.tune and cfg is ctx.recipe.engine:  # a baseline on its own engine is served untuned
        candidate = art if role == "candidate" else ModelArtifact(
            path=ctx.outcomes["optimize:candidate"].path / "model",
            manifest=ctx.outcomes["optimize:candidate"].result["manifest"])
        cfg = with_knobs(cfg, tune_engine(ctx, candidate).result["winner"])
    cfg = _draft_named(ctx, cfg)

    def compute(out: Path) -> dict[str, Any]:
        engine_dir = build_engine(cfg, art.path, art.manifest["sha256"], ctx.cache)
        return_freed_memory()  # what the build freed (an export's model) is not held beside the parity check
        figures = _parity_smoke(ctx, engine_dir, art)
        if figures is None:
            return {"engine_dir": str(engine_dir), "metrics": {}}
        atomic_write_json(out / "parity.json", figures)
        summary = {k: v for k, v in figures.items() if k != "per_prompt"}
        return {"engine_dir": str(engine_dir), "parity": summary, "metrics": {
            f"parity_{k}": summary[k] for k in ("identical", "max_abs_logprob", "mean_abs_logprob")
            if summary[k] is not None}}

    # "parity" keys the stage, so an engine built before the smoke check existed is checked once; the
    # backend's revision (engine/cache.py's key holds it too) so a changed adapter is built and measured again.
    # The smoke check's prompts are the benchmark's first few: their text is what the stage read, so it keys it
    # (a recipe with fewer or other prompts must not reuse a check run on these).
    revision = BACKENDS.get(cfg.backend).revision
    b = ctx.recipe.evaluate.benchmark
    checked = min(parity.PROMPTS, b.num_prompts)
    outcome = run_stage(ctx, "engine", role, {"backend": cfg.model_dump(mode="json"), "artifact": art.manifest["sha256"],
                                              "parity": {"prompts": checked, "texts": hash_of(read_prompts(b.prompts, checked)),
                                                         "tokens": parity.NEW_TOKENS, "shortest": parity.SHORTEST_TEXTS},
                                              **({"revision": revision} if revision else {})},
                        compute, artifacts=("parity.json",), portable=False,
                        needs=lambda result: [Path(result["engine_dir"]) / ENGINE_MANIFEST])
    return Path(outcome.result["engine_dir"])


def _draft_named(ctx: RunContext, cfg: Any) -> Any:
    """`cfg` with its draft model's bytes named (speculative.draft_sha256, in the engine's key): a draft
    made anew, or a .gguf rewritten at its path, builds and measures a new engine. A draft given as another
    candidate is that candidate's artifact, made here once as role "draft" under the candidate's own
    optimize key (so the run makes it once, whichever arm asks first); the build links it in."""
    from kiln.engine.llama_cpp.config import LlamaCppConfig, drafting_candidate

    if not isinstance(cfg, LlamaCppConfig) or cfg.speculative is None or cfg.speculative.type != "draft":
        return cfg
    draft = drafting_candidate(cfg)
    if draft is None:
        # remembered by the file's stat signature, as the checkpoint's hash is: a rerun does not read the draft again
        return cfg.draft_resolved(cached_tree_hash(Path(cfg.speculative.draft_model),  # type: ignore[arg-type]
                                                   ctx.cache / "hashes.json"))
    if "optimize:draft" not in ctx.outcomes:
        quantize(ctx, "draft", draft.optimize, resolve_model(ctx.recipe.model.path, ctx.cache))
    made = ctx.outcomes["optimize:draft"]
    return cfg.draft_resolved(made.result["manifest"]["sha256"], made.path / "model")


def _parity_smoke(ctx: RunContext, engine_dir: Path, art: ModelArtifact) -> dict[str, Any] | None:
    """A few greedy prompts through the built engine and the torch reference on the same checkpoint
    (kiln.evaluate.parity); an unquantized build that is not exact is refused here. The reference
    answers first and is freed before the engine loads, so the stage holds one model at a time.
    None for a remote endpoint: nothing was built, and what it serves is not this checkpoint's to check."""
    from kiln.engine.loader import load_engine, read_manifest
    from kiln.evaluate import parity

    manifest = read_manifest(engine_dir)
    if manifest["backend"] == "remote":
        return None
    b = ctx.recipe.evaluate.benchmark
    prompts = tokenized_prompts(b.prompts, min(parity.PROMPTS, b.num_prompts), tokenizer_of(engine_dir))
    exact = parity.unquantized(manifest, art.manifest.get("method", "none") != "none")
    checkpoint = parity.reference_checkpoint(art.path, *_unquantized_sources(ctx, art))
    dtype = parity.reference_dtype(exact, source_dtype(read_json(checkpoint / "config.json")))
    # A torch engine at the reference's dtype is the reference backend itself: it is checked against
    # itself one request at a time (its batching), without loading the checkpoint a second time.
    itself = manifest["backend"] == "torch" and manifest["config"].get("dtype") == dtype
    engine = load_engine(engine_dir) if itself else None
    answers = parity.reference_answers(engine, prompts) if itself else _reference_answers(ctx, checkpoint, dtype, prompts)
    if engine is None:  # the reference is gone (its freed pages handed back): now the engine under test loads
        return_freed_memory()
        engine = load_engine(engine_dir)
    try:
        label = f"the {manifest['backend']} engine {engine_dir.name} ({_precision(manifest)})"
        figures = parity.check_answers(engine, answers, exact, label)
    finally:
        engine.close()
    figures["reference"] = "this engine, one request at a time" if itself else f"torch {dtype}, one request at a time"
    if not itself and checkpoint != art.path:
        figures["reference"] += f", on the source checkpoint {checkpoint}"
    ctx.console.print(f"  parity vs {figures['reference']}: {figures['identical']:.0%} of {figures['prompts']} greedy prompts "
                      f"identical, max |delta log-prob| {figures['max_abs_logprob']}", markup=False)
    return figures


def _reference_answers(ctx: RunContext, checkpoint: Path, dtype: str, prompts: list[list[int]]) -> Any:
    """The reference's answers, the reference freed before they are returned."""
    import gc

    from kiln.evaluate import parity

    reference = parity.reference_engine(checkpoint, getattr(ctx.recipe.engine, "threads", None), dtype)
    try:
        return parity.reference_answers(reference, prompts)
    finally:
        reference.close()
        del reference
        gc.collect()


def _unquantized_sources(ctx: RunContext, art: ModelArtifact) -> list[Path | str | None]:
    """Where the unquantized weights `art` was made from are, best first: this run's baseline
    artifact (a `none` pass-through in the cache) when it was made from the same source, then the
    folder the artifact's manifest recorded, which a reused stage may have outlived."""
    sources: list[Path | str | None] = []
    base = ctx.outcomes.get("optimize:baseline")
    if base is not None and base.result["manifest"].get("source_sha256") == art.manifest.get("source_sha256"):
        sources.append(base.path / "model")
    sources.append(art.manifest.get("source"))
    return sources


def _precision(manifest: dict[str, Any]) -> str:
    c = manifest["config"]
    return str(c.get("dtype") or c.get("quantization") or c.get("weights") or "precision unknown")


def tune_engine(ctx: RunContext, art: ModelArtifact) -> StageOutcome:
    """Search the recipe's `tune` space on `art`, once per run; a cached stage, so re-running does
    not re-tune. Every trial is logged as a child of the stage's MLflow run."""
    from kiln.evaluate.tune import log_trials, tune, tune_inputs

    if "tune:candidate" in ctx.outcomes:
        return ctx.outcomes["tune:candidate"]
    cfg, space, sha = ctx.recipe.engine, ctx.recipe.tune, art.manifest["sha256"]
    outcome = run_stage(ctx, "tune", "candidate", tune_inputs(cfg, space, sha),
                        lambda out: tune(cfg, space, art.path, sha, ctx.cache, out,
                                         log=lambda s: ctx.console.print(s, markup=False)))
    log_trials(ctx.tracker, outcome.mlflow_run, outcome.result, outcome.reused)
    return outcome
