"""`int8_weight_only`: torchao int8 weight-only quantization through transformers' TorchAoConfig.

Every Linear (except `skip_modules`) gets int8 weights with one scale per output row;
activations stay in the model's dtype, so quality barely moves. No calibration. The checkpoint
is safetensors: torchao tensor subclasses are flattened into plain tensors plus JSON metadata
(no pickle), and `AutoModelForCausalLM.from_pretrained` rebuilds them when torchao is installed.
On CPU the gain is size (about a third of fp32), not much speed (~1.1× measured).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from kiln.optimize.architecture import DecoderShapes, checked_shapes, matches
from kiln.optimize.base import QUANTIZERS, Calibration, Quantizer, QuantizerConfig
from kiln.optimize.checkpoint import (
    bits_per_weight,
    copy_side_files,
    param_count,
    read_config,
    read_header,
    safetensors_files,
    skipped_weights,
)
from kiln.optimize.memory import DTYPE_BYTES, Component, MethodMemory, quantized_weights, runtime, weights

log = logging.getLogger("kiln")


class Int8WeightOnlyConfig(QuantizerConfig):
    method: Literal["int8_weight_only"] = "int8_weight_only"
    skip_modules: list[str] = Field(default_factory=lambda: ["lm_head"],
                                    description="modules kept in high precision (names or suffixes)")


@QUANTIZERS.register("int8_weight_only", Int8WeightOnlyConfig)
class Int8WeightOnly(Quantizer):
    config: Int8WeightOnlyConfig

    def check(self, model_config: dict[str, Any]) -> None:
        checked_shapes(model_config, self.config.skip_modules)

    def ao_config(self) -> Any:
        """The torchao config applied to every quantized Linear (subclasses change only this)."""
        from torchao.quantization import Int8WeightOnlyConfig as AoInt8

        return AoInt8()

    def scheme(self) -> dict[str, Any]:
        return {"bits": 8, "granularity": "per output channel"}

    def quantize(self, source: Path, out_dir: Path, calibration: Calibration | None) -> dict[str, Any]:
        from transformers import AutoModelForCausalLM, TorchAoConfig

        source, out_dir = Path(source), Path(out_dir)
        safetensors_files(source)
        skip = self.config.skip_modules
        # An empty list, not None: None would let transformers add its own default skips (lm_head).
        model = AutoModelForCausalLM.from_pretrained(
            str(source), dtype="auto", trust_remote_code=False,
            quantization_config=TorchAoConfig(self.ao_config(), modules_to_not_convert=list(skip)))
        untied = not matches("lm_head", skip) and untie_and_quantize_lm_head(model, self.ao_config())
        model.save_pretrained(str(out_dir))
        del model
        copy_side_files(source, out_dir)
        quantized = quantized_modules(out_dir)
        shapes = DecoderShapes.from_config(read_config(source))
        left = skipped_weights(out_dir, shapes.module_names(), quantized)
        if left["unquantized_experts"]:
            log.warning("%s quantizes Linear modules only: %d routed-expert tensors (%s, …) stay at source "
                        "precision", self.name, len(left["unquantized_experts"]), left["unquantized_experts"][0])
        import torchao

        return {
            "format": "torchao", **self.scheme(),
            "quantized_modules": len(quantized),
            "skipped_modules": left["skipped_modules"],
            **({"unquantized_experts": left["unquantized_experts"],
                "notice": "routed experts are stacked tensors, not Linear modules: torchao's int8 leaves them "
                          "at source precision"} if left["unquantized_experts"] else {}),
            **({"untied_lm_head": True} if untied else {}),
            "bits_per_weight": round(bits_per_weight(out_dir, param_count(source)), 3),
            "loads_with": f"transformers AutoModelForCausalLM (needs torchao {torchao.__version__})",
        }

    @staticmethod
    def memory(shapes: DecoderShapes, config: Int8WeightOnlyConfig, source_dtype: str) -> MethodMemory:
        size = DTYPE_BYTES[source_dtype]
        # Per output row: a float32 scale and an int8 zero point.
        serve = quantized_weights(shapes, config.skip_modules, 8, -1, 5, size)
        work = [runtime("torch + transformers"), weights(shapes, size, source_dtype),
                Component("int8 copy of the linears", serve.bytes, "built layer by layer while loading"),
                Component("serialized copy while saving", serve.bytes, "safetensors writes from one buffer")]
        return MethodMemory(work, serve, serving_dtype=source_dtype)


def untie_and_quantize_lm_head(model: Any, ao_config: Any) -> bool:
    """Quantize a tied lm_head on its own copy of the embedding; True when that happened.

    A tied checkpoint stores only `embed_tokens.weight`, so transformers never offers lm_head to
    torchao and it would stay in full precision whatever the skip list says. Quantizing it means
    untying: the embedding stays in full precision and lm_head gets its own quantized copy.
    """
    import torch
    from torchao.quantization import quantize_

    if not model.config.tie_word_embeddings:
        return False
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.get_input_embeddings().weight.detach().clone(),
                                              requires_grad=False)
    quantize_(model.lm_head, ao_config)
    return True


def quantized_modules(checkpoint: Path) -> list[str]:
    """Modules whose weight the safetensors metadata records as a torchao Int8Tensor."""
    names = []
    for path in safetensors_files(checkpoint):
        meta = read_header(path).get("__metadata__", {})
        names += [k.removesuffix(".weight") for k, v in meta.items() if '"Int8Tensor"' in v]
    return sorted(names)
