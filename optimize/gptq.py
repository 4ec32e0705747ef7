"""`gptq`: GPTQ weight-only quantization (4 or 8 bit) through GPTQModel, on CPU or GPU.

Calls GPTQModel 7.6 directly: `GPTQModel.load(source, QuantizeConfig(...))`, `quantize(samples)`,
`save(out_dir)`. Not auto-gptq: it is archived, fails to import with transformers 5 and refuses
to quantize without CUDA. Not optimum's or transformers' GPTQ wrappers either: they run GPTQModel
underneath and were 4-9× slower.

The output is a standard GPTQ checkpoint (`quant_method: gptq`, safetensors) that
`AutoModelForCausalLM.from_pretrained` loads when `gptqmodel` and `optimum` are installed; on CPU
4-bit layers use torch's int4 kernel (group sizes 16-128, bf16/fp16 activations). Notes:

- every quantized layer's input dimension must be divisible by `group_size` (checked up front);
- on a 2-core machine GPTQModel needs GPTQMODEL_CPU_WORKERS=2, set here before it is imported;
- the first quantize on a machine compiles a small C++ extension (g++, ninja): ~1-1.5 min once,
  cached under ~/.cache/gptqmodel.
"""

from __future__ import annotations

import os
import re
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator

from kiln.optimize.architecture import DecoderShapes, checked_shapes
from kiln.optimize.base import QUANTIZERS, Calibration, Quantizer, QuantizerConfig
from kiln.optimize.calibration import CalibrationConfig
from kiln.optimize.checkpoint import (
    bits_per_weight,
    copy_side_files,
    linear_names,
    param_count,
    read_config,
    safetensors_files,
)
from kiln.optimize.memory import DTYPE_BYTES, Component, MethodMemory, quantized_weights, runtime, weights
from kiln.core.errors import BadInput
from kiln.core.files import atomic_write_json, read_json


class GPTQConfig(QuantizerConfig):
    method: Literal["gptq"] = "gptq"
    bits: Literal[4, 8] = 4
    group_size: int = Field(128, description="weights per scale along the input dimension; -1: one per channel")
    desc_act: bool = Field(False, description="quantize columns in order of activation size (slower kernels)")
    sym: bool = True
    damp_percent: float = Field(0.05, gt=0, lt=1, description="Hessian dampening, fraction of its mean diagonal")
    skip_modules: list[str] = Field(default_factory=lambda: ["lm_head"],
                                    description="modules kept in high precision: a name or a suffix such as "
                                                "'mlp.down_proj'")
    calibration: CalibrationConfig = CalibrationConfig()

    @field_validator("group_size")
    @classmethod
    def _group_size(cls, v: int) -> int:
        if v != -1 and (v < 16 or v & (v - 1)):
            raise ValueError(f"{v}: use a power of two from 16 (32, 64, 128 are common) or -1 (one group per channel)")
        return v


def set_cpu_workers() -> None:
    """GPTQModel's loader pool wants 2 CPU workers; its default on a 2-core machine is 1 and fails."""
    if "GPTQMODEL_CPU_WORKERS" not in os.environ:
        os.environ["GPTQMODEL_CPU_WORKERS"] = str(min(12, max(2, ((os.cpu_count() or 1) + 1) // 2)))


@QUANTIZERS.register("gptq", GPTQConfig)
class GPTQ(Quantizer):
    needs_calibration = True
    config: GPTQConfig

    def check(self, model_config: dict[str, Any]) -> None:
        c = self.config
        shapes = checked_shapes(model_config, c.skip_modules, c.group_size)
        if "lm_head" not in c.skip_modules and shapes.tied_embeddings:
            raise BadInput("optimize.skip_modules: lm_head shares its weights with embed_tokens "
                           "(tie_word_embeddings), so quantizing it would untie them. Keep 'lm_head' in skip_modules.")

    def quantize(self, source: Path, out_dir: Path, calibration: Calibration | None) -> dict[str, Any]:
        if calibration is None:
            raise ValueError("gptq needs calibration samples")
        source, out_dir = Path(source), Path(out_dir)
        safetensors_files(source)
        set_cpu_workers()
        from gptqmodel import GPTQModel, QuantizeConfig

        c = self.config
        qcfg = QuantizeConfig(
            bits=c.bits, group_size=c.group_size, desc_act=c.desc_act, sym=c.sym, damp_percent=c.damp_percent,
            # GPTQModel's activation-aware grouping is only valid without desc_act.
            act_group_aware=not c.desc_act,
            lm_head="lm_head" not in c.skip_modules,
            dynamic=skip_rules(c.skip_modules),
        )
        model = GPTQModel.load(str(source), qcfg, trust_remote_code=False)
        model.quantize([{"input_ids": s, "attention_mask": [1] * len(s)} for s in calibration.samples], batch_size=1)
        model.save(str(out_dir))
        del model
        quantized = linear_names(out_dir, (".qweight",))
        mark_quantized_modules(out_dir, quantized)
        copy_side_files(source, out_dir)
        shapes = DecoderShapes.from_config(read_config(source))
        return {
            "format": "gptq",
            "bits": c.bits, "group_size": c.group_size, "desc_act": c.desc_act, "sym": c.sym,
            "damp_percent": c.damp_percent,
            "quantized_modules": len(quantized),
            "skipped_modules": [m for m in shapes.module_names() if m not in set(quantized)],
            "bits_per_weight": round(bits_per_weight(out_dir, param_count(source)), 3),
            "dtype": read_config(out_dir).get("dtype"),
            "loads_with": "transformers AutoModelForCausalLM (needs gptqmodel and optimum installed)",
        }

    @staticmethod
    def memory(shapes: DecoderShapes, config: GPTQConfig, source_dtype: str) -> MethodMemory:
        cal = config.calibration
        hessians = sum(lin.in_features ** 2 * 4 for lin in shapes.linears())
        acts = 2 * cal.samples * cal.seq_len * shapes.hidden * 4
        # Per group: an fp16 scale and a packed zero point; g_idx adds 4 B per input channel.
        per_group = 2 + config.bits / 8
        work = [
            runtime("torch + transformers + gptqmodel"),
            weights(shapes, DTYPE_BYTES[source_dtype], source_dtype),
            Component("Hessians of one decoder layer", hessians, "Σ in_features² × 4 B over its 7 linears"),
            Component("calibration activations", acts,
                      f"2 × {cal.samples} samples × {cal.seq_len} tokens × {shapes.hidden} hidden × 4 B"),
        ]
        serve = quantized_weights(shapes, config.skip_modules, config.bits, config.group_size, per_group, 2)
        # The packed copy is built while the source is still held: on the demo model the measured
        # peak exceeded the other parts by its size (bench/quantize_methods.py, docs/optimize.md).
        work.append(replace(serve, name="the quantized copy being packed"))
        return MethodMemory(work, serve, serving_dtype="bfloat16")


def skip_rules(skip: list[str]) -> dict[str, dict] | None:
    """GPTQModel's `dynamic` rules: a "-:" prefix excludes the modules a regex matches.

    lm_head is not a decoder-layer module; GPTQModel controls it with `lm_head=` instead.
    """
    rules = {f"-:^(.*\\.)?{re.escape(name)}$": {} for name in skip if name != "lm_head"}
    return rules or None


def mark_quantized_modules(out_dir: Path, quantized: list[str]) -> None:
    """Tell transformers which modules hold GPTQ weights.

    transformers (through optimum) ignores GPTQModel's `dynamic` skip rules and would build a
    quantized layer with uninitialized weights for every skipped module; its
    `modules_in_block_to_quantize` (matched by name suffix, so full names select exactly) fixes that.
    """
    path = out_dir / "config.json"
    config = read_json(path)
    config["quantization_config"]["modules_in_block_to_quantize"] = [quantized]
    atomic_write_json(path, config)
