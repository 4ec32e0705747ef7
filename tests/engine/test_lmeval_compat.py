"""The key compatibility check: lm-eval's own `local-completions` client, pointed at `kiln serve`,
computes the same log-likelihoods as scoring the engine directly (token-ID prompts, no BOS)."""

from __future__ import annotations

import pytest

from kiln.engine.serve.server_thread import ServerThread

KEY = "lm-eval-key"


@pytest.fixture(scope="module")
def lm(served_engine, tiny_model_dir):
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    with ServerThread(served_engine, api_key=KEY, model_name="tiny") as srv:
        mp = pytest.MonkeyPatch()
        mp.setenv("OPENAI_API_KEY", KEY)  # LocalCompletionsAPI sends it as the Bearer token
        try:
            yield LocalCompletionsAPI(base_url=f"{srv.url}/v1/completions", model="tiny",
                                      tokenizer_backend="huggingface", tokenizer=str(tiny_model_dir),
                                      tokenized_requests=True, batch_size=3, max_length=512)
        finally:
            mp.undo()


def _instances(kind: str, args: list[tuple]):
    from lm_eval.api.instance import Instance

    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


def test_loglikelihood_through_server_equals_direct_scoring(lm, torch_engine):
    pairs = [("It is a truth universally acknowledged", " that a single man"),
             ("The capital of France is", " Paris"),
             ("Hello", " world, how are you today?"),
             ("One two three", " four")]
    got = lm.loglikelihood(_instances("loglikelihood", pairs))
    encoded = [lm._encode_pair(c, x) for c, x in pairs]
    expected = torch_engine.score(encoded)
    for (logprob, greedy), e in zip(got, expected, strict=True):
        assert logprob == pytest.approx(e.logprob, abs=1e-3)
        assert greedy == e.is_greedy


def test_greedy_continuation_is_reported_greedy(lm, torch_engine):
    from kiln.engine.base import GenerationRequest

    context = "The quick brown fox"
    ids = torch_engine.tokenizer(context).input_ids
    tokens = [e.token_id for e in torch_engine.generate([GenerationRequest(ids, 3, ignore_eos=True)])]
    continuation = torch_engine.tokenizer.decode(tokens)
    ctx_enc, cont_enc = lm._encode_pair(context, continuation)
    assert cont_enc == tokens  # the decoded text re-encodes to the same tokens
    (logprob, greedy), = lm.loglikelihood(_instances("loglikelihood", [(context, continuation)]))
    assert greedy is True
    assert logprob == pytest.approx(torch_engine.score([(ctx_enc, cont_enc)])[0].logprob, abs=1e-3)


def test_rolling_loglikelihood_matches_direct_scoring(lm, torch_engine):
    text = "Emma Woodhouse, handsome, clever, and rich, with a comfortable home and happy disposition."
    (got,) = lm.loglikelihood_rolling(_instances("loglikelihood_rolling", [(text,)]))
    ids = lm.tok_encode(text)
    expected = torch_engine.score([([lm.prefix_token_id], ids)])[0].logprob
    assert got == pytest.approx(expected, abs=1e-3)
