"""The memory plan of a recipe's arms: one line for the baseline and one per candidate, each with
every step a `kiln run` takes (quantize, serve, the parity reference, the engine, quality, benchmark), as
`kiln plan-memory` prints it and as `kiln run` checks it before it loads anything."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, NamedTuple

from kiln.engine.full_logits import token_budget
from kiln.engine.llama_cpp.config import KV_BYTES
from kiln.engine.llama_cpp.scoring import SCORING_ROWS
from kiln.evaluate import parity
from kiln.evaluate.quality.perplexity import BATCH
from kiln.optimize.architecture import DecoderShapes
from kiln.optimize.memory import (
    DTYPE_BYTES,
    SCORE_BATCH_TOKENS,
    SCORING,
    Component,
    MemoryPlan,
    StepPlan,
    check_arms,
    checkpoint_held,
    export_held,
    human,
    larger,
    plan_memory,
    runtime,
    source_dtype,
)

Plans = dict[str, tuple[str, MemoryPlan]]


def with_pipeline_steps(plan: MemoryPlan, model_config: dict[str, Any], baseline: MemoryPlan | None, *,
                        reference: str | None, export: str | None = None, torch_dtype: str | None = None,
                        score_tokens: int = SCORE_BATCH_TOKENS, held: tuple[Component, ...] = (),
                        scoring: tuple[Component, ...] = (), compared: tuple[Component, ...] | None = None,
                        after_export: bool = False) -> MemoryPlan:
    """`plan` (one arm's quantize and serve steps) with the steps a `kiln run` adds, each what kiln's process
    (its runtime, measured: "kiln run, evaluating" from the quality stages on, and from the start where an
    OpenVINO export ran before in the process, `after_export`) and its children hold at once:

    - reference: the parity smoke check's torch reference, in the dtype `reference` names (None:
      the engine is its own reference), loaded and freed before the engine loads; while it loads
      the checkpoint's pages as stored are mapped too, when it converts them to another dtype;
    - engine: the built engine, and what it allocates beside its weights when it generates (`held`,
      e.g. llama.cpp's KV cache for its slots); one exported from the checkpoint (OpenVINO traces the
      torch model, whose weights the converted graph shares, and compresses it) holds instead, while
      it builds, the checkpoint in the dtype `export` names and its pages as stored where that is
      wider: the larger of the two phases, as the export is handed back before the engine loads;
    - quality: the arm's perplexity and lm-eval stages hold its engine alone (the baseline is
      released first) and its scoring buffers: an arm on torch (`torch_dtype`) scores `score_tokens`
      positions a pass, whose logits it holds in its dtype and again in float32; another backend's
      are the caller's `scoring` (what it holds while it scores: its own context, its logits);
    - benchmark: the stages that set the arm beside the baseline (the decode benchmark, token agreement,
      the served text, the load stage) hold both engines in one process, the arm's with what it allocates
      there (`compared`; default `held`; agreement's logits, a document's at a time, are not counted)."""
    shapes = DecoderShapes.from_config(model_config)
    serve = next(s for s in plan.steps if s.step == "serve").components[0]
    run = runtime("kiln run, evaluating" if after_export else "kiln run")
    bare = runtime("torch + transformers")  # kiln's own process in a quantize step is a run's, not a bare import
    steps = [StepPlan(s.step, tuple(run if c == bare else c for c in s.components)) if s.step == "quantize" else s
             for s in plan.steps]
    if reference is not None:
        steps.append(StepPlan("reference", (run, *checkpoint_held(shapes, model_config, reference, "parity reference (torch "
                                                                  f"{reference})", "freed before the engine loads"))))
    weights_ = Component(f"this arm: {serve.name}", serve.bytes, serve.formula)
    this = (weights_, *(held if compared is None else compared))
    exported = () if export is None else export_held(shapes, model_config, export)
    steps.append(StepPlan("engine", (run, weights_, *larger(exported, held))))  # the export is freed first
    evaluating = runtime("kiln run, evaluating")
    quality = [evaluating, weights_, *scoring]
    if torch_dtype:
        per = DTYPE_BYTES.get(torch_dtype, 4.0) + 4.0
        quality.append(Component(SCORING, score_tokens * shapes.vocab * per,
                                 f"{score_tokens} tokens × {shapes.vocab} vocab × ({per - 4:g} + 4) B",
                                 per_token=shapes.vocab * per))
    steps.append(StepPlan("quality", tuple(quality)))
    if baseline is not None:
        b = next(s for s in baseline.steps if s.step == "serve").components[0]
        steps.append(StepPlan("benchmark", (evaluating, *this, Component(f"baseline: {b.name}", b.bytes, b.formula))))
    return replace(plan, steps=tuple(steps))


def arm_plans(recipe: Any, config: dict[str, Any], *, context: int, batch: int = 1, kv_dtype: str | None = None,
              available: int | None = None) -> tuple[Plans, dict[str, str]]:
    """(arm -> (what it is, its plan), arm -> where the recipe sets it) for `recipe` on the checkpoint
    whose config.json is `config`. A champion candidate is served as it was judged: not planned."""
    arms = recipe.arms()
    base_engine = _baseline_engine(recipe)

    def plan(method: Any, engine: Any, baseline: MemoryPlan | None = None, after_export: bool = False) -> MemoryPlan:
        dtype = _torch_dtype(engine, config)
        compressed = {"int8": "int8", "fp32": "float32"}.get(getattr(engine, "weights", "")) \
            if engine.backend == "openvino" else None  # OpenVINO compresses the checkpoint as it builds
        p = plan_memory(config, method, context=context, batch=batch, kv_dtype=kv_dtype, available_bytes=available,
                        engine_dtype=dtype or compressed)
        scored = scored_tokens(recipe, engine)
        q = recipe.evaluate.quality
        longest = scored if q.lmeval else min(scored, q.perplexity.seq_len)
        b = _buffers(engine, config, scored, longest, context * batch)
        # lm-eval's generate_until tasks beside its log-likelihoods: llama.cpp keeps its scoring context beside its
        # slots' KV cache; OpenVINO hands one compiled model back before it makes the other
        both = larger(b.scoring, b.generating) if b.alternates else b.scoring + b.generating
        quality = both if q.lmeval else b.scoring
        return with_pipeline_steps(p, config, baseline, reference=_reference(method, engine, config),
                                   export=_export_dtype(engine, config), torch_dtype=dtype, score_tokens=scored,
                                   # the parity check generates, hands the pipeline back, then scores
                                   held=larger(b.generating, b.scoring), scoring=quality,
                                   # the decode benchmark hands back a scorer token agreement made before it
                                   compared=b.generating, after_export=after_export)

    base = plan(None, base_engine)
    plans = {"baseline": (f"none → {base_engine.backend}", base)}
    exported = False  # the arms build in the recipe's order, in one process: what OpenVINO's export loads stays
    for name, arm in arms:
        plans[name] = (f"{arm.optimize.method} → {arm.engine.backend}",
                       plan(arm.optimize, arm.engine, base, after_export=exported))
        exported |= arm.engine.backend == "openvino"
    fields = ({c.name: f"candidates.{i}" for i, c in enumerate(recipe.candidates)} if recipe.candidates is not None
              else {"candidate": "optimize"})
    return plans, fields


def scored_tokens(recipe: Any, engine: Any) -> int:
    """Positions the engine scores in one call in this run: lm-eval fills its scoring budget
    (score_batch_tokens, llama.cpp's ctx_per_slot); perplexity alone scores `perplexity.BATCH`
    documents a call, fewer where they are short."""
    config = engine.model_dump()
    budget = config.get("score_batch_tokens") or config.get("ctx_per_slot") or SCORE_BATCH_TOKENS
    q = recipe.evaluate.quality
    return budget if q.lmeval else min(budget, BATCH * q.perplexity.seq_len)


class Buffers(NamedTuple):
    """What an engine other than torch holds beside its weights: when it generates, when it scores
    (torch's scoring logits `with_pipeline_steps` counts itself), and whether a stage that does both
    hands one back before it makes the other (`alternates`) rather than holding them side by side."""

    generating: tuple[Component, ...]
    scoring: tuple[Component, ...]
    alternates: bool = False


# OpenVINO's generation pipeline beside its weights, per token of a prefill step, in units of the MLP's
# width x 4 B: its buffers grew by 0.18 GiB for a 1,000-token prompt in one step at 1B (intermediate
# 8,192; 0.04 GiB in 256-token steps), KV blocks aside (measured on the 1B int8 IR, docs/engines.md: the fifth round).
OPENVINO_PREFILL_WIDTHS = 6


def _buffers(engine: Any, config: dict[str, Any], scored: int, longest: int, tokens: int) -> Buffers:
    """What `engine` allocates beside its weights. `scored`: positions one scoring call scores;
    `longest`: the longest sequence among them; `tokens`: the context its requests hold at once.

    - llama.cpp: when it generates, the KV cache of its slots (parallel x ctx_per_slot tokens), made on
      the first decode; when it scores, its scorer's own context (a KV cache of ctx_per_slot tokens, an
      output buffer and a compute graph of SCORING_ROWS rows of logits) and one sequence's logits and
      log-probs (the scorer hands each sequence over as it is decoded);
    - OpenVINO: when it generates, its pipeline's KV blocks as the requests fill them and one prefill
      step's buffers; when it scores, the batch's logits and a sequence's log-probs; holding both would be
      two compiled models, each with the weights repacked (the IR's mapped pages are dropped behind the
      repack, engine/mapped_pages.py), so every stage that does both hands one back before it makes the
      other: the parity check and lm-eval the pipeline before they score, the decode benchmark and
      lm-eval's generate_until the scorer before they generate;
    - CTranslate2, when it scores: the batch's logits and a sequence's log-probs."""
    if engine.backend == "torch":
        return Buffers((), ())
    shapes = DecoderShapes.from_config(config)
    # a sequence at a time, or a call's batch, which OpenVINO and CTranslate2 keep within a logits budget
    kept = longest if engine.backend == "llama_cpp" else max(longest, token_budget(scored, shapes.vocab))
    what = "a sequence's logits and log-probs" if engine.backend == "llama_cpp" else "the batch's and a sequence's log-probs"
    logits = Component(f"scoring logits ({engine.backend})", 2 * kept * shapes.vocab * 4,
                       f"{kept} tokens × {shapes.vocab} vocab × 4 B, {what}")
    if engine.backend == "openvino":
        return Buffers((_openvino_pipeline(engine, shapes, tokens),), (logits,), alternates=True)
    if engine.backend != "llama_cpp":
        return Buffers((), (logits,))
    k, v = engine.kv_types()  # K and V may differ (cache_type_k/_v), each at its own bytes per value
    per = (shapes.kv_bytes_per_token(KV_BYTES[k]) + shapes.kv_bytes_per_token(KV_BYTES[v])) / 2
    slots = engine.parallel * engine.ctx_per_slot
    types = k if k == v else f"K {k}, V {v}"
    kv = Component(f"KV cache ({types}, {engine.parallel} slots × {engine.ctx_per_slot} tokens)",
                   per * slots, f"{slots} tokens × {human(per)}, made on the first decode")
    rows = min(engine.batch_size, engine.ctx_per_slot, SCORING_ROWS)
    scorer = Component("scoring context (llama.cpp)", per * engine.ctx_per_slot + 2 * rows * shapes.vocab * 4,
                       f"KV {engine.ctx_per_slot} tokens × {human(per)} + 2 × {rows} rows × {shapes.vocab} vocab × 4 B")
    return Buffers((kv,), (scorer, logits))


def _openvino_pipeline(engine: Any, shapes: DecoderShapes, tokens: int) -> Component:
    """OpenVINO's generation pipeline beside its weights: KV blocks for `tokens` and a prefill step's buffers."""
    per = shapes.kv_bytes_per_token(DTYPE_BYTES[{"f32": "float32", "f16": "float16", "u8": "int8"}[engine.kv_cache_precision]])
    step = min(tokens, engine.max_batched_tokens)
    return Component("generation pipeline (OpenVINO): KV blocks and a prefill step",
                     per * tokens + step * shapes.intermediate * 4 * OPENVINO_PREFILL_WIDTHS,
                     f"KV {tokens} tokens × {human(per)} + {step} tokens × {shapes.intermediate} × 4 B × "
                     f"{OPENVINO_PREFILL_WIDTHS}")


def run_context(recipe: Any) -> tuple[int, int]:
    """(context tokens, batch) a run's engines serve: the longest perplexity document or benchmark
    request, at the benchmark's largest batch."""
    ev = recipe.evaluate
    return max(ev.quality.perplexity.seq_len, 512 + ev.benchmark.max_new_tokens), max(ev.benchmark.batch_sizes)


def check_run(recipe: Any, config: dict[str, Any]) -> None:
    """Refuse a run, before it loads anything, when one of its arms does not fit in the memory free
    here (DoesNotFit: exit 2, every arm's numbers and the change that fits). A search whose candidates
    run on a Ray cluster is planned where they run, not here."""
    if recipe.candidates is not None and recipe.search.executor != "local":
        return
    context, batch = run_context(recipe)
    plans, fields = arm_plans(recipe, config, context=context, batch=batch)
    # An arm whose method needs a GPU this machine lacks is refused by its quantizer, which says so.
    plans = {name: arm for name, arm in plans.items() if arm[1].device == "cpu" or arm[1].available_bytes > 0}
    check_arms(plans, fields, first=first_change(recipe, config))


def first_change(recipe: Any, config: dict[str, Any]) -> str:
    """The change to make before any other when an arm does not fit: a torch baseline in float32 on a
    16-bit checkpoint holds it twice as large as it is published (and beside every candidate)."""
    base = _baseline_engine(recipe)
    stored = source_dtype(config)
    if _torch_dtype(base, config) != "float32" or stored == "float32":
        return ""
    where = "baseline.engine.dtype" if recipe.candidates is not None or recipe.baseline.engine else "engine.dtype"
    return (f"First: the baseline holds the checkpoint in float32, twice what it stores; {where}: {stored} "
            "serves it as it is published (then plan again). ")


def _baseline_engine(recipe: Any) -> Any:
    """The engine the baseline is served on (a search's default: torch, see Recipe.arms)."""
    arms = recipe.arms()
    return (arms[0][1] if arms else recipe).engine_for("baseline")


def _torch_dtype(engine: Any, config: dict[str, Any]) -> str | None:
    """What a torch engine loads the checkpoint in (auto: as stored); None for another backend."""
    dtype = getattr(engine, "dtype", None) if engine.backend == "torch" else None
    return source_dtype(config) if dtype == "auto" else dtype


def _export_dtype(engine: Any, config: dict[str, Any]) -> str | None:
    """The dtype OpenVINO's build holds the checkpoint in (kiln.engine.openvino_export): as stored when it
    compresses to int8 or int4, float32 for its exact fp32 IR; None for a backend that exports nothing."""
    if engine.backend != "openvino":
        return None
    return "float32" if engine.weights == "fp32" else source_dtype(config)


def _reference(method: Any, engine: Any, config: dict[str, Any]) -> str | None:
    """The dtype the engine stage's parity reference loads the checkpoint in (kiln.evaluate.parity),
    or None where the engine is torch at that dtype, its own reference."""
    exact = parity.unquantized({"backend": engine.backend, "config": engine.model_dump(mode="json")},
                               getattr(method, "method", "none") != "none")
    dtype = parity.reference_dtype(exact, source_dtype(config))
    return None if _torch_dtype(engine, config) == dtype else dtype
