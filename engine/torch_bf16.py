"""bfloat16 checkpoints on a CPU without bfloat16 instructions: their long products in float32.

Where the CPU has no bfloat16 arithmetic (no AVX512-BF16 or AMX: AMD Zen 2 and 3, most Intel
before Sapphire Rapids), torch multiplies bfloat16 matrices in a generic kernel. On an AMD EPYC
(Zen 2, 2 threads) a 4096x4096 product of 256 rows ran at 16 GFLOPS in bfloat16 against ~90 in
float32, and the 1B baseline's engine stage took 202.6 s against 8.8 s on a Xeon with AMX: prefill
and scoring, which multiply many rows at once, are compute-bound there. Decoding a few rows reads
every weight once per step and stays bandwidth-bound, where bfloat16's half-size weights win (a
one-row product 3.0 ms, 10.4 widened).

`widen` makes each bfloat16 `nn.Linear` of a loaded model multiply `WIDE_ROWS` rows or more in
float32: its weight converted `BLOCK_BYTES` at a time (a block stays in cache while its product
runs), its input `ROW_CHUNK` rows at a time, so the transient memory is a few MiB per layer and
never a float32 copy of the model. Fewer rows keep torch's own bfloat16 kernel, bit for bit.

The figures do not change with it: a product of two bfloat16 numbers is exact in float32, and
torch's bfloat16 kernel accumulates in float32 and rounds the output to bfloat16 once, as this does.
Only the order of the summation differs. The weights stay bfloat16, so nothing holds more memory.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

WIDE_ROWS = 16  # from 8 rows up the float32 product was as fast; from 16 faster at every Llama shape
BLOCK_BYTES = 4 << 20  # float32 bytes of weight converted at a time
ROW_CHUNK = 512  # input rows widened at a time: a chunk of 8B's down_proj input is 28 MiB in float32


def lacks_bf16_instructions() -> bool:
    """Whether this CPU multiplies bfloat16 without AVX512-BF16 or AMX, in torch's generic kernel."""
    cpu = torch.cpu
    return not (cpu._is_avx512_bf16_supported() or cpu._is_amx_tile_supported())


class WideLinear(torch.nn.Linear):
    """An `nn.Linear` with bfloat16 weights that multiplies many rows in float32 (see the module)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // max(x.shape[-1], 1)
        if rows < WIDE_ROWS or x.dtype != torch.bfloat16:
            return super().forward(x)
        flat = x.reshape(rows, x.shape[-1])
        out = torch.empty(rows, self.out_features, dtype=x.dtype)
        step = max(1, BLOCK_BYTES // (4 * self.in_features))
        for r in range(0, rows, ROW_CHUNK):
            wide = flat[r:r + ROW_CHUNK].float()
            for s in range(0, self.out_features, step):
                bias = None if self.bias is None else self.bias[s:s + step].float()
                out[r:r + ROW_CHUNK, s:s + step] = F.linear(wide, self.weight[s:s + step].float(), bias)
        return out.reshape(*x.shape[:-1], self.out_features)


def widen(model: torch.nn.Module) -> int:
    """Make every plain bfloat16 `nn.Linear` on the CPU in `model` a `WideLinear`; how many it made.
    Quantized layers (GPTQ's, torchao's tensor subclasses) and other dtypes are left as they are."""
    made = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if (type(module) is torch.nn.Linear and type(weight.data) is torch.Tensor
                and weight.dtype == torch.bfloat16 and weight.device.type == "cpu"):
            module.__class__ = WideLinear
            made += 1
    return made
