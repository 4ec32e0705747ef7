"""The TensorRT-LLM backend: serving-config rendering (CPU) and the real server (GPU only).

TensorRT-LLM cannot be installed on kiln's test machines (FIELD.md), so the GPU test skips
unless `tensorrt_llm` is importable; the YAML keys are checked against the names documented in
TensorRT-LLM's `tensorrt_llm/llmapi/llm_args.py` (TorchLlmArgs, KvCacheConfig, CudaGraphConfig,
DecodingBaseConfig and its Eagle3/MTP/NGram/DraftTarget subclasses).
"""

from __future__ import annotations

import importlib.util
import json

import pydantic
import pytest
import yaml

from kiln.engine.base import GenerationRequest
from kiln.engine.cache import build_engine
from kiln.engine.loader import load_engine, read_manifest
from kiln.engine.tensorrt_llm import SERVE_CONFIG, SpeculativeConfig, TensorRTLLMConfig, serve_options
from kiln.core.errors import BadInput

DOCUMENTED = {
    "": {"max_batch_size", "max_num_tokens", "max_seq_len", "tensor_parallel_size", "enable_chunked_prefill",
         "kv_cache_config", "cuda_graph_config", "speculative_config"},
    "kv_cache_config": {"free_gpu_memory_fraction", "dtype"},
    "cuda_graph_config": {"batch_sizes", "max_batch_size", "enable_padding"},
    "speculative_config": {"decoding_type", "max_draft_len", "speculative_model"},
}


def _check_keys(options: dict) -> None:
    assert set(options) <= DOCUMENTED[""]
    for section in ("kv_cache_config", "cuda_graph_config", "speculative_config"):
        if options.get(section) is not None:
            assert set(options[section]) <= DOCUMENTED[section], section


def test_default_config_renders_documented_keys():
    options = serve_options(TensorRTLLMConfig())
    _check_keys(options)
    assert options["kv_cache_config"] == {"free_gpu_memory_fraction": 0.9, "dtype": "auto"}
    assert options["cuda_graph_config"]["batch_sizes"] == [1, 2, 4, 8, 16, 32, 64]
    assert "max_seq_len" not in options


def test_every_knob_renders_documented_keys():
    config = TensorRTLLMConfig(max_batch_size=8, max_num_tokens=4096, max_seq_len=2048, free_gpu_memory_fraction=0.5,
                               kv_cache_dtype="fp8", cuda_graph_batch_sizes=[1, 8, 4], enable_chunked_prefill=True,
                               tensor_parallel_size=2,
                               speculative=SpeculativeConfig(decoding_type="Eagle3", max_draft_len=3,
                                                             speculative_model="/models/eagle3"))
    options = serve_options(config)
    _check_keys(options)
    assert options["cuda_graph_config"] == {"batch_sizes": [1, 4, 8], "enable_padding": True}
    assert options["speculative_config"] == {"decoding_type": "Eagle3", "max_draft_len": 3,
                                             "speculative_model": "/models/eagle3"}
    assert serve_options(TensorRTLLMConfig(cuda_graphs=False))["cuda_graph_config"] is None


def test_config_validation():
    with pytest.raises(pydantic.ValidationError, match="speculative_model"):
        SpeculativeConfig(decoding_type="Eagle3", max_draft_len=3)
    assert SpeculativeConfig(decoding_type="NGram", max_draft_len=4).speculative_model is None
    with pytest.raises(pydantic.ValidationError):
        TensorRTLLMConfig(free_gpu_memory_fraction=1.5)
    with pytest.raises(pydantic.ValidationError):
        TensorRTLLMConfig(kv_cache_dtpye="fp8")


def test_build_writes_the_yaml_and_records_the_quantization(tiny_model_dir, tmp_path):
    ckpt = tmp_path / "fp8"
    ckpt.mkdir()
    (ckpt / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    (ckpt / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "FP8"}}))
    engine_dir = build_engine(TensorRTLLMConfig(max_batch_size=4), ckpt, "sha", tmp_path / "cache")
    manifest = read_manifest(engine_dir)
    assert manifest["build"]["quantization"] == "FP8"
    written = yaml.safe_load((engine_dir / SERVE_CONFIG).read_text())
    assert written == serve_options(TensorRTLLMConfig(max_batch_size=4))


def test_loading_without_tensorrt_llm_is_a_clear_bad_input(tiny_model_dir, tmp_path, monkeypatch):
    engine_dir = build_engine(TensorRTLLMConfig(), tiny_model_dir, "sha", tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path))  # no trtllm-serve here
    with pytest.raises(BadInput, match="trtllm-serve not found"):
        load_engine(engine_dir)


needs_trtllm = pytest.mark.skipif(importlib.util.find_spec("tensorrt_llm") is None,
                                  reason="tensorrt_llm is not installed (it cannot be on kiln's test machines)")


@pytest.mark.gpu
@needs_trtllm
def test_rendered_yaml_is_accepted_by_tensorrt_llm(tiny_model_dir):
    from tensorrt_llm.llmapi.llm_args import TorchLlmArgs  # pydantic, extra="forbid"

    options = serve_options(TensorRTLLMConfig(kv_cache_dtype="fp8", enable_chunked_prefill=True))
    args = TorchLlmArgs(model=str(tiny_model_dir), **options)
    assert args.kv_cache_config.free_gpu_memory_fraction == 0.9 and args.kv_cache_config.dtype == "fp8"
    assert args.cuda_graph_config.batch_sizes == options["cuda_graph_config"]["batch_sizes"]


@pytest.mark.gpu
@needs_trtllm
def test_serves_the_tiny_model_through_trtllm_serve(tiny_model_dir, tmp_path):
    engine_dir = build_engine(TensorRTLLMConfig(max_batch_size=4, free_gpu_memory_fraction=0.2), tiny_model_dir,
                              "sha", tmp_path)
    engine = load_engine(engine_dir)
    try:
        prompt = engine.tokenizer("Hello there").input_ids
        events = list(engine.generate([GenerationRequest(prompt, 8, ignore_eos=True)]))
        assert len(events) == 8 and events[-1].finish_reason == "length"
    finally:
        engine.close()
