"""The torch backend against naive references: decoding, continuous batching, scoring."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.engine.base import GenerationRequest
from kiln.engine.hf_torch import TorchBackend, TorchEngine, TorchEngineConfig, slow_kernel_notice
from kiln.core.errors import BadInput


def _prompts(tok) -> list[list[int]]:
    texts = ["It is a truth universally acknowledged", "The quick brown fox jumps", "Hello", "Kiln serves"]
    return [tok(t).input_ids for t in texts]


def _collect(engine, steps_between: dict[int, list[GenerationRequest]]) -> dict[int, list[int]]:
    """Drive the engine step by step, adding requests at the given step numbers."""
    out: dict[int, list[int]] = {}
    ids: list[int] = []
    step = 0
    while step in steps_between or engine.has_work() or any(k > step for k in steps_between):
        for r in steps_between.get(step, []):
            ids.append(engine.add(r))
        for ev in engine.step():
            out.setdefault(ev.seq_id, []).append(ev.token_id)
        step += 1
    return {i: out[sid] for i, sid in enumerate(ids)}


def test_greedy_matches_full_recompute(torch_engine, naive_greedy):
    for prompt in _prompts(torch_engine.tokenizer):
        got = [e.token_id for e in torch_engine.generate([GenerationRequest(prompt, 12, ignore_eos=True)])]
        assert got == naive_greedy(torch_engine.model, prompt, 12)


def test_request_joining_mid_decode_gets_its_solo_tokens(torch_engine, naive_greedy):
    prompts = _prompts(torch_engine.tokenizer)
    alone = [naive_greedy(torch_engine.model, p, 10) for p in prompts]
    # Different prompt lengths joining at different steps exercise the left-padding merge, and
    # the early finisher (6 tokens) exercises removal from the middle of the batch.
    schedule = {
        0: [GenerationRequest(prompts[0], 10, ignore_eos=True)],
        3: [GenerationRequest(prompts[1], 6, ignore_eos=True), GenerationRequest(prompts[2], 10, ignore_eos=True)],
        5: [GenerationRequest(prompts[3], 10, ignore_eos=True)],
    }
    got = _collect(torch_engine, schedule)
    assert got[0] == alone[0]
    assert got[1] == alone[1][:6]
    assert got[2] == alone[2]
    assert got[3] == alone[3]
    assert not torch_engine.has_work()


def test_score_equals_full_forward(torch_engine, naive_score):
    tok = torch_engine.tokenizer
    cont = lambda text: tok(text, add_special_tokens=False).input_ids  # noqa: E731
    pairs = [(tok("The capital of France is").input_ids, cont(" Paris, of course")),
             (tok("Hello").input_ids, cont(" world")),
             (tok("A much longer context that forces padding in the batch").input_ids, [42])]
    scores = torch_engine.score(pairs)
    for (ctx, cont), s in zip(pairs, scores, strict=True):
        assert s.logprob == pytest.approx(naive_score(torch_engine.model, ctx, cont), abs=1e-4)
        assert len(s.token_logprobs) == len(cont)
        assert sum(s.token_logprobs) == pytest.approx(s.logprob, abs=1e-5)


def test_scoring_passes_keep_padding_small(torch_engine):
    """Once a pass is big enough to keep the matmuls busy it takes no much shorter sequence (each
    padded position costs a full forward); small passes still batch; the token budget caps every pass."""
    seqs = [[1] * n for n in (600, 300, 290, 10, 10, 560)]
    assert torch_engine._batches(seqs) == [[0, 5], [1, 2], [3, 4]]
    short = [[1] * 10] * 500
    groups = torch_engine._batches(short)
    assert sorted(i for g in groups for i in g) == list(range(500))
    assert max(len(g) for g in groups) * 10 <= torch_engine.config.score_batch_tokens < (max(len(g) for g in groups) + 1) * 10


def test_is_greedy_true_exactly_for_the_greedy_continuation(torch_engine, naive_greedy):
    prompt = _prompts(torch_engine.tokenizer)[0]
    greedy = naive_greedy(torch_engine.model, prompt, 4)
    other = greedy[:3] + [(greedy[3] + 1) % len(torch_engine.tokenizer)]
    s_greedy, s_other = torch_engine.score([(prompt, greedy), (prompt, other)])
    assert s_greedy.is_greedy and not s_other.is_greedy
    assert s_greedy.logprob > s_other.logprob


def test_next_token_logprobs_are_full_normalised_distributions(torch_engine, naive_score):
    tok = torch_engine.tokenizer
    seqs = [tok("one two three four").input_ids, tok("five").input_ids]
    rows = torch_engine.next_token_logprobs(seqs)
    for seq, r in zip(seqs, rows, strict=True):
        assert r.dtype == np.float32 and r.shape == (len(seq), len(tok))
        np.testing.assert_allclose(np.exp(r).sum(axis=1), 1.0, rtol=1e-4)
    # Row k predicts token k+1: same number as the scorer gives.
    seq = seqs[0]
    assert float(rows[0][1, seq[2]]) == pytest.approx(naive_score(torch_engine.model, seq[:2], [seq[2]]), abs=1e-4)


def test_sampling_is_reproducible_with_a_seed(torch_engine):
    prompt = _prompts(torch_engine.tokenizer)[1]

    def run(seed):
        r = GenerationRequest(prompt, 16, ignore_eos=True, temperature=1.5, seed=seed)
        return [e.token_id for e in torch_engine.generate([r])]

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_stop_ids_eos_and_length(torch_engine, naive_greedy):
    prompt = _prompts(torch_engine.tokenizer)[0]
    greedy = naive_greedy(torch_engine.model, prompt, 8)
    events = list(torch_engine.generate([GenerationRequest(prompt, 8, stop_ids=(greedy[3],))]))
    cut = greedy.index(greedy[3]) + 1  # stops at the first occurrence, stop token included
    assert [e.token_id for e in events] == greedy[:cut]
    assert events[-1].finish_reason == "stop"
    # EOS treated as a stop unless ignore_eos.
    torch_engine.eos_ids, saved = frozenset({greedy[1]}), torch_engine.eos_ids
    try:
        assert len(list(torch_engine.generate([GenerationRequest(prompt, 8)]))) == greedy.index(greedy[1]) + 1
        events = list(torch_engine.generate([GenerationRequest(prompt, 8, ignore_eos=True)]))
        assert len(events) == 8 and events[-1].finish_reason == "length"
    finally:
        torch_engine.eos_ids = saved


def test_cancel_removes_a_sequence_and_keeps_the_others(torch_engine, naive_greedy):
    prompts = _prompts(torch_engine.tokenizer)
    a = torch_engine.add(GenerationRequest(prompts[0], 8, ignore_eos=True))
    b = torch_engine.add(GenerationRequest(prompts[1], 8, ignore_eos=True))
    got: dict[int, list[int]] = {a: [], b: []}
    for _ in range(3):
        for ev in torch_engine.step():
            got[ev.seq_id].append(ev.token_id)
    torch_engine.cancel(a)
    while torch_engine.has_work():
        for ev in torch_engine.step():
            got[ev.seq_id].append(ev.token_id)
    assert len(got[a]) == 3
    assert got[b] == naive_greedy(torch_engine.model, prompts[1], 8)


def test_bad_requests_are_refused(torch_engine):
    with pytest.raises(BadInput):
        torch_engine.add(GenerationRequest([], 4))
    with pytest.raises(BadInput):
        torch_engine.add(GenerationRequest([1] * torch_engine.max_positions, 4))
    with pytest.raises(BadInput):
        torch_engine.score([([], [1, 2])])


def test_build_refuses_a_checkpoint_without_safetensors(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(BadInput, match="safetensors"):
        TorchBackend(TorchEngineConfig()).build(tmp_path, tmp_path / "out")


def test_loads_a_torchao_int8_checkpoint(tiny_model_dir, tmp_path, torch_engine):
    from kiln.optimize.int8_weight_only import Int8WeightOnly, Int8WeightOnlyConfig

    out = tmp_path / "int8"
    out.mkdir()
    Int8WeightOnly(Int8WeightOnlyConfig()).quantize(tiny_model_dir, out, None)
    engine = TorchEngine(out, TorchEngineConfig(threads=1))
    prompt = _prompts(engine.tokenizer)[0]
    pairs = [(prompt[:3], prompt[3:])]
    # int8 weights move the numbers a little, not a lot.
    assert engine.score(pairs)[0].logprob == pytest.approx(torch_engine.score(pairs)[0].logprob, rel=0.05)
    assert len(list(engine.generate([GenerationRequest(prompt, 4, ignore_eos=True)]))) == 4


def test_slow_cpu_kernels_are_named_at_load():
    def gptq(bits):
        return {"quantization_config": {"quant_method": "gptq", "bits": bits, "group_size": 64}}

    assert "int8_weight_only" in slow_kernel_notice(gptq(8), cuda=False)
    assert slow_kernel_notice(gptq(4), cuda=False) is None  # TorchAtenLinear: a real CPU int4 kernel
    assert slow_kernel_notice(gptq(8), cuda=True) is None
    assert slow_kernel_notice({"model_type": "llama"}, cuda=False) is None


@pytest.mark.slow
def test_loads_a_gptq_checkpoint(tiny_model_dir, tmp_path, torch_engine, caplog):
    from kiln.optimize.base import Calibration
    from kiln.optimize.gptq import GPTQ, GPTQConfig

    tok = torch_engine.tokenizer
    texts = [f"It is a truth universally acknowledged, number {i}, that a single man in possession "
             "of a good fortune must be in want of a wife." for i in range(16)]
    calibration = Calibration([tok(t).input_ids for t in texts], "test", "test")
    out = tmp_path / "gptq"
    out.mkdir()
    GPTQ(GPTQConfig(bits=8)).quantize(tiny_model_dir, out, calibration)
    with caplog.at_level("WARNING", logger="kiln"):
        engine = TorchEngine(out, TorchEngineConfig(threads=1))
    assert "GPTQ 8-bit on CPU runs GPTQModel's generic TorchLinear kernel" in caplog.text
    prompt = _prompts(tok)[0]
    pairs = [(prompt[:3], prompt[3:])]
    assert engine.score(pairs)[0].logprob == pytest.approx(torch_engine.score(pairs)[0].logprob, rel=0.05)
    assert len(list(engine.generate([GenerationRequest(prompt, 4, ignore_eos=True)]))) == 4
