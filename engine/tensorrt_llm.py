"""The `tensorrt_llm` backend: TensorRT-LLM's LLM API (PyTorch backend) behind `trtllm-serve`.

The old engine-building path (`trtllm-build`) was removed upstream; today TensorRT-LLM loads a
Hugging Face checkpoint directly (quantized ones from NVIDIA ModelOpt: FP8, INT4-AWQ, NVFP4) and
takes its serving knobs from a YAML file of LLM API arguments. So "building" writes that YAML
(`trtllm-config.yml`) beside the manifest, and loading starts
`trtllm-serve CHECKPOINT --extra_llm_api_options trtllm-config.yml --host 127.0.0.1 --port N`
and talks to it through the `remote` engine.

Written against TensorRT-LLM's documented API (`tensorrt_llm/llmapi/llm_args.py`: KvCacheConfig,
CudaGraphConfig, speculative decoding configs; `tensorrt_llm/commands/serve.py`). TensorRT-LLM
cannot be installed on kiln's CPU or GPU test machines, so only the YAML rendering is tested
there; the serving path is tested only where `tensorrt_llm` is importable.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from kiln.engine.base import BACKENDS, EngineBackend, EngineConfig
from kiln.engine.remote import RemoteEngine, RemoteEngineConfig, free_port, stop_process, wait_healthy
from kiln.core.errors import BadInput
from kiln.core.files import atomic_write_text

SERVE_CONFIG = "trtllm-config.yml"


class SpeculativeConfig(BaseModel):
    """TensorRT-LLM `speculative_config`; `decoding_type` picks the algorithm."""

    model_config = ConfigDict(extra="forbid")
    decoding_type: Literal["Eagle3", "MTP", "NGram", "DraftTarget"]
    max_draft_len: int = Field(ge=1)
    speculative_model: str | None = Field(None, description="draft model folder (Eagle3, DraftTarget)")

    @model_validator(mode="after")
    def _needs_draft(self) -> SpeculativeConfig:
        if self.decoding_type in ("Eagle3", "DraftTarget") and not self.speculative_model:
            raise ValueError(f"{self.decoding_type} needs speculative_model (the draft model folder)")
        return self


class TensorRTLLMConfig(EngineConfig):
    backend: Literal["tensorrt_llm"] = "tensorrt_llm"
    max_batch_size: int = Field(64, ge=1)
    max_num_tokens: int = Field(8192, ge=1, description="tokens per forward step across the batch")
    max_seq_len: int | None = Field(None, ge=1, description="prompt + output; None: from the model")
    free_gpu_memory_fraction: float = Field(0.9, gt=0, le=1, description="of free memory, for KV cache")
    kv_cache_dtype: Literal["auto", "fp8"] = "auto"
    cuda_graphs: bool = True
    cuda_graph_batch_sizes: list[int] | None = Field(None, description="None: powers of 2 up to max_batch_size")
    enable_chunked_prefill: bool = False
    tensor_parallel_size: int = Field(1, ge=1)
    speculative: SpeculativeConfig | None = None
    startup_timeout_s: float = Field(1800, gt=0)


def serve_options(config: TensorRTLLMConfig) -> dict[str, Any]:
    """The LLM API arguments trtllm-serve reads from --extra_llm_api_options (YAML)."""
    options: dict[str, Any] = {
        "max_batch_size": config.max_batch_size,
        "max_num_tokens": config.max_num_tokens,
        "tensor_parallel_size": config.tensor_parallel_size,
        "enable_chunked_prefill": config.enable_chunked_prefill,
        "kv_cache_config": {"free_gpu_memory_fraction": config.free_gpu_memory_fraction,
                            "dtype": config.kv_cache_dtype},
        "cuda_graph_config": None,  # null disables CUDA graphs
    }
    if config.max_seq_len is not None:
        options["max_seq_len"] = config.max_seq_len
    if config.cuda_graphs:
        sizes = config.cuda_graph_batch_sizes or [
            b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024) if b <= config.max_batch_size]
        options["cuda_graph_config"] = {"batch_sizes": sorted(set(sizes)), "enable_padding": True}
    if config.speculative is not None:
        options["speculative_config"] = config.speculative.model_dump(exclude_none=True)
    return options


def quantization(checkpoint: Path) -> str | None:
    """The checkpoint's quantization as ModelOpt/transformers record it (None: unquantized)."""
    hf_quant = checkpoint / "hf_quant_config.json"  # ModelOpt's unified HF export
    if hf_quant.is_file():
        return json.loads(hf_quant.read_text()).get("quantization", {}).get("quant_algo")
    qc = json.loads((checkpoint / "config.json").read_text()).get("quantization_config") or {}
    return qc.get("quant_algo") or qc.get("quant_method")


@BACKENDS.register("tensorrt_llm", TensorRTLLMConfig)
class TensorRTLLMBackend(EngineBackend):
    libraries: ClassVar[tuple[str, ...]] = ("tensorrt_llm", "nvidia-modelopt", "torch")

    def build(self, checkpoint: Path, out_dir: Path) -> dict[str, Any]:
        if not (checkpoint / "config.json").is_file():
            raise BadInput(f"{checkpoint}: no config.json. TensorRT-LLM serves Hugging Face "
                           "checkpoints (ModelOpt exports them quantized).")
        atomic_write_text(Path(out_dir) / SERVE_CONFIG, yaml.safe_dump(serve_options(self.config), sort_keys=True))
        return {"checkpoint": str(checkpoint), "serve_config": SERVE_CONFIG,
                "quantization": quantization(checkpoint)}

    @classmethod
    def open(cls, engine_dir: Path, config: TensorRTLLMConfig, manifest: dict[str, Any]) -> TrtllmServeEngine:
        return TrtllmServeEngine.start(manifest["build"]["checkpoint"], engine_dir / manifest["build"]["serve_config"],
                                       config.startup_timeout_s)


class TrtllmServeEngine(RemoteEngine):
    """A remote engine that owns the trtllm-serve process it talks to."""

    process: subprocess.Popen | None = None

    @classmethod
    def start(cls, checkpoint: str, serve_config: Path, timeout_s: float) -> TrtllmServeEngine:
        exe = shutil.which("trtllm-serve")
        if exe is None:
            raise BadInput("trtllm-serve not found on PATH: TensorRT-LLM is not installed in this "
                           "environment. Install it on the GPU host, or serve the model there and "
                           "point a `remote` engine at it.")
        port = free_port()
        cmd = [exe, checkpoint, "--backend", "pytorch", "--extra_llm_api_options", str(serve_config),
               "--host", "127.0.0.1", "--port", str(port)]
        process = subprocess.Popen(cmd)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(url, timeout_s, process, "trtllm-serve", poll_s=2)
        except BaseException:
            process.terminate()
            process.wait(timeout=60)
            raise
        # trtllm-serve names the model after its MODEL argument and does not accept vLLM's
        # return_tokens_as_token_ids; it returns token_ids on each choice instead.
        remote = RemoteEngineConfig(url=url, model=checkpoint, stream_token_ids=False)
        engine = cls(remote, checkpoint)
        engine.process = process
        return engine

    def close(self) -> None:
        super().close()
        stop_process(self.process, 60)
