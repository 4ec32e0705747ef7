"""The `llama_cpp` backend (kiln-managed llama-server) against the torch reference on the tiny
Llama: f32 greedy tokens and streamed log-probs under concurrent requests of mixed prompt
lengths, a request joining mid-decode, stop ids and cancel, and the scoring refusal.
Tolerances: parity.py."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.engine.base import GenerationRequest
from kiln.engine.llama_cpp import LlamaCppConfig, NotSupported, server_command
from kiln.optimize.gguf import Gguf, GgufConfig
from tests.engine import parity
from tests.llama_cpp_build import require_llama_cpp


@pytest.fixture(scope="module", autouse=True)
def _built():
    require_llama_cpp()


@pytest.fixture(scope="module")
def llama_f32(tiny_model_dir, tmp_path_factory):
    engine = parity.build(LlamaCppConfig(threads=1, parallel=4, ctx_per_slot=512), tiny_model_dir,
                          tmp_path_factory.mktemp("llama-f32"))
    yield engine
    engine.close()


def mixed_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [list(map(int, rng.integers(3, vocab, n))) for n in (2, 7, 13, 25, 40, 4, 60, 1)]


def test_manifest_and_server_flags(llama_f32):
    build = llama_f32.manifest["build"]
    assert build["format"] == "gguf" and build["type"] == "f32" and build["bits_per_weight"] == 32.0
    assert build["tokenizer_model"] == "gpt2"
    cmd = server_command("llama-server", "m.gguf", 1234, LlamaCppConfig(threads=2, parallel=3, ctx_per_slot=100))
    assert cmd[cmd.index("--parallel") + 1] == "3" and cmd[cmd.index("--ctx-size") + 1] == "300"
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and cmd[cmd.index("--threads") + 1] == "2"
    assert llama_f32.server_url.startswith("http://127.0.0.1:")


def test_concurrent_mixed_lengths_greedy_matches_torch(llama_f32, torch_engine):
    """More requests than slots, all submitted at once, prompts of 1-60 tokens: every sequence's
    greedy tokens equal torch's (the tokenizer's prompts and random ids both)."""
    ps = parity.prompts(torch_engine.tokenizer) + mixed_prompts(llama_f32.vocab_size)
    got, want = parity.greedy(llama_f32, ps), parity.greedy(torch_engine, ps)
    assert all(len(g) == 16 for g in got)
    assert parity.identical_fraction(got, want) >= parity.FULL["identical"]


def test_streamed_logprobs_match_torch_scores(llama_f32, torch_engine):
    ps = mixed_prompts(llama_f32.vocab_size, 1)[:4]
    ids = [llama_f32.add(GenerationRequest(p, 8, ignore_eos=True)) for p in ps]
    events: dict[int, list] = {i: [] for i in ids}
    while llama_f32.has_work():
        for e in llama_f32.step():
            events[e.seq_id].append(e)
    for p, i in zip(ps, ids, strict=True):
        tokens = [e.token_id for e in events[i]]
        assert events[i][-1].finish_reason == "length" and len(tokens) == 8
        want = torch_engine.score([(p, tokens)])[0].token_logprobs
        assert np.abs(np.subtract([e.logprob for e in events[i]], want)).max() < parity.FULL["logprob_atol"]


def test_request_joins_mid_decode(llama_f32):
    """A request added while another decodes streams at once (no wait for the first to end),
    and both produce what they produce alone."""
    ps = mixed_prompts(llama_f32.vocab_size, 2)[:2]
    alone = [parity.greedy(llama_f32, [p], 24)[0] for p in ps]
    first = llama_f32.add(GenerationRequest(ps[0], 24, ignore_eos=True))
    events = []
    while len([e for e in events if e.seq_id == first]) < 4:
        events += llama_f32.step()
    late = llama_f32.add(GenerationRequest(ps[1], 24, ignore_eos=True))
    while llama_f32.has_work():
        events += llama_f32.step()
    order = [e.seq_id for e in events]
    assert [e.token_id for e in events if e.seq_id == first] == alone[0]
    assert [e.token_id for e in events if e.seq_id == late] == alone[1]
    assert order.index(late) < len(order) - order[::-1].index(first) - 1  # late streamed before first ended


def test_stop_token_and_cancel(llama_f32):
    p = parity.prompts(llama_f32.tokenizer, 1)[0]
    tokens = parity.greedy(llama_f32, [p], 8)[0]
    stop = tokens[3]
    stopped = list(llama_f32.generate([GenerationRequest(p, 8, stop_ids=(stop,), ignore_eos=True)]))
    assert [e.token_id for e in stopped] == tokens[: tokens.index(stop) + 1]
    assert stopped[-1].finish_reason == "stop"
    keep = llama_f32.add(GenerationRequest(p, 8, ignore_eos=True))
    drop = llama_f32.add(GenerationRequest(p, 200, ignore_eos=True))
    events = llama_f32.step()
    llama_f32.cancel(drop)
    while llama_f32.has_work():
        events += llama_f32.step()
    assert [e.token_id for e in events if e.seq_id == keep] == tokens
    assert len([e for e in events if e.seq_id == drop]) < 200


def test_scoring_is_refused_not_faked(llama_f32):
    p = parity.prompts(llama_f32.tokenizer, 1)[0]
    with pytest.raises(NotSupported, match="echo"):
        llama_f32.score([(p[:2], p[2:])])
    with pytest.raises(NotSupported, match="distributions"):
        llama_f32.next_token_logprobs([p])


def test_recipe_with_llama_cpp_is_refused_at_validation():
    from kiln.pipeline.errors import BadInput
    from kiln.pipeline.recipe import load_recipe

    with pytest.raises(BadInput, match="cannot score prompts"):
        load_recipe("recipes/demo.yaml", ["engine.backend=llama_cpp"])
    with pytest.raises(BadInput, match="gguf artifact"):
        load_recipe("recipes/demo.yaml", ["optimize={method: gguf, type: q8_0}"])


def test_close_stops_the_server(tiny_model_dir, tmp_path):
    engine = parity.build(LlamaCppConfig(threads=1, parallel=1), tiny_model_dir, tmp_path / "e")
    process = engine.process
    engine.close()
    assert process.poll() is not None


@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
def test_quantized_gguf_stays_close(tiny_model_dir, tmp_path, torch_engine, kind):
    """An engine built from the gguf method's artifact. q8_0 within the 8-bit tolerances; q4_0
    (4.5 bits on a random model with flat logits) only on the first greedy token of most prompts."""
    Gguf(GgufConfig(type=kind, threads=1)).quantize(tiny_model_dir, tmp_path / "art", None)
    (tmp_path / "art" / "kiln-artifact.json").write_text(f'{{"type": "{kind}"}}')
    engine = parity.build(LlamaCppConfig(threads=1, parallel=4), tmp_path / "art", tmp_path / "engine")
    try:
        assert engine.manifest["build"]["type"] == kind
        ps = parity.prompts(torch_engine.tokenizer)
        got, want = parity.greedy(engine, ps), parity.greedy(torch_engine, ps)
        first = sum(g[0] == w[0] for g, w in zip(got, want, strict=True)) / len(ps)
        if kind == "q8_0":
            assert parity.identical_fraction(got, want) >= parity.INT8["identical"]
            assert first >= parity.INT8["first_token"]
        else:
            assert first >= 0.5
    finally:
        engine.close()

