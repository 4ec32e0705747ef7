"""int8_dynamic (torchao W8A8-dynamic) on tiny Llamas: safetensors out, reloads with activation
quantization intact, and a tied lm_head quantized only by untying it."""

from __future__ import annotations

import json

import pytest

from kiln.optimize import QUANTIZERS
from kiln.optimize.checkpoint import read_config, read_header, tensors
from kiln.optimize.int8_dynamic import Int8DynamicConfig
from kiln.optimize.int8_weight_only import Int8WeightOnlyConfig

PROMPT_IDS = [1, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]


def _rel_error(a, b) -> float:
    return float((a - b).norm() / b.norm())


def _quantize(config, source, out):
    quantizer = QUANTIZERS.create(config)
    quantizer.check(read_config(source))
    return quantizer.quantize(source, out, None)


def test_reloads_from_safetensors_with_activations_quantized(tiny_llama, tmp_path, reload):
    out = tmp_path / "w8a8"
    fields = _quantize(Int8DynamicConfig(), tiny_llama, out)
    assert sorted(p.name for p in out.iterdir() if "model" in p.name) == ["model.safetensors"]
    assert fields["quantized_modules"] == 14 and fields["skipped_modules"] == ["lm_head"]
    assert "per token" in fields["activations"] and "untied_lm_head" not in fields
    meta = json.loads(read_header(out / "model.safetensors")["__metadata__"]["model.layers.0.mlp.down_proj.weight"])
    assert meta["_type"] == "Int8Tensor" and meta["_data"]["act_quant_kwargs"]["_type"] == "QuantizeTensorToInt8Kwargs"

    model, new_ids = reload(out)
    assert len(new_ids) == 6
    assert model.model.layers[1].self_attn.o_proj.weight.act_quant_kwargs is not None
    source, _ = reload(tiny_llama)
    dynamic = reload.logits(model, PROMPT_IDS)
    assert _rel_error(dynamic, reload.logits(source, PROMPT_IDS)) < 0.05

    # Same int8 weights as weight-only; the logits differ only because activations are quantized too.
    weight_only_dir = tmp_path / "w8"
    _quantize(Int8WeightOnlyConfig(), tiny_llama, weight_only_dir)
    weight_only, _ = reload(weight_only_dir)
    w8, w8a8 = (m.model.layers[0].mlp.up_proj.weight.qdata for m in (weight_only, model))
    assert (w8 == w8a8).all()
    assert _rel_error(dynamic, reload.logits(weight_only, PROMPT_IDS)) > 1e-4


def test_per_tensor_granularity_has_one_scale_per_tensor(tiny_llama, tmp_path, reload):
    out = tmp_path / "per-tensor"
    fields = _quantize(Int8DynamicConfig(granularity="per_tensor"), tiny_llama, out)
    assert fields["granularity"] == "one scale per weight tensor" and "per tensor" in fields["activations"]
    assert tensors(out)["model.layers.0.mlp.up_proj._weight_scale"]["shape"] in ([1, 1], [1])
    model, new_ids = reload(out)
    assert len(new_ids) == 6
    assert type(model.model.layers[0].mlp.up_proj.weight.act_quant_kwargs.granularity).__name__ == "PerTensor"
    _quantize(Int8DynamicConfig(), tiny_llama, tmp_path / "per-row")
    per_row, _ = reload(tmp_path / "per-row")
    source, _ = reload(tiny_llama)
    expected = reload.logits(source, PROMPT_IDS)
    error = _rel_error(reload.logits(model, PROMPT_IDS), expected)
    # Coarser scales, larger error (measured 0.025 vs 0.015); random weights have no outlier
    # channels, so it stays far from broken here.
    assert 1.3 * _rel_error(reload.logits(per_row, PROMPT_IDS), expected) < error < 0.1


@pytest.mark.parametrize("config", [Int8DynamicConfig(skip_modules=[]), Int8WeightOnlyConfig(skip_modules=[])],
                         ids=["int8_dynamic", "int8_weight_only"])
def test_empty_skip_list_unties_and_quantizes_a_tied_lm_head(config, tiny_model_dir, tmp_path):
    from kiln.engine.base import GenerationRequest
    from kiln.engine.hf_torch import TorchEngine, TorchEngineConfig

    assert read_config(tiny_model_dir)["tie_word_embeddings"]
    out = tmp_path / "all"
    fields = _quantize(config, tiny_model_dir, out)
    assert fields["skipped_modules"] == [] and fields["quantized_modules"] == 15 and fields["untied_lm_head"]
    assert read_config(out)["tie_word_embeddings"] is False
    stored = tensors(out)
    assert stored["model.embed_tokens.weight"]["dtype"] == "F32" and stored["lm_head._weight_qdata"]["dtype"] == "I8"

    engine = TorchEngine(out, TorchEngineConfig(threads=1))  # the way kiln serves it
    lm_head = engine.model.lm_head.weight
    assert type(lm_head).__name__ == "Int8Tensor" and lm_head is not engine.model.model.embed_tokens.weight
    baseline = TorchEngine(tiny_model_dir, TorchEngineConfig(threads=1))
    prompt = baseline.tokenizer("It is a truth universally acknowledged").input_ids
    pairs = [(prompt[:3], prompt[3:])]
    assert engine.score(pairs)[0].logprob == pytest.approx(baseline.score(pairs)[0].logprob, rel=0.05)
    assert len(list(engine.generate([GenerationRequest(prompt, 4, ignore_eos=True)]))) == 4


def test_a_moe_checkpoint_reports_the_experts_it_leaves_unquantized(tmp_path):
    """Mixtral's routed experts are stacked 3-D parameters, not Linear modules: int8 weight-only
    leaves them at source precision, and the manifest says so from the saved tensors instead of
    listing Llama module names that do not exist there."""
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    from kiln.optimize.base import QUANTIZERS

    config = MixtralConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=512)
    torch.manual_seed(0)
    source = tmp_path / "mixtral"
    MixtralForCausalLM(config).save_pretrained(source)
    fields = QUANTIZERS.create(QUANTIZERS.config("int8_weight_only")()).quantize(source, tmp_path / "q", None)
    skipped = fields["skipped_modules"]
    assert fields["quantized_modules"] == 8  # q/k/v/o of two layers
    experts = fields["unquantized_experts"]
    assert len(experts) == 2 * 4 * 3 and all(".experts." in e for e in experts) and "notice" in fields
    assert set(experts) <= set(skipped)
    assert "model.layers.0.block_sparse_moe.gate" in skipped and "lm_head" in skipped  # the router, the kept head
    assert not [m for m in skipped if m.endswith(("gate_proj", "up_proj")) and ".experts." not in m]
