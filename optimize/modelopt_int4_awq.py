"""`int4_awq`: 4-bit weights (W4A16) with AWQ scaling through NVIDIA ModelOpt, for GPUs.

ModelOpt's INT4_AWQ_CFG: weights in int4 blocks of `group_size` along the input dimension,
activations stay 16-bit; AWQ ("awq_lite") searches per-channel scales on the calibration samples
so the salient weights lose less. Exported as the unified Hugging Face checkpoint
(`quant_algo: W4A16_AWQ`) that TensorRT-LLM and vLLM load. Needs CUDA (Ampere or newer;
Ada/Hopper when the KV cache is FP8). See modelopt_common for the run.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from kiln.optimize.architecture import DecoderShapes, checked_shapes
from kiln.optimize.base import QUANTIZERS, Calibration, Quantizer
from kiln.optimize.memory import Component, MethodMemory, quantized_weights, weights
from kiln.optimize.modelopt_common import ModelOptConfig, build_config, quantize_and_export, require_gpu


class Int4AWQConfig(ModelOptConfig):
    method: Literal["int4_awq"] = "int4_awq"
    group_size: Literal[64, 128] = Field(128, description="weights per scale along the input dimension")
    kv_cache_fp8: bool = Field(False, description="also quantize the KV cache to FP8 (needs compute capability 8.9+)")


@QUANTIZERS.register("int4_awq", Int4AWQConfig)
class Int4AWQ(Quantizer):
    needs_calibration = True
    config: Int4AWQConfig

    def check(self, model_config: dict[str, Any]) -> None:
        checked_shapes(model_config, self.config.skip_modules, self.config.group_size)
        if self.config.kv_cache_fp8:
            require_gpu("int4_awq", (8, 9), "with kv_cache_fp8: compute capability 8.9+, Ada or Hopper")
        else:
            require_gpu("int4_awq", (8, 0), "int4 weight kernels need compute capability 8.0+, Ampere or newer")

    def quantize(self, source: Path, out_dir: Path, calibration: Calibration | None) -> dict[str, Any]:
        if calibration is None:
            raise ValueError("int4_awq needs calibration samples for its AWQ search")
        c = self.config
        config = build_config("INT4_AWQ_CFG", c.skip_modules, c.kv_cache_fp8)
        set_block_size(config["quant_cfg"], c.group_size)
        fields = quantize_and_export(Path(source), Path(out_dir), config, calibration, c.dtype)
        return {**fields, "bits": 4, "group_size": c.group_size}

    @staticmethod
    def memory(shapes: DecoderShapes, config: Int4AWQConfig, source_dtype: str) -> MethodMemory:
        cal = config.calibration
        skip = [*config.skip_modules, "lm_head"]
        serve = quantized_weights(shapes, skip, 4, config.group_size, 4, 2)
        work = [weights(shapes, 2, f"{config.dtype} on the GPU"),
                Component("AWQ search inputs of one layer", cal.samples * cal.seq_len * shapes.hidden * 2,
                          f"{cal.samples} samples × {cal.seq_len} tokens × {shapes.hidden} hidden × 2 B"),
                replace(serve, name="exported int4 copy")]
        return MethodMemory(work, serve, serving_dtype="fp8" if config.kv_cache_fp8 else config.dtype,
                            device="cuda:0")


def set_block_size(quant_cfg: Any, group_size: int) -> None:
    """Point the weight quantizer's block along the input dimension (-1) at `group_size`."""
    entries = quant_cfg.items() if isinstance(quant_cfg, dict) else \
        ((e.get("quantizer_name"), e.get("cfg")) for e in quant_cfg)
    for name, cfg in entries:
        if name == "*weight_quantizer" and isinstance(cfg, dict) and "block_sizes" in cfg:
            cfg["block_sizes"][-1] = group_size
            return
    raise RuntimeError("INT4_AWQ_CFG has no '*weight_quantizer' block size: ModelOpt's preset changed")
