"""The ModelOpt GPU methods: refused up front without a suitable GPU; real runs on one (gpu marker).

The gpu tests need `nvidia-modelopt` importable (carried as a wheel to the GPU machine). They
quantize the tiny Llama, export the unified HF checkpoint and check it tensor by tensor.
"""

from __future__ import annotations

import json

import pytest

from kiln.optimize import QUANTIZERS, modelopt_common
from kiln.optimize.checkpoint import read_config, tensors
from kiln.optimize.modelopt_fp8 import FP8Config
from kiln.optimize.modelopt_int4_awq import Int4AWQConfig
from kiln.pipeline.errors import BadInput


def _check(config, model_config):
    QUANTIZERS.create(config).check(model_config)


def test_refused_without_cuda(tiny_llama, monkeypatch):
    monkeypatch.setattr(modelopt_common, "cuda_capability", lambda: None)
    with pytest.raises(BadInput, match=r"^optimize.method: fp8 needs an NVIDIA GPU \(Hopper or newer for FP8"):
        _check(FP8Config(), read_config(tiny_llama))
    with pytest.raises(BadInput, match=r"^optimize.method: int4_awq needs an NVIDIA GPU"):
        _check(Int4AWQConfig(), read_config(tiny_llama))


def test_real_probe_matches_torch(tiny_llama):
    import torch

    if torch.cuda.is_available():
        assert modelopt_common.cuda_capability() == torch.cuda.get_device_capability(0)
    else:
        assert modelopt_common.cuda_capability() is None
        with pytest.raises(BadInput, match="no CUDA device"):
            _check(FP8Config(), read_config(tiny_llama))


def test_fp8_refused_on_a_gpu_older_than_ada(tiny_llama, monkeypatch):
    monkeypatch.setattr(modelopt_common, "cuda_capability", lambda: (8, 0))
    with pytest.raises(BadInput, match=r"compute capability 8.9 or newer .*this GPU is 8.0"):
        _check(FP8Config(), read_config(tiny_llama))
    with pytest.raises(BadInput, match="this GPU is 8.0"):
        _check(Int4AWQConfig(kv_cache_fp8=True), read_config(tiny_llama))


def test_missing_modelopt_is_named(tiny_llama, monkeypatch):
    monkeypatch.setattr(modelopt_common, "cuda_capability", lambda: (9, 0))
    monkeypatch.setattr(modelopt_common.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(BadInput, match=r"pip install nvidia-modelopt==0.47.0"):
        _check(FP8Config(), read_config(tiny_llama))


def test_int4_awq_group_size_rule(tiny_llama):
    config = dict(read_config(tiny_llama), hidden_size=576, intermediate_size=1536, head_dim=64, num_attention_heads=9)
    with pytest.raises(BadInput, match=r"^optimize.group_size: 128 must divide .* 576 \(hidden_size\)"):
        _check(Int4AWQConfig(group_size=128), config)


def test_config_entries_append_to_both_forms():
    listed = modelopt_common.disable([{"quantizer_name": "*", "enable": False}], ["*mlp.down_proj.*"])
    assert listed[-1] == {"quantizer_name": "*mlp.down_proj.*", "enable": False}
    as_dict = modelopt_common.disable({"*": {"enable": False}}, ["*x.*"])
    assert as_dict == {"*": {"enable": False}, "*x.*": {"enable": False}}


@pytest.mark.gpu
def test_fp8_on_gpu(tiny_llama, tiny_calibration, tmp_path):
    from safetensors import safe_open

    out = tmp_path / "fp8"
    quantizer = QUANTIZERS.create(FP8Config(kv_cache_fp8=True, skip_modules=["model.layers.1.mlp.down_proj"]))
    quantizer.check(read_config(tiny_llama))
    fields = quantizer.quantize(tiny_llama, out, tiny_calibration)
    assert fields["quant_algo"] == "FP8" and fields["kv_cache_quant_algo"] == "FP8"
    assert fields["quantized_modules"] == 13
    assert "model.layers.1.mlp.down_proj" in fields["skipped_modules"] and "lm_head" in fields["skipped_modules"]
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "modelopt"
    stored = tensors(out)
    assert stored["model.layers.0.self_attn.q_proj.weight"]["dtype"] == "F8_E4M3"
    assert stored["model.layers.1.mlp.down_proj.weight"]["dtype"] == "BF16"
    assert (out / "tokenizer.json").is_file()
    # Dequantized FP8 weights stay close to the source (E4M3 keeps ~2 significant digits).
    with safe_open(out / "model.safetensors", "pt") as q, safe_open(tiny_llama / "model.safetensors", "pt") as s:
        name = "model.layers.0.mlp.up_proj.weight"
        w = q.get_tensor(name).float() * q.get_tensor(name + "_scale")
        ref = s.get_tensor(name).float()
    assert float((w - ref).norm() / ref.norm()) < 0.08


@pytest.mark.gpu
def test_int4_awq_on_gpu(tiny_llama, tiny_calibration, tmp_path):
    out = tmp_path / "awq"
    quantizer = QUANTIZERS.create(Int4AWQConfig(group_size=64))
    quantizer.check(read_config(tiny_llama))
    fields = quantizer.quantize(tiny_llama, out, tiny_calibration)
    assert fields["quant_algo"] == "W4A16_AWQ" and fields["quantized_modules"] == 14
    stored = tensors(out)
    q = stored["model.layers.0.mlp.down_proj.weight"]
    assert q["dtype"] == "U8" and q["shape"] == [128 // 2, 256]  # two int4 values per byte, packed along out
    assert stored["model.layers.0.mlp.down_proj.weight_scale"]["shape"] == [128, 256 // 64]
    assert 4 < fields["bits_per_weight"] < 10
