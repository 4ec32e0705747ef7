"""Shapes, parameter counts and the memory plan, checked against known models."""

from __future__ import annotations

import pytest

from kiln.optimize.architecture import DecoderShapes, group_size_problem
from kiln.optimize.checkpoint import bits_per_weight, param_count, read_config
from kiln.optimize.gptq import GPTQConfig
from kiln.optimize.memory import plan_memory
from kiln.core.errors import DoesNotFit

SMOLLM2_135M = dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152,
                    tie_word_embeddings=True, dtype="float32")
LLAMA_31_8B = dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                   num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                   tie_word_embeddings=False, dtype="bfloat16")


def test_param_count_matches_published_sizes():
    # SmolLM2-135M: 134,515,008 (the converted demo checkpoint's own count); Llama-3.1-8B: 8,030,261,248.
    assert DecoderShapes.from_config(SMOLLM2_135M).param_count == 134_515_008
    assert DecoderShapes.from_config(LLAMA_31_8B).param_count == 8_030_261_248


def test_param_count_matches_a_real_checkpoint(tiny_llama):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32)
    real = sum(p.numel() for p in model.parameters())
    assert DecoderShapes.from_config(read_config(tiny_llama)).param_count == real == param_count(tiny_llama)
    assert bits_per_weight(tiny_llama, real) == pytest.approx(32.0)


def test_kv_cache_matches_the_worked_example():
    # The seed essay: Llama-3.1-8B's KV cache is ~128 KB per token in 16-bit, ~0.27 GB for 2k tokens.
    shapes = DecoderShapes.from_config(LLAMA_31_8B)
    assert shapes.kv_bytes_per_token(2) == 131_072
    plan = plan_memory(LLAMA_31_8B, None, context=2048, batch=1, available_bytes=1 << 40)
    (serve,) = plan.steps
    assert [c.bytes for c in serve.components] == [8_030_261_248 * 2, 131_072 * 2048]
    assert serve.components[1].bytes / 1e9 == pytest.approx(0.27, abs=0.005)


def test_gptq_plan_numbers():
    cfg = GPTQConfig(group_size=64)
    cfg.calibration.samples, cfg.calibration.seq_len = 64, 256
    plan = plan_memory(SMOLLM2_135M, cfg, context=1024, batch=2, available_bytes=1 << 40)
    quantize, serve = plan.steps
    parts = {c.name: c.bytes for c in quantize.components}
    assert parts["Hessians of one decoder layer"] == (5 * 576**2 + 576**2 + 1536**2) * 4
    assert parts["calibration activations"] == 2 * 64 * 256 * 576 * 4
    assert parts["weights (float32)"] == 134_515_008 * 4
    kv = serve.components[1]
    assert kv.bytes == 2 * 30 * 3 * 64 * 2 * 1024 * 2  # bf16 KV: the dtype GPTQ models serve in
    q_params = 30 * (2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536)
    groups = 30 * sum(out * (inp // 64) for inp, out in
                      [(576, 576), (576, 192), (576, 192), (576, 576), (576, 1536), (576, 1536), (1536, 576)])
    assert serve.components[0].bytes == q_params / 2 + groups * 2.5 + (134_515_008 - q_params) * 2
    assert parts["the quantized copy being packed"] == serve.components[0].bytes
    assert plan.fits()


def test_does_not_fit_is_refused_with_the_table():
    plan = plan_memory(LLAMA_31_8B, None, context=8192, batch=8, available_bytes=16 << 30)
    assert not plan.fits()
    with pytest.raises(DoesNotFit) as e:
        plan.check()
    text = str(e.value)
    assert "needs 22.96 GiB but 16.00 GiB is available on cpu" in text
    assert "KV cache (bfloat16, 8192 tokens × 8)" in text and "8.00 GiB" in text


def test_group_size_rule_names_the_dimension():
    shapes = DecoderShapes.from_config(SMOLLM2_135M)
    assert group_size_problem(shapes, [], 128) == (
        "128 must divide every quantized layer's input dimension; 576 (hidden_size) is not divisible by 128. "
        "Use 64 or 32.")
    assert group_size_problem(shapes, [], 64) is None
    assert group_size_problem(shapes, [], -1) is None


def test_gpt2_shapes_are_read_from_its_own_fields():
    """GPT-2's config has n_embd/n_layer/n_head, a fused c_attn, biases and learned positions:
    the shape reader counts it exactly (GPT-2 small has 124,439,808 parameters)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    assert DecoderShapes.from_config(GPT2Config().to_dict()).param_count == 124_439_808
    tiny = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=1000, n_positions=256)
    shapes = DecoderShapes.from_config(tiny.to_dict())
    assert shapes.param_count == sum(p.numel() for p in GPT2LMHeadModel(tiny).parameters())
    assert shapes.module_names()[0] == "transformer.h.0.attn.c_attn"
    plan = plan_memory(tiny.to_dict(), None, context=512, available_bytes=1 << 34)
    assert plan.steps[-1].components[1].bytes == 2 * 2 * 2 * 32 * 4 * 512  # KV: layers × heads × head dim


def test_gguf_plan_holds_the_largest_tensor_not_the_model():
    """convert_hf_to_gguf.py reads lazily and writes one tensor at a time, and llama-quantize works
    tensor by tensor: the quantize step is kiln's and the converter's libraries plus the largest
    tensor as stored and in float32. An 8B bf16 checkpoint then plans ~3.9 GiB (it planned 60 GiB,
    the model twice in float32, and refused every GGUF candidate at 3B and 8B on a 24 GiB machine)."""
    from kiln.optimize.gguf import GgufConfig
    from kiln.optimize.memory import RUNTIME_BYTES

    plan = plan_memory(LLAMA_31_8B, GgufConfig(type="q8_0"), available_bytes=24 << 30)
    quantize, _ = plan.steps
    largest = 128256 * 4096  # the embedding (and the untied lm_head), bigger than any layer's projection
    # read as stored (bf16), widened to float32, written as stored (the intermediate keeps bf16)
    assert quantize.total == 2 * RUNTIME_BYTES["torch + transformers"] + largest * (2 + 4 + 2)
    assert plan.fits()
    small = plan_memory(SMOLLM2_135M, GgufConfig(type="q4_1"), available_bytes=24 << 30).steps[0]
    assert small.components[-1].bytes == 49152 * 576 * (4 + 4)  # an fp32 checkpoint: 4 B as stored


def test_a_torch_engine_holds_the_checkpoint_at_its_own_dtype_and_the_run_adds_its_steps():
    """A bf16 checkpoint on torch at engine.dtype float32 (the default) holds 4 B a parameter, not the
    2 it is stored in; a run's parity reference loads the checkpoint alone, freed before the engine
    loads (its own step); its quality stages hold the arm alone with its scoring buffers, and its
    benchmark stages both arms' engines (bench/scale.py). Every step is kiln run's own process."""
    from kiln.optimize.gguf import GgufConfig
    from kiln.optimize.memory import RUNTIME_BYTES, SCORE_BATCH_TOKENS, Component
    from kiln.pipeline.stages.memory_plan import with_pipeline_steps

    params, run, evaluating = 8_030_261_248, RUNTIME_BYTES["kiln run"], RUNTIME_BYTES["kiln run, evaluating"]
    assert evaluating > run  # a quality stage starts holding what the engine stages imported
    base = plan_memory(LLAMA_31_8B, None, engine_dtype="float32", available_bytes=1 << 40)
    assert base.steps[0].components[0].bytes == params * 4
    bf16 = plan_memory(LLAMA_31_8B, None, engine_dtype="bfloat16", available_bytes=1 << 40)
    q8 = plan_memory(LLAMA_31_8B, GgufConfig(type="q8_0"), available_bytes=1 << 40)
    kv = Component("KV cache", 1 << 30, "")
    arm = with_pipeline_steps(q8, LLAMA_31_8B, bf16, reference="bfloat16", held=(kv,),
                              scoring=(Component("scorer", 1 << 29, ""),))
    steps = {s.step: s for s in arm.steps}
    gguf = q8.steps[1].components[0].bytes
    assert [s.step for s in arm.steps] == ["quantize", "serve", "reference", "engine", "quality", "benchmark"]
    assert steps["quantize"].total == q8.steps[0].total - RUNTIME_BYTES["torch + transformers"] + run  # kiln's process: a run's
    assert steps["reference"].total == run + params * 2  # as stored: no pages mapped beside a copy
    assert steps["engine"].total == run + gguf + (1 << 30)  # the reference is gone by then; the KV cache it allocates
    assert steps["quality"].total == evaluating + gguf + (1 << 29)  # this arm alone, and what it holds to score
    assert steps["benchmark"].total == evaluating + gguf + (1 << 30) + params * 2  # beside the bf16 baseline
    exact = with_pipeline_steps(bf16, LLAMA_31_8B, None, reference="float32", score_tokens=512, torch_dtype="bfloat16")
    parts = {s.step: s for s in exact.steps}
    assert parts["reference"].total == run + params * 4 + params * 2  # + the pages the reference reads
    assert parts["quality"].total == evaluating + params * 2 + 512 * 128256 * (2 + 4)  # torch's logits, bf16 and float32
    assert "benchmark" not in parts  # the baseline's own line: it has no baseline beside it
    assert with_pipeline_steps(bf16, LLAMA_31_8B, None, reference=None, torch_dtype="bfloat16").steps[-1].total == \
        evaluating + params * 2 + SCORE_BATCH_TOKENS * 128256 * (2 + 4)
    # OpenVINO's build: int8 from the bf16 checkpoint reads it as stored, once, its pages dropped behind, and
    # holds beside the compressed model it writes the trace's and NNCF's working set (400 MiB; a tied
    # embedding in float32 too, which Llama-3.1-8B has not: bench/openvino_export.py);
    # its exact fp32 IR loads it in float32 while the stored pages are mapped (bench/scale.py;
    # tests/engine/test_openvino_export_memory.py)
    ov = plan_memory(LLAMA_31_8B, None, engine_dtype="int8", available_bytes=1 << 40)
    ir = ov.steps[0].components[0].bytes
    for export, held in (("bfloat16", 400 << 20), ("float32", params * (4 + 2))):
        built = {s.step: s for s in with_pipeline_steps(ov, LLAMA_31_8B, bf16, reference="bfloat16", export=export).steps}
        assert built["engine"].total == run + ir + held
    tied = {**LLAMA_31_8B, "tie_word_embeddings": True}  # Llama-3.2-1B and -3B tie theirs: NNCF holds it in float32
    ov_tied = plan_memory(tied, None, engine_dtype="int8", available_bytes=1 << 40)
    built = {s.step: s for s in with_pipeline_steps(ov_tied, tied, None, reference=None, export="bfloat16").steps}
    assert built["engine"].total == run + ov_tied.steps[0].components[0].bytes + 128256 * 4096 * 4 + (400 << 20)
    own = with_pipeline_steps(base, LLAMA_31_8B, None, reference=None)  # torch float32 is its own reference
    assert "reference" not in {s.step for s in own.steps}
    assert {s.step: s.total for s in own.steps}["engine"] == run + params * 4
    assert own.fitting_context() is None  # no KV cache planned (context 0)