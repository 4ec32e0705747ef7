"""The recipe rule for a quantized KV cache: judged by perplexity at the longest context it serves.

A KV cache stored in fewer bytes than f16 (llama_cpp `cache_type_k`/`cache_type_v` q8_0 ... iq4_nl,
tensorrt_llm `kv_cache_dtype: fp8`) errs on every cached token, and attention reads them all: the longer
the context, the more it loses, so short documents flatter it. The recipe (`kiln validate`, `kiln run`,
and under `--policy-from` the pinned policy) is refused, exit 2, unless each such candidate has

- a gate check on perplexity, scored in the candidate's own engine with its KV types
  (engine/llama_cpp/scoring.py);
- `evaluate.quality.perplexity.seq_len` of at least MIN_SEQ_LEN and at least the longest sequence the
  engine serves, where its config bounds it (llama_cpp `ctx_per_slot`, tensorrt_llm `max_seq_len`);
- a baseline whose KV cache is not quantized: served on the candidate's own engine (`baseline.engine`
  unset) the baseline would hold the same cache, and the gate would compare the cache with itself.

OpenVINO's u8 KV cache is refused outright: its scorer compiles the IR without `KV_CACHE_PRECISION`
(engine/openvino.py, `_logits`), so none of kiln's quality checks sees the cache it serves with.
Grid candidates (pipeline/recipe/grid.py) are expanded before this runs and are named by their names.
"""

from __future__ import annotations

from typing import Any

import yaml

from kiln.engine.llama_cpp.config import KV_BYTES, LlamaCppConfig
from kiln.engine.openvino import OpenVINOConfig
from kiln.engine.tensorrt_llm import TensorRTLLMConfig

MIN_SEQ_LEN = 1024  # issue 53: a KV-cache type is judged at a context of at least this many tokens
CHECK_LINE = "- {kind: quality, metric: perplexity, margin: 0.05, relative: true}"  # what gate.checks adds
SEQ_LEN = "evaluate.quality.perplexity.seq_len"


def quantized_kv(engine: Any) -> list[str]:
    """The options that quantize `engine`'s KV cache, as 'option value' (empty when none does). For
    llama_cpp a type below f16's 2 bytes an element (KV_BYTES) is quantized; f32, f16 and bf16 are not."""
    if isinstance(engine, LlamaCppConfig):
        k, v = engine.kv_types()
        named = [("cache_type_k" if engine.cache_type_k else "cache_type", k),
                 ("cache_type_v" if engine.cache_type_v else "cache_type", v)]
        return list(dict.fromkeys(f"{option} {t}" for option, t in named if KV_BYTES[t] < KV_BYTES["f16"]))
    if isinstance(engine, OpenVINOConfig) and engine.kv_cache_precision == "u8":
        return ["kv_cache_precision u8"]
    if isinstance(engine, TensorRTLLMConfig) and engine.kv_cache_dtype == "fp8":
        return ["kv_cache_dtype fp8"]
    return []


def served_length(engine: Any) -> tuple[int, str] | None:
    """(tokens, option): the longest sequence (prompt and output) `engine` serves, where its config bounds it."""
    if isinstance(engine, LlamaCppConfig):
        return engine.ctx_per_slot, "ctx_per_slot"
    if isinstance(engine, TensorRTLLMConfig) and engine.max_seq_len is not None:
        return engine.max_seq_len, "max_seq_len"
    return None


def unjudged_kv_cache(recipe: Any) -> str | None:
    """Why `recipe`'s gate cannot judge a candidate's quantized KV cache at the longest context it serves
    (the module's rule), one problem a line; None when it can, or when no candidate quantizes its cache."""
    arms = [("the recipe's engine", recipe.engine)] if recipe.candidates is None else [
        (f"candidate {c.name}", c.engine) for c in recipe.candidates if not c.champion]
    quantized = [(who, engine, kinds) for who, engine in arms if (kinds := quantized_kv(engine))]
    if not quantized:
        return None
    for who, engine, kinds in quantized:
        if isinstance(engine, OpenVINOConfig):
            return (f"{who}: engine.{kinds[0]} quantizes the KV cache, and the openvino engine scores perplexity "
                    "without it (its scorer does not read kv_cache_precision), so no quality check can judge the "
                    "cache it serves with: set engine.kv_cache_precision to f16 or f32")
    problems = [p for p in (_missing_check(recipe), _short_documents(recipe, quantized),
                            _quantized_baseline(recipe, quantized)) if p]
    if not problems:
        return None
    named = ", ".join(f"{who} (engine.{', engine.'.join(kinds)})" for who, _, kinds in quantized)
    return (f"{named}: a quantized KV cache is judged by a perplexity check at the longest context it serves (at "
            f"least {MIN_SEQ_LEN} tokens) against a baseline whose cache is not quantized:"
            + "".join(f"\n    {p}" for p in problems))


def _missing_check(recipe: Any) -> str | None:
    if any(c.kind == "quality" and c.metric == "perplexity" for c in recipe.gate.checks):
        return None
    return f"gate.checks has no perplexity check: add `{CHECK_LINE}` to gate.checks"


def _short_documents(recipe: Any, quantized: list[tuple[str, Any, list[str]]]) -> str | None:
    """Why the perplexity documents are shorter than the longest context a quantized candidate serves."""
    seq_len = recipe.evaluate.quality.perplexity.seq_len
    need, why, option = MIN_SEQ_LEN, f"below {MIN_SEQ_LEN}", None
    for who, engine, _ in quantized:
        if (served := served_length(engine)) and served[0] > need:
            need, option = served
            why = f"and {who} serves sequences of up to {need} tokens (engine.{option})"
    if seq_len >= need:
        return None
    lower = (f", or lower engine.{option} to the longest context users send (at least {MIN_SEQ_LEN}) and seq_len "
             "to match") if option else ""
    return (f"{SEQ_LEN} is {seq_len}, {why}: set {SEQ_LEN}: {need}{lower} (evaluate.quality.perplexity.text "
            "must hold max_documents documents that long)")


def _quantized_baseline(recipe: Any, quantized: list[tuple[str, Any, list[str]]]) -> str | None:
    """Why the baseline holds a quantized KV cache too, so the gate cannot see what the cache costs."""
    if recipe.baseline.engine is not None:
        if kinds := quantized_kv(recipe.baseline.engine):
            return (f"baseline.engine quantizes its KV cache too ({', '.join(kinds)}), so the gate compares the "
                    "cache with itself: leave the KV types out of baseline.engine")
        return None
    if recipe.candidates is not None:
        return None  # a search's baseline defaults to torch, whose KV cache is the checkpoint's dtype
    engine = quantized[0][1]
    plain = {"backend": engine.backend, **engine.model_dump(mode="json", exclude_defaults=True)}
    for option in ("cache_type", "cache_type_k", "cache_type_v", "kv_cache_precision", "kv_cache_dtype"):
        plain.pop(option, None)
    line = yaml.safe_dump({"engine": plain}, default_flow_style=True, sort_keys=False).strip()
    return ("baseline.engine is unset, so the baseline is served on this same engine with the same cache and the "
            f"gate compares the cache with itself: add `baseline: {line}` (the engine without the KV types)")
