"""Export a Hugging Face Llama checkpoint to an OpenVINO IR that openvino-genai can serve.

Why not optimum-intel: every release that exports Llama conflicts with kiln's pins (2.2 pulls
torchvision + a CUDA torch, 1.27 wants transformers 4.57; docs/engines.md). So kiln traces its
own small Llama forward with OpenVINO's PyTorch frontend (`ov.convert_model`) and shapes the
graph the way openvino-genai expects an optimum-intel export to look:

- inputs `input_ids`, `attention_mask`, `position_ids`, `beam_idx`; output `logits` at every
  position (scoring needs them all);
- a stateful KV cache: each past K/V input becomes a ReadValue (initialised with zeros of the
  batch size) followed by Gather(beam_idx), each present K/V output an Assign. That is the exact
  pattern OpenVINO's SDPA-to-PagedAttention pass matches, so `ContinuousBatchingPipeline` can
  run the same IR with paged attention and continuous batching;
- attention is `F.scaled_dot_product_attention` (an SDPA op) over K/V repeated for GQA with the
  unsqueeze-expand-reshape pattern the pass recognises.

Memory: the torch model is loaded in the dtype the checkpoint stores. A bf16/fp16 one is traced
without running its Linear/Embedding layers, and each weight becomes Constant(bf16) -> Convert(f32)
sharing the torch tensor's memory, so the export holds the weights once at 16 bits plus NNCF's
compressed output; the graph still computes in float32 (the int8/int4 IR is the one a float32 load
gives, to the bit). Only `weights: fp32` widens them, for its exact float32 IR.

Only the Llama architecture is traced (RMSNorm, RoPE with the checkpoint's own inv_freq,
GQA, SwiGLU); anything else is refused rather than exported wrong.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kiln.core.errors import BadInput

SUPPORTED = ("llama",)


def load_hf_llama(checkpoint: Path, float32: bool = False):
    """The checkpoint as a LlamaForCausalLM in the dtype it is stored in (`stored_dtype`): a bf16
    checkpoint is held once, at 16 bits, not widened; `float32` widens it (the fp32 option's exact
    float32 IR). BadInput for what the trace cannot handle."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(checkpoint)
    if config.model_type not in SUPPORTED:
        raise BadInput(f"{checkpoint}/config.json: model_type '{config.model_type}' is not supported by "
                       f"this engine backend (supported: {', '.join(SUPPORTED)}). Use the `torch` backend.")
    if getattr(config, "quantization_config", None):
        raise BadInput(f"{checkpoint}: already quantized ({config.quantization_config.get('quant_method')}). "
                       "This backend compresses weights itself: build it from the unquantized baseline "
                       "and pick its `weights` option (int8/int4).")
    dtype = torch.float32 if float32 else stored_dtype(checkpoint)
    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype, use_safetensors=True).eval()


def stored_dtype(checkpoint: Path):
    """torch.bfloat16 or torch.float16 when every floating tensor of the checkpoint's safetensors is
    stored so, else torch.float32: loading in it is exact, and a 16-bit checkpoint is not widened.
    (config.json's dtype is not trusted for this: it names what the model was saved as, not always
    what the files hold.)"""
    import torch
    from safetensors import safe_open

    found = set()
    for shard in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(shard, framework="pt") as f:
            found |= {f.get_slice(name).get_dtype() for name in f.keys()}
    floating = found & {"F64", "F32", "F16", "BF16"}
    sixteen = {"BF16": torch.bfloat16, "F16": torch.float16}
    return sixteen[floating.pop()] if len(floating) == 1 and floating <= sixteen.keys() else torch.float32


def _graph(hf):
    import torch
    import torch.nn.functional as F

    c = hf.config
    heads, kv_heads = c.num_attention_heads, c.num_key_value_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads

    class Graph(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.hf = hf
            self.register_buffer("inv_freq", hf.model.rotary_emb.inv_freq.float().clone())
            self.rope_scale = float(getattr(hf.model.rotary_emb, "attention_scaling", 1.0))

        def forward(self, input_ids, attention_mask, position_ids, *past):
            m = self.hf.model
            x = m.embed_tokens(input_ids)
            freqs = position_ids[..., None].float() * self.inv_freq
            emb = torch.cat([freqs, freqs], -1)
            cos, sin = (emb.cos() * self.rope_scale)[:, None], (emb.sin() * self.rope_scale)[:, None]
            b, q = input_ids.shape
            mask = _additive_mask(attention_mask, q)
            presents = []
            for i, layer in enumerate(m.layers):
                a, h = layer.self_attn, _rms(x, layer.input_layernorm)
                qs = a.q_proj(h).view(b, q, heads, head_dim).transpose(1, 2)
                ks = a.k_proj(h).view(b, q, kv_heads, head_dim).transpose(1, 2)
                vs = a.v_proj(h).view(b, q, kv_heads, head_dim).transpose(1, 2)
                qs, ks = qs * cos + _rotate(qs) * sin, ks * cos + _rotate(ks) * sin
                ks, vs = torch.cat([past[2 * i], ks], 2), torch.cat([past[2 * i + 1], vs], 2)
                presents += [ks, vs]
                o = F.scaled_dot_product_attention(qs, _repeat(ks, heads), _repeat(vs, heads), attn_mask=mask,
                                                   scale=a.scaling)
                x = x + a.o_proj(o.transpose(1, 2).reshape(b, q, heads * head_dim))
                h = _rms(x, layer.post_attention_layernorm)
                x = x + layer.mlp.down_proj(F.silu(layer.mlp.gate_proj(h)) * layer.mlp.up_proj(h))
            return (self.hf.lm_head(_rms(x, m.norm)), *presents)

    return Graph().eval(), kv_heads, head_dim


def _rms(x, norm):
    import torch

    return norm.weight.float() * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon))


def _rotate(x):
    import torch

    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def _repeat(x, heads: int):
    """GQA: [b, kv, n, d] -> [b, heads, n, d]."""
    b, kv, n, d = x.shape
    return x[:, :, None].expand(b, kv, heads // kv, n, d).reshape(b, heads, n, d)


def _additive_mask(attention_mask, q: int):
    """0 where a query may attend (causal, and not padding), the float32 minimum elsewhere: [b, 1, q, kv_len]."""
    import torch

    kv_len = attention_mask.shape[1]
    causal = torch.arange(kv_len)[None, :] <= (torch.arange(q) + (kv_len - q))[:, None]
    allowed = causal[None, None] & attention_mask[:, None, None, :].bool()
    return torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)


def _make_stateful(model, layers: int, kv_heads: int, head_dim: int) -> None:
    """Turn past/present K/V parameters and results into ReadValue/Gather(beam_idx)/Assign."""
    import openvino as ov
    import openvino.opset13 as ops
    from openvino.op.util import Variable, VariableInfo

    kv = [f"{i}.{part}" for i in range(layers) for part in ("key", "value")]
    params = dict(zip(["input_ids", "attention_mask", "position_ids"] + [f"past_key_values.{n}" for n in kv],
                      model.get_parameters(), strict=True))
    results = dict(zip(["logits"] + [f"present.{n}" for n in kv], model.get_results(), strict=True))
    for name, p in params.items():
        p.output(0).get_tensor().set_names({name})
    results["logits"].output(0).get_tensor().set_names({"logits"})
    beam = ops.parameter([-1], ov.Type.i32, name="beam_idx")
    beam.output(0).get_tensor().set_names({"beam_idx"})
    batch = ops.gather(ops.shape_of(params["input_ids"]), ops.constant([0], ov.Type.i64), ops.constant(0, ov.Type.i64))
    for n in kv:
        past, present = params[f"past_key_values.{n}"], results[f"present.{n}"]
        info = VariableInfo()
        info.data_shape, info.data_type = ov.PartialShape([-1, kv_heads, -1, head_dim]), ov.Type.f32
        info.variable_id = f"past_key_values.{n}present.{n}"
        var = Variable(info)
        model.add_variables([var])
        zeros = ops.broadcast(ops.constant(0.0, ov.Type.f32),
                              ops.concat([batch, ops.constant([kv_heads, 0, head_dim], ov.Type.i64)], 0))
        past.output(0).replace(ops.gather(ops.read_value(zeros, var), beam, ops.constant(0, ov.Type.i64)).output(0))
        new_value = present.input_value(0).get_node()
        model.remove_result(present)
        model.remove_parameter(past)
        model.add_sinks([ops.assign(new_value, var)])
    model.add_parameters([beam])
    model.validate_nodes_and_infer_types()


def export(hf, weights: str, group_size: int):
    """The stateful OpenVINO model of `hf`, weights compressed to `weights` (fp32/int8/int4)."""
    return compress(trace(hf), weights, group_size)


def trace(hf):
    """The stateful OpenVINO model of `hf`, its weights in hf's own memory (shared, not copied: OpenVINO's
    constants hold no reference to it, so hf must outlive the model; `tracing` frees it after)."""
    import openvino as ov
    import torch

    graph, kv_heads, head_dim = _graph(hf)
    layers, past_len = hf.config.num_hidden_layers, 3
    example = (torch.tensor([[1, 2, 3, 4]]), torch.ones(1, past_len + 4, dtype=torch.long),
               torch.arange(past_len, past_len + 4)[None],
               *[torch.zeros(1, kv_heads, past_len, head_dim) for _ in range(2 * layers)])
    with torch.no_grad():
        model = ov.convert_model(graph, example_input=example, extension=_sixteen_bit_layers(hf.dtype) or None)
    dims = [[-1, -1]] * 3 + [[-1, kv_heads, -1, head_dim]] * (2 * layers)
    model.reshape({p.output(0): ov.PartialShape(d) for p, d in zip(model.get_parameters(), dims, strict=True)})
    _make_stateful(model, layers, kv_heads, head_dim)
    return model


@contextmanager
def tracing(hf):
    """`with tracing(hf):` the block traces and exports hf; after it, hf's weights and the TorchScript the
    trace compiled are freed, so nothing of the export stays for the run's later stages.

    - The weights: dropping hf is not enough. torch.jit keeps the patched Linear/Embedding forwards of
      `_sixteen_bit_layers`, and with them the modules and their weights (a 1B checkpoint stayed mapped,
      2.5 GiB, after the build returned), so they are moved to the meta device.
    - The TorchScript: torch.jit.trace compiles every traced module into torch's global compilation unit,
      which keeps their types, methods and graphs for the life of the process (70 MiB of C++ allocations
      after the 135M demo model's export; `trace_kwargs={"_compilation_unit": ...}` does not reach the
      submodules). The unit is cleared after the block, as torch's own tests clear it between tests, but
      only where nothing else in the process could use what it held: no script module alive and nothing
      scripted before the block (`_torchscript_unused`). Otherwise it is left as it is.
    """
    import torch

    clear = _torchscript_unused()
    try:
        yield hf
    finally:
        hf.to("meta")
        if clear:
            gc.collect()  # the traced modules, cycles and all, before their types go
            torch._C._jit_clear_class_registry()
            torch.jit._state._clear_class_state()


def _torchscript_unused() -> bool:
    """Whether this process holds no TorchScript a clear of torch's global compilation unit could reach:
    no script module alive, no scripted class or module type cached for reuse."""
    import torch

    if torch.jit._state._script_classes or torch.jit._recursive.concrete_type_store.type_store:
        return False
    script_module = torch.jit.ScriptModule
    return not any(issubclass(type(o), script_module) for o in gc.get_objects())  # type(): no __class__ lookups


def _sixteen_bit_layers(dtype) -> list:
    """For a bf16/fp16 model: its Linear and Embedding layers traced without running them (a placeholder
    output of the right shape) and converted to Constant(16-bit) -> Convert(f32) -> MatMul/Gather, the
    graph optimum-intel exports (OpenVINO's own 16-bit patching does the same): the graph computes in
    float32, the IR and NNCF hold each weight once as stored, and the trace makes no float32 copy of it
    (computing them would widen every weight in turn; glibc kept ~2 GiB of those at 1B). A float32 model
    is traced as it runs: its IR is the exact float32 graph of the parity path."""
    import torch
    from openvino.frontend.pytorch import ModuleExtension

    if dtype == torch.float32:
        return []
    fill = 0.5  # any value: the trace records shapes and ops. evaluate gets the arguments convert passes op
    return [ModuleExtension(torch.nn.Linear, "ov_ext::linear",
                            convert=lambda m, op, x: op(x, m.weight, m.bias),
                            evaluate=lambda m, x, *_: torch.full((*x.shape[:-1], m.out_features), fill)),
            ModuleExtension(torch.nn.Embedding, "ov_ext::embedding",
                            convert=lambda m, op, ids: op(m.weight, ids, m.padding_idx, m.scale_grad_by_freq,
                                                          m.sparse),
                            evaluate=lambda m, _, ids, *__: torch.full((*ids.shape, m.embedding_dim), fill))]


def compress(model, weights: str, group_size: int) -> Any:
    """Weight-only compression by NNCF (the data-free path: no calibration set needed)."""
    if weights == "fp32":
        return model
    import nncf

    if weights == "int8":
        return nncf.compress_weights(model, mode=nncf.CompressWeightsMode.INT8_ASYM)
    # ratio=1.0: every eligible matmul in 4 bits (NNCF keeps embeddings/lm_head in 8 bits).
    return nncf.compress_weights(model, mode=nncf.CompressWeightsMode.INT4_ASYM, group_size=group_size, ratio=1.0)
