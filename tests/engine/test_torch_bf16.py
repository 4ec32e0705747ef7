"""bfloat16 products of many rows in float32 on CPUs without bfloat16 instructions (engine/torch_bf16.py):
the same numbers as torch's own bfloat16 kernel, the weights kept in bfloat16, and only where asked."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kiln.engine import torch_bf16
from kiln.engine.base import GenerationRequest
from kiln.engine.hf_torch import TorchEngine, TorchEngineConfig
from kiln.engine.torch_bf16 import WIDE_ROWS, WideLinear, widen


def _linear(out_features: int, in_features: int, bias: bool) -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(in_features, out_features, bias=bias).to(torch.bfloat16)


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance between `a` and `b` in bfloat16 steps (units in the last place)."""
    ia, ib = (t.view(torch.int16).to(torch.int32) for t in (a, b))
    ia, ib = (torch.where(i < 0, -(i & 0x7FFF), i) for i in (ia, ib))  # sign-magnitude to a monotone line
    return int((ia - ib).abs().max())


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(WIDE_ROWS,), (3, 37), (2, 5, 24)])
def test_many_rows_give_torchs_bfloat16_numbers(monkeypatch, shape, bias):
    """Blocks of weight and chunks of rows that do not divide the layer: every output element is
    the float32 sum torch's kernel makes, rounded once to bfloat16 (at most a step apart where the
    summation order flips a rounding)."""
    monkeypatch.setattr(torch_bf16, "BLOCK_BYTES", 4 * 96 * 7)  # 7 output rows per block: 43 = 6 blocks + 1
    monkeypatch.setattr(torch_bf16, "ROW_CHUNK", 10)
    layer = _linear(43, 96, bias)
    x = torch.randn(*shape, 96).to(torch.bfloat16)
    native = F.linear(x, layer.weight, layer.bias)
    widen(layer)
    assert type(layer) is WideLinear and layer.weight.dtype == torch.bfloat16
    wide = layer(x)
    assert wide.shape == native.shape and wide.dtype == torch.bfloat16
    assert _ulps(wide, native) <= 1
    exact = F.linear(x.float(), layer.weight.float(), None if layer.bias is None else layer.bias.float())
    assert torch.equal(wide, exact.to(torch.bfloat16)) or _ulps(wide, exact.to(torch.bfloat16)) <= 1


def test_few_rows_keep_torchs_own_kernel(monkeypatch):
    """A decode step's few rows are multiplied in bfloat16 as before; from WIDE_ROWS in float32."""
    layer = _linear(64, 96, bias=True)
    widen(layer)
    seen: list[torch.dtype] = []
    linear = F.linear
    monkeypatch.setattr(F, "linear", lambda x, *a: seen.append(x.dtype) or linear(x, *a))
    x = torch.randn(1, WIDE_ROWS - 1, 96).to(torch.bfloat16)
    assert torch.equal(layer(x), linear(x, layer.weight, layer.bias))
    assert seen == [torch.bfloat16]
    layer(torch.randn(1, WIDE_ROWS, 96).to(torch.bfloat16))
    assert seen[1:] == [torch.float32]


def test_widen_leaves_float32_and_quantized_layers_alone(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from kiln.optimize.int8_weight_only import Int8WeightOnly, Int8WeightOnlyConfig

    fp32 = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert widen(fp32) == 0
    bf16 = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
    plain = sum(type(m) is torch.nn.Linear for m in bf16.modules())
    assert plain == 2 * 7 + 1  # q k v o, gate up down per layer, and the (tied) head
    assert widen(bf16) == plain and not any(type(m) is torch.nn.Linear for m in bf16.modules())
    Int8WeightOnly(Int8WeightOnlyConfig()).quantize(tiny_model_dir, tmp_path, None)
    int8 = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    widened = widen(int8)
    assert widened < plain and not any(type(m) is WideLinear and type(m.weight.data) is not torch.Tensor
                                       for m in int8.modules())


def _engine(tiny_model_dir, monkeypatch, lacks: bool) -> TorchEngine:
    monkeypatch.setattr(torch_bf16, "lacks_bf16_instructions", lambda: lacks)
    return TorchEngine(tiny_model_dir, TorchEngineConfig(dtype="bfloat16", threads=1))


def test_the_engine_widens_only_where_the_cpu_lacks_bfloat16(tiny_model_dir, monkeypatch):
    """A bfloat16 engine answers the same greedy tokens and nearly the same log-probs either way;
    its prompt (over WIDE_ROWS tokens) and scoring pass run widened, its decode steps natively."""
    native = _engine(tiny_model_dir, monkeypatch, lacks=False)
    wide = _engine(tiny_model_dir, monkeypatch, lacks=True)
    assert not any(isinstance(m, WideLinear) for m in native.model.modules())
    assert sum(isinstance(m, WideLinear) for m in wide.model.modules()) == 2 * 7 + 1
    prompt = native.tokenizer("It is a truth universally acknowledged, that a single man in possession "
                              "of a good fortune, must be in want of a wife.").input_ids
    assert len(prompt) > WIDE_ROWS
    asked = [GenerationRequest(prompt, 6, ignore_eos=True)]
    assert [e.token_id for e in wide.generate(asked)] == [e.token_id for e in native.generate(asked)]
    pairs = [(prompt[:10], prompt[10:])]
    got, want = wide.score(pairs)[0].token_logprobs, native.score(pairs)[0].token_logprobs
    assert got == pytest.approx(want, abs=0.05)  # bfloat16 logits, a step apart at most where order flips
