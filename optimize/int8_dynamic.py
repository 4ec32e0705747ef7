"""`int8_dynamic`: torchao W8A8-dynamic, int8 weights and int8 activations.

Weights get int8 ahead of time; each Linear's input is quantized to int8 at run time and the
matmul runs in int8. No calibration: activation scales are computed on the fly. `granularity`
sets how many scales there are:

- `per_row` (default): one per weight output row and one per token. On the demo model, even with
  lm_head quantized, perplexity moves by ~4%.
- `per_tensor`: one per weight tensor and one per activation tensor, what torch's
  `quantize_dynamic` does. A few outlier channels then set the scale for all the others; on the
  demo model perplexity about doubles (FIELD.md), the broken candidate the gate must catch.

The checkpoint is safetensors, written and reloaded exactly like `int8_weight_only`'s: the
activation scheme is part of each Int8Tensor's JSON metadata, so a reload quantizes activations
again. Speed on CPU depends on `torch._int_mm`: on a CPU without AVX-512 VNNI it runs a generic
kernel ~20x slower than the fp32 matmul (measured on the 2-core development machine), so this is
a quality/size method there, not a speed one.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from kiln.optimize.base import QUANTIZERS
from kiln.optimize.int8_weight_only import Int8WeightOnly, Int8WeightOnlyConfig


class Int8DynamicConfig(Int8WeightOnlyConfig):
    method: Literal["int8_dynamic"] = "int8_dynamic"  # type: ignore[assignment]
    granularity: Literal["per_row", "per_tensor"] = Field(
        "per_row", description="scales per weight row and per token, or one per tensor for each")


@QUANTIZERS.register("int8_dynamic", Int8DynamicConfig)
class Int8Dynamic(Int8WeightOnly):
    """Loading, untying a tied lm_head, saving and the memory budget are int8_weight_only's."""

    config: Int8DynamicConfig

    def ao_config(self) -> Any:
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig, PerRow, PerTensor

        granularity = PerTensor() if self.config.granularity == "per_tensor" else PerRow()
        return Int8DynamicActivationInt8WeightConfig(granularity=granularity)

    def scheme(self) -> dict[str, Any]:
        if self.config.granularity == "per_tensor":
            return {"bits": 8, "granularity": "one scale per weight tensor",
                    "activations": "int8, symmetric, one scale per tensor computed at run time"}
        return {"bits": 8, "granularity": "weights per output channel",
                "activations": "int8, symmetric, one scale per token computed at run time"}
