"""The served-text check on prompts sharing a prefix (`evaluate.quality.served.shared_prefix`): how
prompt-cache reuse is judged. The candidate's server answers them from its prompt cache, the reference
one request at a time with no cache, so a cache that reuses wrongly shows as changed text, and only
there: with prompts that share no prefix the same engine passes."""

from __future__ import annotations

import dataclasses

import pytest

from kiln.engine.hf_torch import TorchEngine, TorchEngineConfig
from kiln.evaluate.quality.served import ServedConfig, served_text, with_shared_prefix
from tests.engine import parity

PREFIX = 24


class CacheBrokenEngine(TorchEngine):
    """A prompt cache that reuses wrongly: a prompt whose first 16 tokens an earlier prompt had is
    "served from the cache", and every token it reports is off by one; any other prompt is exact."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen: set[tuple[int, ...]] = set()
        self.from_cache: set[int] = set()

    def add(self, request):
        head = tuple(request.prompt_ids[:16])
        hit = len(request.prompt_ids) > 16 and head in self.seen
        self.seen.add(head)
        seq = super().add(request)
        if hit:
            self.from_cache.add(seq)
        return seq

    def step(self):
        return [dataclasses.replace(e, token_id=(e.token_id + 1) % self.vocab_size) if e.seq_id in self.from_cache
                else e for e in super().step()]


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    engine = TorchEngine(tiny_model_dir, TorchEngineConfig(threads=1))
    yield engine
    engine.close()


def test_the_shared_prefix_is_the_prompts_own_text_and_stays_out_of_an_unset_config():
    assert with_shared_prefix([[1, 2], [3]], 5) == [[1, 2, 3, 1, 2, 1, 2], [1, 2, 3, 1, 2, 3]]
    assert "shared_prefix" not in ServedConfig().model_dump()  # the stage keys of recipes without it stay


def test_a_cache_that_reuses_wrongly_fails_only_on_prompts_sharing_a_prefix(reference, tiny_model_dir):
    prompts = parity.prompts(reference.tokenizer, 6)  # distinct starts, under 16 tokens each
    plain = ServedConfig(num_prompts=6, max_new_tokens=6, concurrency=3)

    def load():
        return CacheBrokenEngine(tiny_model_dir, TorchEngineConfig(threads=1))

    apart = served_text(reference, load, tiny_model_dir, prompts, plain)
    shared = served_text(reference, load, tiny_model_dir, prompts, plain.model_copy(update={"shared_prefix": PREFIX}))
    assert apart.metrics["served_match"] == 1.0, apart.records
    wrong = [r for r in shared.records if not r["served_match"]]
    # All but the first prefixed prompt to arrive came from the cache; the shortest prompts stay unprefixed.
    assert len(wrong) == len(prompts) - 1 and all(r["prompt_tokens"] > PREFIX for r in wrong), shared.records
    assert sum(r["prompt_tokens"] > PREFIX for r in shared.records) == len(prompts)


def test_llama_server_prompt_cache_reuse_writes_the_references_text(reference, tiny_model_dir, tmp_path):
    """llama.cpp's server runtime at f32 with cache_reuse on, four slots: the prefixed prompts reuse
    the shared prefix from the slots' caches and the greedy text is the reference's."""
    from kiln.engine.cache import write_engine
    from kiln.engine.llama_cpp.config import LlamaCppConfig
    from kiln.engine.loader import load_engine
    from tests.llama_cpp_build import require_llama_cpp

    require_llama_cpp()
    config = LlamaCppConfig(threads=1, parallel=4, ctx_per_slot=256, cache_type="f32", flash_attn="off",
                            cache_reuse=8)
    write_engine(config, tiny_model_dir, "test-checkpoint", tmp_path)
    served = ServedConfig(num_prompts=6, max_new_tokens=8, concurrency=3, shared_prefix=PREFIX)
    result = served_text(reference, lambda: load_engine(tmp_path), tiny_model_dir,
                         parity.prompts(reference.tokenizer, 6), served)
    assert result.metrics["served_match"] == 1.0, [(r["baseline"], r["candidate"]) for r in result.records]
