"""kiln.optimize: checkpoint + calibration data -> quantized checkpoint + manifest.

The contract is in `base`; each quantization method is one module here and registers itself in
`QUANTIZERS` when imported, which this package does for all of them. Plugin modules import
torch, transformers, gptqmodel, torchao and modelopt inside functions, so importing kiln.optimize
stays instant.
"""

from kiln.optimize import (  # noqa: F401 (registers)
    gguf, gptq, int8_dynamic, int8_weight_only, modelopt_fp8, modelopt_int4_awq, none)
from kiln.optimize.base import MANIFEST, QUANTIZERS, Calibration, ModelArtifact, Quantizer, QuantizerConfig

__all__ = ["MANIFEST", "QUANTIZERS", "Calibration", "ModelArtifact", "Quantizer", "QuantizerConfig"]
