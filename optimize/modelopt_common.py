"""What the two NVIDIA ModelOpt methods (`fp8`, `int4_awq`) share: the GPU check and the run.

ModelOpt (nvidia-modelopt 0.47.0, pinned in constraints.txt and installed with kiln; the core
package: its `[hf]` extra pins transformers < 5.15, which kiln does not need) inserts
fake-quantizers into a Hugging Face model (`mtq.quantize(model, config, forward_loop)`),
calibrates them on the calibration samples, and `export_hf_checkpoint` writes the unified
Hugging Face checkpoint (safetensors + `hf_quant_config.json`, `quant_method: modelopt`) that
TensorRT-LLM and vLLM load. transformers
itself cannot run these checkpoints, so both methods are for GPU serving only and refuse up front
on a machine without CUDA. Calibration (fake quantization) and export are plain PyTorch, so the
same code runs on CPU, which is how kiln's default tests verify it (tests/optimize/test_modelopt.py).

Its config format: `quant_cfg` is an ordered list of `{"quantizer_name": glob, "cfg": {...},
"enable": bool}` entries, later entries overriding earlier ones (older releases used a dict of
glob -> attributes; both are handled).
"""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from kiln.optimize.architecture import DecoderShapes
from kiln.optimize.base import Calibration, QuantizerConfig
from kiln.optimize.calibration import CalibrationConfig
from kiln.optimize.checkpoint import bits_per_weight, copy_side_files, linear_names, param_count, read_config
from kiln.core.errors import BadInput
from kiln.core.files import read_json

MODELOPT_PIN = "nvidia-modelopt==0.47.0"


class ModelOptConfig(QuantizerConfig):
    """The options both ModelOpt methods take (each adds its own)."""

    skip_modules: list[str] = Field(default_factory=list, description="modules kept in high precision, besides "
                                    "ModelOpt's defaults (lm_head, embeddings, routers)")
    dtype: Literal["bfloat16", "float16"] = Field("bfloat16", description="dtype of the unquantized tensors")
    calibration: CalibrationConfig = CalibrationConfig()


def cuda_capability() -> tuple[int, int] | None:
    """(major, minor) of GPU 0, or None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability(0))  # type: ignore[return-value]


def require_gpu(method: str, min_capability: tuple[int, int], why: str) -> None:
    """Refuse before any work when the GPU, or ModelOpt itself, is missing."""
    cap = cuda_capability()
    if cap is None:
        raise BadInput(f"optimize.method: {method} needs an NVIDIA GPU ({why}); this machine has no CUDA "
                       "device. Its checkpoint is for TensorRT-LLM / vLLM on GPUs; on CPU use method gptq "
                       "or int8_weight_only.")
    if cap < min_capability:
        raise BadInput(f"optimize.method: {method} needs compute capability {min_capability[0]}.{min_capability[1]} "
                       f"or newer ({why}); this GPU is {cap[0]}.{cap[1]}. Use method int4_awq or gptq.")
    if importlib.util.find_spec("modelopt") is None:
        raise BadInput(f"optimize.method: {method} needs NVIDIA ModelOpt, which is not installed: "
                       f"pip install {MODELOPT_PIN} (the core package, without the [hf] extra).")


def disable(quant_cfg: Any, patterns: list[str]) -> Any:
    """Append 'keep these in high precision' entries to a ModelOpt quant_cfg (list or dict form)."""
    if isinstance(quant_cfg, dict):
        return {**quant_cfg, **{p: {"enable": False} for p in patterns}}
    return [*quant_cfg, *({"quantizer_name": p, "enable": False} for p in patterns)]


def merge(quant_cfg: Any, extra: Any) -> Any:
    """Append another preset's entries (e.g. the FP8 KV-cache fragment)."""
    if isinstance(quant_cfg, dict):
        return {**quant_cfg, **extra}
    return [*quant_cfg, *extra]


def skip_patterns(skip: list[str]) -> list[str]:
    """Quantizer globs for modules to skip: a module's quantizers are named `<module>.<x>_quantizer`."""
    return [f"*{name}.*" for name in skip]


def build_config(preset: str, skip: list[str], kv_fp8: bool) -> dict[str, Any]:
    import modelopt.torch.quantization as mtq

    cfg = copy.deepcopy(getattr(mtq, preset))
    if kv_fp8:
        cfg["quant_cfg"] = merge(cfg["quant_cfg"], copy.deepcopy(mtq.FP8_KV_CFG["quant_cfg"]))
    cfg["quant_cfg"] = disable(cfg["quant_cfg"], skip_patterns(skip))
    return cfg


def quantize_and_export(source: Path, out_dir: Path, config: dict[str, Any], calibration: Calibration,
                        dtype: str) -> dict[str, Any]:
    """Load on GPU 0, calibrate with `config`, export the unified HF checkpoint; return manifest fields.

    (`check` has refused a machine without CUDA; the CPU fallback here only serves kiln's own
    verification of this code where no GPU is at hand: ModelOpt's fake quantization runs on CPU.)
    """
    import modelopt
    import modelopt.torch.quantization as mtq
    import torch
    from modelopt.torch.export import export_hf_checkpoint
    from transformers import AutoModelForCausalLM

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    model = AutoModelForCausalLM.from_pretrained(str(source), dtype=getattr(torch, dtype),
                                                 trust_remote_code=False).to(device).eval()

    def forward_loop(m: Any) -> None:
        for sample in calibration.samples:
            m(torch.tensor([sample], device=device))

    with torch.no_grad():
        mtq.quantize(model, config, forward_loop=forward_loop)
    with torch.inference_mode():
        export_hf_checkpoint(model, dtype=getattr(torch, dtype), export_dir=str(out_dir))
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    copy_side_files(source, out_dir)
    hf_quant = read_json(out_dir / "hf_quant_config.json")["quantization"]
    quantized = linear_names(out_dir, (".weight_scale",))
    shapes = DecoderShapes.from_config(read_config(source))
    return {
        "format": "modelopt",
        "quant_algo": hf_quant.get("quant_algo"),
        "kv_cache_quant_algo": hf_quant.get("kv_cache_quant_algo"),
        "quantized_modules": len(quantized),
        "skipped_modules": [m for m in shapes.module_names() if m not in set(quantized)],
        "bits_per_weight": round(bits_per_weight(out_dir, param_count(source)), 3),
        "dtype": dtype,
        "loads_with": f"TensorRT-LLM or vLLM (ModelOpt {modelopt.__version__} unified HF checkpoint); "
                      "not transformers",
    }
