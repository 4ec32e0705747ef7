"""`fp8`: FP8 (E4M3) weights and activations through NVIDIA ModelOpt, for Hopper-class GPUs.

Per-tensor FP8 scales for every Linear's weight and input (ModelOpt's FP8_DEFAULT_CFG, "max"
calibration on the calibration samples), optionally an FP8 KV cache, exported as the unified
Hugging Face checkpoint TensorRT-LLM and vLLM load. FP8 tensor cores need compute capability
8.9+ (Ada, Hopper or newer); refused up front elsewhere. See modelopt_common for the run.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from kiln.optimize.architecture import DecoderShapes, checked_shapes
from kiln.optimize.base import QUANTIZERS, Calibration, Quantizer
from kiln.optimize.memory import MethodMemory, quantized_weights, weights
from kiln.optimize.modelopt_common import ModelOptConfig, build_config, quantize_and_export, require_gpu

FP8_CAPABILITY = (8, 9)


class FP8Config(ModelOptConfig):
    method: Literal["fp8"] = "fp8"
    kv_cache_fp8: bool = Field(False, description="also quantize the KV cache to FP8 (halves it vs bf16)")


@QUANTIZERS.register("fp8", FP8Config)
class FP8(Quantizer):
    needs_calibration = True
    config: FP8Config

    def check(self, model_config: dict[str, Any]) -> None:
        checked_shapes(model_config, self.config.skip_modules)
        require_gpu("fp8", FP8_CAPABILITY, "Hopper or newer for FP8: compute capability 8.9+")

    def quantize(self, source: Path, out_dir: Path, calibration: Calibration | None) -> dict[str, Any]:
        if calibration is None:
            raise ValueError("fp8 needs calibration samples for its activation scales")
        c = self.config
        config = build_config("FP8_DEFAULT_CFG", c.skip_modules, c.kv_cache_fp8)
        return quantize_and_export(Path(source), Path(out_dir), config, calibration, c.dtype)

    @staticmethod
    def memory(shapes: DecoderShapes, config: FP8Config, source_dtype: str) -> MethodMemory:
        skip = [*config.skip_modules, "lm_head"]
        serve = quantized_weights(shapes, skip, 8, -1, 0, 2)
        work = [weights(shapes, 2, f"{config.dtype} on the GPU"), replace(serve, name="exported FP8 copy")]
        return MethodMemory(work, serve, serving_dtype="fp8" if config.kv_cache_fp8 else config.dtype,
                            device="cuda:0")
