"""Greedy decoding as a property of every local engine, whatever the batch looks like (issue 39).

hypothesis draws batches of 2-6 requests: prompts of 1 to 64 tokens, each request added before the
first step or after a few steps (joining the sequences already decoding), with its own
max_new_tokens, stop ids and ignore_eos. Every engine's tokens, batched so, must equal the same
engine's one request at a time; and, every build here being unquantized, the float32 torch
reference's within the near-tie rule of every build's parity check (kiln.evaluate.parity: where the
two differ, the reference's log-prob gap between its token and the engine's is within TIE_TOLERANCE).

The model is a tiny random Llama with untied embeddings and a wide init, whose greedy text follows
its context: the shared tiny model (tests/conftest.py) mostly repeats a prompt's last token, which
an engine that lost the rest of the prompt would repeat just the same. Each engine runs MAX_EXAMPLES
drawn batches plus the one the issue reported (a one-token prompt among longer ones), derandomized:
the same batches on every run.

Speculative decoding claims the text of the engine without it (issue 53): llama-server with each
speculative type kiln offers (ngram-simple, ngram-mod, and a draft model: the tiny GGUF drafting for
itself), on the shared tiny Llama and batched so, must write its plain twin's greedy tokens (the same
folder without speculation, one request at a time) under the lossless check's own rule
(kiln.evaluate.quality.lossless.record: a split only at a near-tie). Half of its prompts repeat a
segment, the copy-heavy text where drafting pays.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kiln.engine.base import Engine, GenerationRequest
from kiln.evaluate.parity import TIE_TOLERANCE, divergence
from kiln.evaluate.quality.lossless import record
from tests.engine import parity

MAX_EXAMPLES = 25  # 2-10 s an engine here, beside its 1-10 s build
NEW_TOKENS = 10  # the most any request asks for
# Ids 3..31999 exist in the demo tokenizer (49152); 0-2 are its special tokens, and id 2 (the pad
# token) has a zero embedding: a prompt of it alone gives every token the same logit, a tie nothing need break alike.
IDS = st.integers(3, 31_999)
# Requests of an example: (prompt, max_new_tokens, ignore_eos, stop, join). `stop` picks the stop id
# as the reference's token at that index of the prompt's unstopped continuation (a random id would
# never be generated); `join` is the steps taken before the request is added.
LENGTH = st.integers(1, 3) | st.integers(1, 64)  # half of them short: a one-token prompt is in most batches
PROMPT = LENGTH.flatmap(lambda n: st.lists(IDS, min_size=n, max_size=n))


def requests(prompts: st.SearchStrategy) -> st.SearchStrategy:
    """Batches of 2-6 requests with prompts drawn from `prompts`; the first starts the batch."""
    request = st.tuples(prompts, st.integers(1, NEW_TOKENS), st.booleans(), st.none() | st.integers(0, NEW_TOKENS - 1),
                        st.integers(0, 4))
    return st.lists(request, min_size=2, max_size=6).map(lambda b: [(*b[0][:4], 0), *b[1:]])


BATCH = requests(PROMPT)
ISSUE_39 = [([9 + k for k in range(n)], NEW_TOKENS, True, None, 0) for n in (1, 4, 13, 30, 64)]


def build_context_llama(tokenizer_dir: Path, out: Path) -> Path:
    """A 2-layer random Llama (the shared tiny one's shapes, untied embeddings, init std 0.5)."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, vocab_size=len(tok), max_position_embeddings=1024,
                         tie_word_embeddings=False, initializer_range=0.5, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, dtype="float32")
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.generation_config = GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                               pad_token_id=tok.pad_token_id)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def context_model(tiny_model_dir, tmp_path_factory) -> Path:
    return build_context_llama(tiny_model_dir, tmp_path_factory.mktemp("context-llama"))


@pytest.fixture(scope="module")
def reference(context_model):
    from kiln.engine.hf_torch import TorchEngine, TorchEngineConfig

    engine = TorchEngine(context_model, TorchEngineConfig(threads=1))
    yield engine
    engine.close()


def _build(name: str, checkpoint: Path, out: Path) -> Engine:
    """Each local backend at full precision, with the small batch limits that make requests queue."""
    from kiln.engine.ctranslate2 import CTranslate2Config
    from kiln.engine.llama_cpp.config import LlamaCppConfig
    from kiln.engine.openvino import OpenVINOConfig
    from tests.llama_cpp_build import require_llama_cpp

    if name.startswith("llama_cpp"):
        require_llama_cpp()
        runtime = name.split("-")[1]  # f32 cache, no flash attention: see test_llama_cpp.EXACT
        return parity.build(LlamaCppConfig(runtime=runtime, threads=1, parallel=4, ctx_per_slot=256, batch_size=16,
                                           cache_type="f32", flash_attn="off"), checkpoint, out)
    config = {"ctranslate2": CTranslate2Config(quantization="float32", threads=1, max_batch_size=4),
              "openvino": OpenVINOConfig(weights="fp32", threads=1, max_batch_size=4, max_batched_tokens=32)}[name]
    return parity.build(config, checkpoint, out)


@pytest.fixture(scope="module", params=["torch", "ctranslate2", "openvino", "llama_cpp-server", "llama_cpp-library"])
def engine(request, reference, context_model, tmp_path_factory):
    if request.param == "torch":
        yield reference  # the reference itself: batched against itself one request at a time
        return
    built = _build(request.param, context_model, tmp_path_factory.mktemp(request.param))
    yield built
    built.close()


def _requests(batch, reference: Engine, free: dict) -> list[GenerationRequest]:
    out = []
    for prompt, n, ignore_eos, stop, _ in batch:
        stop_ids: tuple[int, ...] = ()
        if stop is not None:
            key = (tuple(prompt), ignore_eos)
            if key not in free:
                free[key] = parity.run(reference, [GenerationRequest(prompt, NEW_TOKENS, ignore_eos)], [0])[0]
            stop_ids = (free[key][min(stop, len(free[key]) - 1)],)
        out.append(GenerationRequest(prompt, n, ignore_eos, stop_ids))
    return out


@settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@example(batch=ISSUE_39)
@given(batch=BATCH)
def test_batched_greedy_equals_alone_and_the_reference(engine, reference, batch):
    free: dict = {}  # the reference's unstopped continuations, from which stop ids are picked
    requests = _requests(batch, reference, free)
    batched = parity.run(engine, requests, [join for *_, join in batch])
    alone = [parity.run(engine, [r], [0])[0] for r in requests]
    assert batched == alone, [(len(r.prompt_ids), b, a) for r, b, a in zip(requests, batched, alone, strict=True)
                              if b != a]
    if engine is reference:
        return
    for r, got in zip(requests, batched, strict=True):
        want = parity.run(reference, [r], [0])[0]
        matched, gap = divergence(reference, r.prompt_ids, want, got)
        assert (got == want) if gap is None else gap <= TIE_TOLERANCE, (len(r.prompt_ids), matched, gap, got, want)



# Sizes meant to draft within NEW_TOKENS (llama.cpp's ngram-mod default waits for 48 tokens found).
# Lookup length 1: the tiny Llama repeats one token, and ngram-simple drafted nothing there at 2 (docs/engines.md).
SPECULATIVE = {"ngram-simple": {"type": "ngram-simple", "ngram_n": 1, "ngram_m": 8},
               "ngram-mod": {"type": "ngram-mod", "ngram_n": 1, "ngram_m": 8, "draft_min": 1},
               "draft": {"type": "draft", "draft_max": 4}}  # the model's own GGUF drafts for it
COPIED = st.lists(IDS, min_size=1, max_size=8).flatmap(lambda seg: st.integers(2, 8).map(lambda k: seg * k))
COPY_HEAVY = [([9 + k % 5 for k in range(n)], NEW_TOKENS, True, None, j) for j, n in enumerate((10, 25, 40))]


@pytest.fixture(scope="module")
def llama_folder(tiny_model_dir, tmp_path_factory) -> Path:
    """A llama.cpp server engine's folder: the plain twin and every speculative variant load it. Its
    model is the shared tiny Llama, which repeats itself, not the context Llama above: that one never
    writes an n-gram twice, so the n-gram drafters found no draft on it (0 of 30 tokens drafted)."""
    folder = tmp_path_factory.mktemp("llama-plain")
    _build("llama_cpp-server", tiny_model_dir, folder).close()
    return folder


@pytest.fixture(scope="module")
def plain_llama(llama_folder):
    from kiln.engine.loader import load_engine

    engine = load_engine(llama_folder)
    yield engine
    engine.close()


@pytest.fixture(scope="module", params=list(SPECULATIVE))
def speculative(request, llama_folder):
    from kiln.engine.llama_cpp.backend import GGUF
    from kiln.engine.loader import load_engine

    folder, spec = llama_folder, {**SPECULATIVE[request.param]}
    if spec["type"] == "draft":
        spec["draft_model"] = str(folder / GGUF)
    engine = load_engine(folder, speculative=spec)
    yield engine
    engine.close()


@settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@example(batch=ISSUE_39)
@example(batch=COPY_HEAVY)
@given(batch=requests(COPIED | PROMPT))
def test_speculative_greedy_equals_its_plain_twin(speculative, plain_llama, batch):
    requests_ = _requests(batch, plain_llama, {})
    batched = parity.run(speculative, requests_, [join for *_, join in batch])
    for i, (r, got) in enumerate(zip(requests_, batched, strict=True)):
        want = parity.run(plain_llama, [r], [0])[0]
        judged = record(plain_llama, "hypothesis", i, r.prompt_ids, want, got, None)
        assert judged["lossless_match"], judged["lossless_divergence"]


def test_each_speculative_variant_drafts(speculative, request):
    """The property above is not vacuous: on a prompt that repeats itself each variant drafts tokens.
    Not yet for ngram-mod: on the tiny Llama llama-server drafted nothing with it (no draft_n in its
    timings, no 'draft acceptance' line in its log), on this prompt nor on a 24-token one, while the model
    wrote one token 30 times (ngram-simple drafts at lookup length 1, not at 2); strict, so the day it
    drafts this fails and the mark goes."""
    if request.node.callspec.params["speculative"] == "ngram-mod":
        request.applymarker(pytest.mark.xfail(strict=True, reason="llama-server's ngram-mod drafts nothing on "
                                              "the tiny Llama (issue 53 finding): the property holds vacuously"))
    prompt = COPY_HEAVY[-1][0]
    events = list(speculative.generate([GenerationRequest(prompt, 3 * NEW_TOKENS, ignore_eos=True)]))
    assert events[-1].stats["draft_tokens"] > 0, events[-1].stats
