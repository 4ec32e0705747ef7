"""The `openvino` backend against the torch reference on the tiny Llama (tolerances: parity.py).

Building an IR traces the model with OpenVINO's PyTorch frontend (~10-30 s on two busy cores),
so each precision is built once per module; the int8/int4 builds are marked slow.
"""

from __future__ import annotations

import json
import tracemalloc

import numpy as np
import pytest

from kiln.engine import full_logits
from kiln.engine.base import GenerationRequest
from kiln.core.errors import BadInput
from tests.engine import parity

pytest.importorskip("openvino_genai", reason="openvino-genai is a kiln dependency; install the pinned set")

from kiln.engine.openvino import OpenVINOConfig  # noqa: E402


@pytest.fixture(scope="module")
def ov_fp32(tiny_model_dir, tmp_path_factory):
    engine = parity.build(OpenVINOConfig(weights="fp32", threads=1), tiny_model_dir, tmp_path_factory.mktemp("ov-fp32"))
    yield engine
    engine.close()


def test_manifest_records_format_and_size(ov_fp32):
    build = ov_fp32.manifest["build"]
    assert build["format"] == "openvino-ir" and build["precision"] == "fp32"
    assert build["weight_bytes"] > 1_000_000  # ~1.3M fp32 parameters
    assert ov_fp32.manifest["versions"]["openvino"]


def test_greedy_matches_torch(ov_fp32, torch_engine):
    ps = parity.prompts(torch_engine.tokenizer)
    got, want = parity.greedy(ov_fp32, ps), parity.greedy(torch_engine, ps)
    assert all(len(g) == 16 for g in got)
    assert parity.identical_fraction(got, want) >= parity.FULL["identical"]


def test_scores_and_distributions_match_torch(ov_fp32, torch_engine):
    ps = parity.prompts(torch_engine.tokenizer)
    pairs = parity.score_pairs(ps)
    assert parity.logprob_deltas(ov_fp32, torch_engine, pairs).max() < parity.FULL["logprob_atol"]
    assert [s.is_greedy for s in ov_fp32.score(pairs)] == [s.is_greedy for s in torch_engine.score(pairs)]
    got, want = ov_fp32.next_token_logprobs(ps[:3]), torch_engine.next_token_logprobs(ps[:3])
    for g, w, p in zip(got, want, ps[:3], strict=True):
        assert g.shape == (len(p), len(torch_engine.tokenizer))
        assert np.abs(g - w).max() < parity.FULL["logprob_atol"]


def test_the_scorer_copies_a_sequence_at_a_time_out_of_its_buffer(ov_fp32, torch_engine):
    """The batch's logits stay in the infer request's own buffer (kept between calls); each sequence is
    copied out as the caller reads it, so the batch is not held a second time beside the buffer (the
    infer request's default: a copy of every output)."""
    ps = parity.prompts(torch_engine.tokenizer)[:3]
    list(ov_fp32._logits(ps))  # compiled, and its first inference's buffers made
    tracemalloc.start()
    try:
        handed = ov_fp32._logits(ps)
        first = next(handed)
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    buffer = ov_fp32._scorer.get_tensor("logits").data
    assert buffer.shape[:2] == (3, max(map(len, ps))) and not np.shares_memory(first, buffer)
    assert first.nbytes <= held < first.nbytes + buffer.nbytes / 2, (held, first.nbytes, buffer.nbytes)
    got = [first, *handed]
    want = torch_engine.next_token_logprobs(ps)
    for g, w in zip(got, want, strict=True):
        assert np.abs(full_logits.log_softmax(g) - w).max() < parity.FULL["logprob_atol"]


def test_scoring_batches_keep_their_logits_within_the_budget(ov_fp32, torch_engine):
    """OpenVINO returns float32 logits at every position of a batch and keeps them in its buffer: a batch
    holds at most full_logits.LOGITS_BUDGET_BYTES of them (the model's vocabulary, not the tokenizer's)."""
    vocab = json.loads((ov_fp32.engine_dir / "config.json").read_text())["vocab_size"]
    assert ov_fp32.vocab == vocab and ov_fp32.score_budget == full_logits.token_budget(4096, vocab) < 4096
    shapes, logits = [], ov_fp32._logits
    ov_fp32._logits = lambda seqs: shapes.append((len(seqs), max(map(len, seqs)))) or logits(seqs)
    try:
        ps = parity.prompts(torch_engine.tokenizer) * 40
        ov_fp32.score(parity.score_pairs(ps))
    finally:
        del ov_fp32._logits
    assert len(shapes) > 1 and all(rows * width <= ov_fp32.score_budget or rows == 1 for rows, width in shapes)


def test_a_lone_sequence_after_batches_is_scored_beside_a_copy_of_itself(ov_fp32, torch_engine):
    """The CPU plugin runs one row with other kernels, which repack the weights a second time (int8 135M:
    +100 MiB to the stage's end): once the scorer has run batches of several rows, a lone sequence is scored
    in a batch of two. A scorer that began with one row already holds those kernels: no copy."""
    ps = parity.prompts(torch_engine.tokenizer)[:3]
    ov_fp32._scorer = None  # a fresh scorer
    first = list(ov_fp32._logits(ps[:1]))
    assert ov_fp32._scorer.get_tensor("logits").data.shape[0] == 1
    list(ov_fp32._logits(ps))
    list(ov_fp32._logits(ps[1:2]))
    assert ov_fp32._scorer.get_tensor("logits").data.shape[0] == 1  # began with one row: never padded
    ov_fp32._scorer = None
    list(ov_fp32._logits(ps))
    lone = list(ov_fp32._logits(ps[:1]))
    assert ov_fp32._scorer.get_tensor("logits").data.shape[0] == 2
    assert len(lone) == 1 and lone[0].shape == first[0].shape
    np.testing.assert_allclose(lone[0], first[0], rtol=0, atol=1e-4)


def test_the_parity_check_scores_with_the_pipeline_handed_back(ov_fp32, torch_engine):
    """The engine stage's parity check generates, then scores: between the two the engine hands back
    its generation pipeline (a compiled model with the weights repacked; 1B int8: the check's peak
    3.75 -> 2.53 GiB, scoring beside it), and the next request makes it again. Not while a request is
    in flight."""
    from kiln.evaluate import parity as smoke

    ps = parity.prompts(torch_engine.tokenizer)[:4]
    answers = smoke.reference_answers(torch_engine, ps)
    figures = smoke.check_answers(ov_fp32, answers, exact=True, label="ov fp32")
    assert figures["defects"] == 0 and figures["max_abs_logprob"] < parity.FULL["logprob_atol"]
    assert ov_fp32._pipeline is None and ov_fp32._scorer is not None  # it scored alone
    seq = ov_fp32.add(GenerationRequest(ps[0], 4, ignore_eos=True))
    ov_fp32.release_generation()
    assert ov_fp32._pipeline is not None  # a request in flight keeps it
    ov_fp32.cancel(seq)
    assert parity.greedy(ov_fp32, ps[:2], 6) == parity.greedy(torch_engine, ps[:2], 6)  # made again, same answers


def test_late_request_joins_running_batch(ov_fp32):
    ps = parity.prompts(ov_fp32.tokenizer, 2)
    alone = parity.greedy(ov_fp32, [ps[1]])[0]
    first = ov_fp32.add(GenerationRequest(ps[0], 12, ignore_eos=True))
    events = ov_fp32.step() + ov_fp32.step()
    late = ov_fp32.add(GenerationRequest(ps[1], 16, ignore_eos=True))
    while ov_fp32.has_work():
        events += ov_fp32.step()
    late_tokens = [e.token_id for e in events if e.seq_id == late]
    assert late_tokens == alone
    first_events = [e for e in events if e.seq_id == first]
    assert len(first_events) == 12 and first_events[-1].finish_reason == "length"
    # the late request produced tokens while the first was still decoding: it joined, not queued
    first_end = first_events[-1].time
    assert any(e.time <= first_end for e in events if e.seq_id == late)


def test_stop_token_and_cancel(ov_fp32):
    p = parity.prompts(ov_fp32.tokenizer, 1)[0]
    tokens = parity.greedy(ov_fp32, [p], 8)[0]
    stop = tokens[3]
    stopped = list(ov_fp32.generate([GenerationRequest(p, 8, stop_ids=(stop,))]))
    assert [e.token_id for e in stopped] == tokens[: tokens.index(stop) + 1]
    assert stopped[-1].finish_reason == "stop"
    keep = ov_fp32.add(GenerationRequest(p, 8, ignore_eos=True))
    drop = ov_fp32.add(GenerationRequest(p, 8, ignore_eos=True))
    events = ov_fp32.step()
    ov_fp32.cancel(drop)
    while ov_fp32.has_work():
        events += ov_fp32.step()
    assert [e.token_id for e in events if e.seq_id == keep] == tokens
    assert len([e for e in events if e.seq_id == drop]) < 8


def test_sampling_is_seeded(ov_fp32):
    p = parity.prompts(ov_fp32.tokenizer, 1)[0]
    runs = [[e.token_id for e in ov_fp32.generate([GenerationRequest(p, 12, ignore_eos=True, temperature=1.5, seed=s)])]
            for s in (7, 7, 8)]
    assert runs[0] == runs[1] and len(runs[0]) == 12


def test_refuses_quantized_and_unsupported_checkpoints(tiny_model_dir, tmp_path):
    import shutil

    from kiln.engine.openvino_export import load_hf_llama

    for change, message in (({"quantization_config": {"quant_method": "gptq"}}, "already quantized"),
                            ({"model_type": "gpt2"}, "not supported")):
        ckpt = tmp_path / message.replace(" ", "-")
        shutil.copytree(tiny_model_dir, ckpt)
        config = json.loads((ckpt / "config.json").read_text())
        (ckpt / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(BadInput, match=message):
            load_hf_llama(ckpt)


@pytest.mark.slow
@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_compressed_weights_stay_close(weights, tiny_model_dir, tmp_path, torch_engine, ov_fp32):
    engine = parity.build(OpenVINOConfig(weights=weights, group_size=32, threads=1), tiny_model_dir, tmp_path / weights)
    try:
        assert engine.manifest["build"]["weight_bytes"] < 0.5 * ov_fp32.manifest["build"]["weight_bytes"]
        ps = parity.prompts(torch_engine.tokenizer)
        got, want = parity.greedy(engine, ps), parity.greedy(torch_engine, ps)
        first = sum(g[0] == w[0] for g, w in zip(got, want, strict=True)) / len(ps)
        deltas = parity.logprob_deltas(engine, torch_engine, parity.score_pairs(ps))
        if weights == "int8":
            assert parity.identical_fraction(got, want) >= parity.INT8["identical"]
            assert first >= parity.INT8["first_token"]
            assert deltas.mean() < parity.INT8["mean_abs_logprob"]
        else:  # 4-bit: only a sanity bound; quality is the evaluate stage's job
            assert deltas.mean() < 1.0
    finally:
        engine.close()


def test_lm_eval_and_the_decode_benchmark_hold_one_compiled_model_at_a_time(ov_fp32, torch_engine):
    """The scorer and the generation pipeline each compile the weights repacked: lm-eval's log-likelihoods hand
    the pipeline back before they score, its generate_until and the decode benchmark hand the scorer back before
    they generate (after token agreement or perplexity scored). The answers are the same either way."""
    from lm_eval.api.instance import Instance

    from kiln.evaluate.decode_bench import interleaved
    from kiln.evaluate.quality.lmeval_adapter import KilnLM

    lm = KilnLM(engine=ov_fp32)
    text = torch_engine.tokenizer.decode(parity.prompts(torch_engine.tokenizer)[0])
    ask = [Instance("generate_until", {}, (text, {"until": ["\n\n"], "max_gen_toks": 4}), 0)]
    score = [Instance("loglikelihood", {}, (text, " the"), 0)]
    ours = lm.loglikelihood(score)
    assert ov_fp32._scorer is not None and ov_fp32._pipeline is None
    said = lm.generate_until(ask)
    assert ov_fp32._pipeline is not None and ov_fp32._scorer is None
    assert lm.loglikelihood(score) == ours and ov_fp32._pipeline is None
    assert lm.generate_until(ask) == said and ov_fp32._scorer is None
    lm.loglikelihood(score)
    interleaved({"candidate": ov_fp32}, parity.prompts(torch_engine.tokenizer)[:1], 2, [1], 1)
    assert ov_fp32._scorer is None and ov_fp32._pipeline is not None


# ----- levers: prefix caching and speculative decoding (docs/engines.md, "OpenVINO levers") ---------------------

def _lever(ov_fp32, **levers):
    """The fp32 tiny engine's folder opened with runtime levers (none changes the build)."""
    from kiln.engine.openvino import OpenVINOEngine

    return OpenVINOEngine(ov_fp32.engine_dir, OpenVINOConfig(weights="fp32", threads=1, **levers))


def _steps_and_tokens(engine, prompts, n=16):
    """Each prompt's greedy tokens, all decoded together, and the pipeline steps they took."""
    ids = [engine.add(GenerationRequest(p, n, ignore_eos=True)) for p in prompts]
    out: dict[int, list[int]] = {i: [] for i in ids}
    steps = 0
    while engine.has_work():
        steps += 1
        for e in engine.step():
            out[e.seq_id].append(e.token_id)
    return steps, [out[i] for i in ids]


def _lever_prompts(tokenizer) -> list[list[int]]:
    """Mixed lengths: one token, the parity prompts, and a long passage repeated (which prompt lookup copies)."""
    passage = tokenizer("the quick brown fox jumps over the lazy dog while kiln serves tokens. " * 6)["input_ids"]
    return [parity.prompts(tokenizer, 1)[0][:1], *parity.prompts(tokenizer, 6), passage]


def test_levers_at_their_defaults_leave_the_config_and_its_keys_unchanged():
    from kiln.engine.cache import engine_key

    plain = OpenVINOConfig()
    spelled = OpenVINOConfig(prefix_caching=False, speculative=None)
    assert "prefix_caching" not in plain.model_dump(mode="json") and "speculative" not in plain.model_dump()
    assert engine_key(plain, "c", {}, None) == engine_key(spelled, "c", {}, None)
    assert engine_key(plain, "c", {}, None) != engine_key(OpenVINOConfig(prefix_caching=True), "c", {}, None)
    on = OpenVINOConfig(speculative={"type": "prompt-lookup", "ngram_n": 2})
    assert on.model_dump()["speculative"]["ngram_n"] == 2 and on.speculative.lengths() == (5, 2)
    assert plain.plain_twin() is None
    assert on.plain_twin() == plain and on.plain_twin().model_dump() == plain.model_dump()


@pytest.mark.parametrize("speculative, message", [
    ({"type": "draft"}, "type draft needs draft_model"),
    ({"type": "draft", "draft_model": "/nonexistent"}, "type draft needs draft_model.*'/nonexistent'"),
    ({"type": "prompt-lookup", "draft_max": 4}, "draft_model and draft_max belong to type draft"),
    ({"type": "draft", "draft_model": "x", "ngram_n": 2}, "ngram_n and ngram_m size prompt-lookup"),
    ({"type": "prompt-lookup", "ngram_m": 0}, "ngram_m"),
    ({"type": "ngram-simple"}, "type"),
])
def test_speculative_refuses_bad_combinations(speculative, message):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=message):
        OpenVINOConfig(speculative=speculative)


def test_a_draft_folder_with_another_tokenizer_or_gone_is_refused(ov_fp32, tiny_model_dir, tmp_path):
    """As the engine loads, and at build before the export: a BadInput naming the field. (A folder without an
    IR is refused as the recipe loads: test_speculative_refuses_bad_combinations.)"""
    from kiln.engine.base import BACKENDS

    other = tmp_path / "other"
    other.mkdir()
    for item in ov_fp32.engine_dir.iterdir():
        (other / item.name).symlink_to(item)
    tokenizer = json.loads((ov_fp32.engine_dir / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    a, b = [t for t in vocab if t.isalpha()][:2]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two tokens' ids swapped: another vocabulary, the merges still valid
    (other / "tokenizer.json").unlink()
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    draft = {"type": "draft", "draft_model": str(other)}
    another = r"engine\.speculative\.draft_model: .* another tokenizer .*vocabularies"
    with pytest.raises(BadInput, match=another):
        _lever(ov_fp32, speculative=draft)
    with pytest.raises(BadInput, match=another):
        BACKENDS.create(OpenVINOConfig(weights="fp32", speculative=draft)).build(tiny_model_dir, tmp_path / "built")
    assert not (tmp_path / "built").exists()  # refused before the export
    gone = OpenVINOConfig(weights="fp32", threads=1, speculative=draft)
    (other / "openvino_model.xml").unlink()
    from kiln.engine.openvino import OpenVINOEngine

    with pytest.raises(BadInput, match=rf"engine\.speculative\.draft_model: {other}/openvino_model.xml not found"):
        OpenVINOEngine(ov_fp32.engine_dir, gone)


def test_prefix_caching_reaches_the_pipeline(ov_fp32):
    """With the scheduler's prefix caching on, a prompt sharing a 300-token prefix with a finished one is
    prefilled from the cached blocks: its first token comes at the first step, where without the cache its
    300 tokens take a step per 32 (max_batched_tokens). The tokens are the same either way."""
    shared = (parity.prompts(ov_fp32.tokenizer, 10)[3] * 60)[:300]
    first_steps, tokens = {}, {}
    for on in (False, True):
        engine = _lever(ov_fp32, prefix_caching=on, max_batched_tokens=32)
        try:
            _steps_and_tokens(engine, [shared + [11, 12]], 2)
            steps, got = [], []
            for tail in ([13], [14, 15]):
                seq = engine.add(GenerationRequest(shared + tail, 4, ignore_eos=True))
                n, out = 0, []
                while not out:
                    n += 1
                    out += [e.token_id for e in engine.step() if e.seq_id == seq]
                while engine.has_work():
                    out += [e.token_id for e in engine.step() if e.seq_id == seq]
                steps.append(n)
                got.append(out)
            first_steps[on], tokens[on] = steps, got
        finally:
            engine.close()
    assert tokens[True] == tokens[False]
    assert min(first_steps[False]) >= len(shared) // 32 and first_steps[True] == [1, 1], first_steps


@pytest.mark.parametrize("speculative", [{"type": "prompt-lookup", "ngram_n": 3, "ngram_m": 4},
                                         {"type": "draft", "draft_max": 4}], ids=["prompt-lookup", "draft"])
def test_speculative_greedy_equals_the_plain_pipeline_batched(ov_fp32, speculative):
    """Greedy tokens with speculation equal the plain pipeline's on prompts of mixed lengths decoded together
    (the batch-parity near-tie rule: a divergence within TIE_TOLERANCE of the plain engine's log-prob gap
    passes), and speculation acted: fewer pipeline steps than tokens (the tiny IR drafting for itself agrees
    with itself; prompt lookup copies the repeated passage)."""
    from kiln.evaluate.parity import TIE_TOLERANCE, divergence

    if speculative["type"] == "draft":
        speculative = {**speculative, "draft_model": str(ov_fp32.engine_dir)}
    prompts = _lever_prompts(ov_fp32.tokenizer)
    plain_steps, want = _steps_and_tokens(ov_fp32, prompts, 24)
    engine = _lever(ov_fp32, speculative=speculative)
    try:
        steps, got = _steps_and_tokens(engine, prompts, 24)
        alone_steps, alone = _steps_and_tokens(engine, prompts[-1:], 24)
        sampled = [e.token_id for e in engine.generate([GenerationRequest(prompts[1], 8, temperature=1.0, seed=3,
                                                                          ignore_eos=True)])]
    finally:
        engine.close()
    for p, w, g in zip(prompts, want, got, strict=True):
        matched, gap = divergence(ov_fp32, p, w, g)
        assert len(g) == 24 and (g == w if gap is None else gap <= TIE_TOLERANCE), (len(p), matched, gap)
    assert alone == want[-1:] and len(sampled) == 8
    assert plain_steps == 24 and alone_steps < 24 / 2, (plain_steps, steps, alone_steps)
