"""The `ctranslate2` backend against the torch reference on the tiny Llama (tolerances: parity.py).

Conversion runs CTranslate2's Transformers converter (~10-60 s on two busy cores), once per
precision per module; the int8 build is marked slow.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from kiln.engine.base import GenerationRequest
from kiln.core.errors import BadInput
from tests.engine import parity

pytest.importorskip("ctranslate2", reason="ctranslate2 is a kiln dependency; install the pinned set")

from kiln.engine.ctranslate2 import CTranslate2Backend, CTranslate2Config  # noqa: E402


@pytest.fixture(scope="module")
def ct2_fp32(tiny_model_dir, tmp_path_factory):
    engine = parity.build(CTranslate2Config(quantization="float32", threads=1), tiny_model_dir,
                          tmp_path_factory.mktemp("ct2-fp32"))
    yield engine
    engine.close()


def test_manifest_records_format_and_size(ct2_fp32):
    build = ct2_fp32.manifest["build"]
    assert build["format"] == "ctranslate2" and build["precision"] == "float32"
    assert build["weight_bytes"] > 1_000_000
    assert ct2_fp32.manifest["versions"]["ctranslate2"]


def test_greedy_matches_torch(ct2_fp32, torch_engine):
    ps = parity.prompts(torch_engine.tokenizer)
    got, want = parity.greedy(ct2_fp32, ps), parity.greedy(torch_engine, ps)
    assert all(len(g) == 16 for g in got)
    assert parity.identical_fraction(got, want) >= parity.FULL["identical"]


def test_scores_and_distributions_match_torch(ct2_fp32, torch_engine):
    ps = parity.prompts(torch_engine.tokenizer)
    pairs = parity.score_pairs(ps)
    assert parity.logprob_deltas(ct2_fp32, torch_engine, pairs).max() < parity.FULL["logprob_atol"]
    assert [s.is_greedy for s in ct2_fp32.score(pairs)] == [s.is_greedy for s in torch_engine.score(pairs)]
    got, want = ct2_fp32.next_token_logprobs(ps[:3]), torch_engine.next_token_logprobs(ps[:3])
    for g, w, p in zip(got, want, ps[:3], strict=True):
        assert g.shape == (len(p), len(torch_engine.tokenizer))
        assert np.abs(g - w).max() < parity.FULL["logprob_atol"]


def test_streamed_logprobs_match_scores(ct2_fp32):
    p = parity.prompts(ct2_fp32.tokenizer, 1)[0]
    events = list(ct2_fp32.generate([GenerationRequest(p, 6, ignore_eos=True)]))
    scored = ct2_fp32.score([(p, [e.token_id for e in events])])[0]
    assert np.allclose([e.logprob for e in events], scored.token_logprobs, atol=1e-3)
    assert scored.is_greedy


def test_prompts_of_mixed_lengths_in_one_cohort_decode_as_alone(ct2_fp32, torch_engine):
    """Issue 18 reported CTranslate2 streaming the rest of each longer prompt of a batch as
    "generated"; issue 39 found when: a one-token prompt in the cohort (nothing to prefill, so
    ctranslate2 4.8.5 reports every longer prompt's forced prefix through the callback and counts
    it in max_length). This keeps a cohort of lengths 1 to 40 as each prompt decodes alone, the way
    the server batches, and as the torch reference decodes it."""
    rng = np.random.default_rng(0)
    vocab = ct2_fp32.vocab_size
    ps = [[1, *map(int, rng.integers(3, vocab, n - 1))] for n in (1, 7, 13, 25, 40, 4, 2)]
    batched = parity.greedy(ct2_fp32, ps, 8)
    assert batched == [parity.greedy(ct2_fp32, [p], 8)[0] for p in ps]
    assert batched == parity.greedy(torch_engine, ps, 8)
    assert not [p for p, out in zip(ps, batched, strict=True) if out[:3] == p[len(ps[0]):len(ps[0]) + 3]]


def test_late_request_waits_for_cohort_then_runs(ct2_fp32):
    """Documented limitation: a newcomer starts when the running cohort ends (no mid-batch join)."""
    ps = parity.prompts(ct2_fp32.tokenizer, 2)
    alone = parity.greedy(ct2_fp32, [ps[1]])[0]
    first = ct2_fp32.add(GenerationRequest(ps[0], 12, ignore_eos=True))
    events = ct2_fp32.step()
    late = ct2_fp32.add(GenerationRequest(ps[1], 16, ignore_eos=True))
    while ct2_fp32.has_work():
        events += ct2_fp32.step()
    assert [e.token_id for e in events if e.seq_id == late] == alone
    first_events = [e for e in events if e.seq_id == first]
    assert len(first_events) == 12 and first_events[-1].finish_reason == "length"


def test_stop_token_and_cancel(ct2_fp32):
    p = parity.prompts(ct2_fp32.tokenizer, 1)[0]
    tokens = parity.greedy(ct2_fp32, [p], 8)[0]
    stop = tokens[3]
    stopped = list(ct2_fp32.generate([GenerationRequest(p, 8, stop_ids=(stop,))]))
    assert [e.token_id for e in stopped] == tokens[: tokens.index(stop) + 1]
    assert stopped[-1].finish_reason == "stop"
    keep = ct2_fp32.add(GenerationRequest(p, 8, ignore_eos=True))
    drop = ct2_fp32.add(GenerationRequest(p, 8, ignore_eos=True))
    events = ct2_fp32.step()
    ct2_fp32.cancel(drop)
    while ct2_fp32.has_work():
        events += ct2_fp32.step()
    assert [e.token_id for e in events if e.seq_id == keep] == tokens
    assert len([e for e in events if e.seq_id == drop]) < 8


def test_refuses_quantized_checkpoint(tiny_model_dir, tmp_path):
    ckpt = tmp_path / "gptq"
    shutil.copytree(tiny_model_dir, ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "gptq"}}))
    with pytest.raises(BadInput, match="already quantized"):
        parity.build(CTranslate2Config(), ckpt, tmp_path / "out")


@pytest.fixture(scope="module")
def tiny_phi3(tiny_model_dir, tmp_path_factory):
    """A 1-layer random Phi-3 with the demo tokenizer: CTranslate2 4.8.5 registers a Phi-3 converter
    that fails on every transformers 5 config (KeyError 'type', its rope_scaling)."""
    import torch
    from transformers import AutoTokenizer, Phi3Config, Phi3ForCausalLM

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    config = Phi3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                        num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=256,
                        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("tiny-phi3")
    Phi3ForCausalLM(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def test_an_architecture_it_cannot_convert_is_refused_naming_a_backend_that_can(tiny_phi3, tmp_path):
    with pytest.raises(BadInput, match="model_type 'phi3'.*KeyError 'type'.*Use the `torch` backend"):
        parity.build(CTranslate2Config(quantization="float32"), tiny_phi3, tmp_path / "out")
    assert CTranslate2Backend.refuses({"model_type": "cohere"}) == "model_type 'cohere' (CohereConfig) has no " \
        "CTranslate2 converter"
    assert CTranslate2Backend.refuses({"model_type": "llama"}) is None


def test_kiln_run_refuses_it_before_any_stage(tiny_phi3, tmp_path):
    """The recipe is refused when the run starts, in the field the user set, never as the converter's KeyError."""
    from tests.pipeline.conftest import fresh_cache, kiln, write_recipe

    recipe = write_recipe(tmp_path / "r.yaml", tiny_phi3, optimize={"method": "none"},
                          engine={"backend": "ctranslate2", "quantization": "float32"})
    cache = fresh_cache(tmp_path / "cache")
    proc = kiln("run", str(recipe), cwd=tmp_path, env={"KILN_CACHE": str(cache)})
    said = " ".join(proc.stderr.split())  # rich wraps long lines
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "engine.backend 'ctranslate2' cannot build model.path's checkpoint: model_type 'phi3'" in said, said
    assert "engine.backend torch" in said and "Traceback" not in said and "KeyError:" not in said, said
    assert not (cache / "stages").exists(), "a stage ran before the up-front checks"


def test_each_arm_of_a_search_is_checked_in_its_own_field():
    from kiln.pipeline.recipe.schema import Recipe
    from kiln.pipeline.stages.inputs import check_backends
    from tests.pipeline.conftest import TINY_RECIPE

    raw = {k: v for k, v in TINY_RECIPE.items() if k not in ("optimize", "engine")}
    arms = [{"name": "torch", "optimize": {"method": "none"}, "engine": {"backend": "torch"}},
            {"name": "ov", "optimize": {"method": "none"}, "engine": {"backend": "openvino", "weights": "fp32"}},
            {"name": "ct2", "optimize": {"method": "none"}, "engine": {"backend": "ctranslate2"}}]
    recipe = Recipe.model_validate({**raw, "model": {"path": "demo"}, "candidates": arms})
    check_backends(recipe, {"model_type": "llama"})
    with pytest.raises(BadInput, match=r"^candidates\.1\.engine\.backend 'openvino' .* model_type 'phi3'.* torch"):
        check_backends(recipe, {"model_type": "phi3"})
    check_backends(recipe.model_copy(update={"candidates": [recipe.candidates[0]]}), {"model_type": "phi3"})
    with pytest.raises(BadInput, match=r"^baseline\.engine\.backend 'ctranslate2' .* KeyError 'type'"):
        check_backends(Recipe.model_validate({**TINY_RECIPE, "optimize": {"method": "none"}, "model": {"path": "demo"},
                                              "baseline": {"engine": {"backend": "ctranslate2"}}}),
                       {"model_type": "phi3"})


@pytest.mark.slow
def test_int8_stays_close(tiny_model_dir, tmp_path, torch_engine, ct2_fp32):
    engine = parity.build(CTranslate2Config(quantization="int8_float32", threads=1), tiny_model_dir, tmp_path / "int8")
    try:
        assert engine.manifest["build"]["weight_bytes"] < 0.5 * ct2_fp32.manifest["build"]["weight_bytes"]
        ps = parity.prompts(torch_engine.tokenizer)
        got, want = parity.greedy(engine, ps), parity.greedy(torch_engine, ps)
        first = sum(g[0] == w[0] for g, w in zip(got, want, strict=True)) / len(ps)
        deltas = parity.logprob_deltas(engine, torch_engine, parity.score_pairs(ps))
        assert parity.identical_fraction(got, want) >= parity.INT8["identical"]
        assert first >= parity.INT8["first_token"]
        assert deltas.mean() < parity.INT8["mean_abs_logprob"]
    finally:
        engine.close()
