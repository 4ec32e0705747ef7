"""KilnLM against lm-eval's own `hf` backend and a plain forward pass of the same checkpoint."""

from __future__ import annotations

import pytest
import torch

from lm_eval.api.instance import Instance
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from kiln.engine.base import GenerationRequest
from kiln.evaluate.quality.lmeval_adapter import KilnLM
from tests.evaluate.quality.lmeval_data import sentence

PAIRS = [
    ("Question: the quick brown fox", " jumps over a lazy dog"),
    ("seven bright stars ", "shine above quiet hills"),  # trailing space moves to the continuation
    ("", "The lazy dog sleeps."),  # empty context: scored after the prefix (BOS) token
    ("x", " y"),
    (sentence(3, 40), " " + sentence(4, 5)),
]


def instances(kind: str, args: list[tuple]) -> list[Instance]:
    return [Instance(kind, {}, a, i) for i, a in enumerate(args)]


@pytest.fixture(scope="module")
def hflm(tiny_model_dir):
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=str(tiny_model_dir), device="cpu", batch_size=4, dtype="float32")


def forward_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log p(ids[t] | ids[:t]) for t >= 1, one unbatched forward pass."""
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def test_loglikelihood_matches_hf_backend_and_a_plain_forward_pass(engine, hflm):
    lm = KilnLM(engine=engine, batch_size=3)
    ours = lm.loglikelihood(instances("loglikelihood", PAIRS))
    theirs = hflm.loglikelihood(instances("loglikelihood", PAIRS))
    for (a, ga), (b, gb) in zip(ours, theirs, strict=True):
        assert a == pytest.approx(b, abs=2e-3)
        assert ga == gb
    for (ctx, cont), (logprob, _) in zip(PAIRS, ours, strict=True):
        ctx_ids, cont_ids = lm.encode_request(ctx, cont)
        direct = forward_logprobs(engine.model, ctx_ids + cont_ids)[-len(cont_ids):].sum()
        assert logprob == pytest.approx(float(direct), abs=2e-3)
        assert engine.score([(ctx_ids, cont_ids)])[0].logprob == pytest.approx(logprob, abs=2e-3)


def test_batched_equals_unbatched(engine):
    args = PAIRS + [(sentence(i, 3 + i), " " + sentence(i + 1, 2 + i % 5)) for i in range(12)]
    one = KilnLM(engine=engine, batch_size=1).loglikelihood(instances("loglikelihood", args))
    many = KilnLM(engine=engine, batch_size=64).loglikelihood(instances("loglikelihood", args))
    assert [g for _, g in one] == [g for _, g in many]
    assert [x for x, _ in one] == pytest.approx([x for x, _ in many], abs=2e-3)


def test_rolling_is_the_sum_over_disjoint_windows(engine, hflm):
    texts = [" ".join(sentence(i) for i in range(k, k + 12)) for k in range(3)] + ["the dog"]
    lm = KilnLM(engine=engine, max_length=32, batch_size=5)
    rolled = lm.loglikelihood_rolling(instances("loglikelihood_rolling", [(t,) for t in texts]))
    for text, total in zip(texts, rolled, strict=True):
        ids = lm.tok_encode(text)
        windows = list(map(make_disjoint_window, get_rolling_token_windows(ids, lm.prefix_token_id, 32, 1)))
        assert len(ids) <= 32 or len(windows) > 1
        by_window = sum(float(forward_logprobs(engine.model, c + t)[-len(t):].sum()) for c, t in windows)
        assert total == pytest.approx(by_window, abs=5e-3)
    hflm._max_length = 32
    try:
        theirs = hflm.loglikelihood_rolling(instances("loglikelihood_rolling", [(t,) for t in texts]))
    finally:
        hflm._max_length = None
    assert rolled == pytest.approx(theirs, abs=5e-3)


def test_rolling_without_windows_is_one_forward_pass(engine):
    text = " ".join(sentence(i) for i in range(6))
    lm = KilnLM(engine=engine)  # max_length: the engine's 1024 positions, more than the text
    ids = lm.tok_encode(text)
    (total,) = lm.loglikelihood_rolling(instances("loglikelihood_rolling", [(text,)]))
    assert total == pytest.approx(float(forward_logprobs(engine.model, [lm.prefix_token_id] + ids).sum()), abs=5e-3)


def test_generate_until_stops_at_the_first_until_string(engine):
    lm = KilnLM(engine=engine)
    prompts = ["the quick brown", "seven bright stars shine", "kiln models serve"]
    free = lm.generate_until(instances("generate_until", [(p, {"max_gen_toks": 24, "until": []}) for p in prompts]))
    assert free == [greedy_text(engine, lm, p, 24) for p in prompts]  # max_gen_toks tokens, no more
    cuts = []
    for text in free:
        stop = text[len(text) // 2: len(text) // 2 + 3]
        assert stop.strip(), f"generation too short to test: {text!r}"
        cuts.append(stop)
    reqs = [(p, {"max_gen_toks": 24, "until": [s, "never-produced"]}) for p, s in zip(prompts, cuts, strict=True)]
    stopped = lm.generate_until(instances("generate_until", reqs))
    for text, stop, got in zip(free, cuts, stopped, strict=True):
        assert got == text.split(stop)[0]
        assert stop not in got
    assert not engine.has_work()  # stopped sequences were cancelled, not left running
    short = lm.generate_until(instances("generate_until", [(prompts[0], {"max_gen_toks": 3, "until": []})]))
    assert short == [greedy_text(engine, lm, prompts[0], 3)]


def greedy_text(engine, lm, prompt: str, n: int) -> str:
    """The engine's own greedy continuation of `prompt`, `n` tokens at most, decoded."""
    request = GenerationRequest(lm.tok_encode(prompt), n)
    return lm.tok_decode([e.token_id for e in engine.generate([request])])


def test_generate_until_matches_hf_greedy(engine, hflm):
    reqs = [("the quick brown", {"max_gen_toks": 12, "until": ["\n\n"], "do_sample": False})]
    ours = KilnLM(engine=engine).generate_until(instances("generate_until", reqs))
    theirs = hflm.generate_until(instances("generate_until", reqs))
    assert ours == theirs


def test_constructor_needs_exactly_one_engine(engine):
    from kiln.core.errors import BadInput

    with pytest.raises(BadInput, match="exactly one"):
        KilnLM()
    with pytest.raises(BadInput, match="exactly one"):
        KilnLM(engine=engine, engine_dir="/nowhere")
