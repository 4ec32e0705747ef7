"""A quantized KV cache reaches the scorer that judges it: perplexity at the length the recipe rule asks
for (1024 tokens, kiln.pipeline.recipe.kv_cache_rule) moves when only the V cache's type changes.

The recipe rule refuses a quantized KV cache unless a gated perplexity check scores documents of at
least 1024 tokens; that is worth something only if the scorer runs with the candidate's KV types. The
bytes a sequence's KV takes in the scorer are read back in test_llama_cpp_levers.py; here the figure
the gate reads changes: the tiny Llama's per-document NLL on the demo text under a q4_0 V cache is not
the f16 one, while two f16 runs agree to the bit (so the difference is the cache type, not noise)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.engine.llama_cpp.config import LlamaCppConfig

SEQ_LEN = 1024  # the rule's floor, and the tiny Llama's max_position_embeddings
DOCUMENTS = 3


def _per_document_nll(folder: Path, docs: list[list[int]], v: str) -> list[float]:
    from kiln.engine.llama_cpp.library import LlamaLibraryEngine
    from kiln.evaluate.quality.perplexity import perplexity

    config = LlamaCppConfig(runtime="library", threads=1, parallel=1, ctx_per_slot=SEQ_LEN, cache_type="f16",
                            cache_type_v=v)
    engine = LlamaLibraryEngine(folder / "model.gguf", folder, config)
    try:
        return [r["nll"] for r in perplexity(engine, docs).records]
    finally:
        engine.close()


def test_a_q4_0_v_cache_changes_perplexity_at_1024_tokens(tiny_gguf, demo_data):
    from transformers import AutoTokenizer

    from kiln.evaluate.quality.base import documents

    tokenizer = AutoTokenizer.from_pretrained(tiny_gguf)
    docs = documents(tokenizer, Path(demo_data.eval_text).read_text()[:40_000], SEQ_LEN, DOCUMENTS)
    assert len(docs) == DOCUMENTS and all(len(d) == SEQ_LEN for d in docs)
    f16, again, q4 = (_per_document_nll(tiny_gguf, docs, v) for v in ("f16", "f16", "q4_0"))
    assert f16 == again  # deterministic: whatever differs below is the V cache's type
    # Every document moves (on the random tiny Llama by 2e-6 to 1e-4 of its NLL), none by accident.
    assert all(q != f for q, f in zip(q4, f16, strict=True)), (f16, q4)
    assert max(abs(q - f) / f for q, f in zip(q4, f16, strict=True)) > 1e-5, (f16, q4)
