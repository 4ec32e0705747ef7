"""The OpenVINO export of a 16-bit checkpoint holds its weights once, as stored (issue 35), and
builds the same IR a float32 load of that checkpoint builds.

A bf16 copy of the tiny Llama (norms made non-trivial, so a norm weight that went missing would
show) is exported twice: as kiln loads it now (bf16, traced to Constant(bf16) -> Convert(f32)) and
loaded as float32 (the export before issue 35). The compressed weights must be the same bytes and
the logits the same to float32 rounding; the 16-bit trace must not hold a float32 copy.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter

import numpy as np
import pytest

pytest.importorskip("openvino", reason="openvino is a kiln dependency; install the pinned set")

WEIGHT_BYTES = 4096  # constants larger than this are weights (the tiny model's smallest is a 128-wide norm)


@pytest.fixture(scope="module")
def bf16_dir(tiny_model_dir, tmp_path_factory):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    out = tmp_path_factory.mktemp("tiny-bf16")
    model.to(torch.bfloat16).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def models(bf16_dir):
    """(as kiln loads it, as float32): the same checkpoint."""
    from kiln.engine.openvino_export import load_hf_llama

    return load_hf_llama(bf16_dir), load_hf_llama(bf16_dir, float32=True)


def _weights(model) -> list:
    return [op for op in model.get_ops() if op.get_type_name() == "Constant" and op.get_byte_size() > WEIGHT_BYTES]


def _compressed(model) -> Counter:
    """The IR's weight constants by (type, shape, sha1 of the bytes): names and the graph around them may differ."""
    return Counter((str(op.get_element_type()), tuple(op.get_output_shape(0)),
                    hashlib.sha1(op.get_data().view(np.uint8).tobytes()).hexdigest()) for op in _weights(model))


def _logits(model) -> np.ndarray:
    import openvino as ov

    ids = np.random.default_rng(0).integers(3, 1000, (3, 12), dtype=np.int64)
    request = ov.Core().compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"}).create_infer_request()
    return request.infer({"input_ids": ids, "attention_mask": np.ones_like(ids),
                          "position_ids": np.broadcast_to(np.arange(ids.shape[1]), ids.shape).copy(),
                          "beam_idx": np.arange(len(ids), dtype=np.int32)})["logits"].copy()


def test_loads_the_dtype_the_files_store(bf16_dir, tiny_model_dir):
    import torch

    from kiln.engine.openvino_export import load_hf_llama, stored_dtype

    assert stored_dtype(bf16_dir) == torch.bfloat16 and stored_dtype(tiny_model_dir) == torch.float32
    assert load_hf_llama(bf16_dir).dtype == torch.bfloat16
    assert load_hf_llama(bf16_dir, float32=True).dtype == torch.float32


def test_trace_holds_the_bf16_weights_once_shared_with_torch(models):
    from kiln.engine.openvino_export import trace

    hf = models[0]
    weights = _weights(trace(hf))
    assert {str(op.get_element_type()) for op in weights} == {"<Type: 'bfloat16'>"}
    # each weight once (the tied embedding/lm_head too), no float32 copy beside it...
    params = {p.data_ptr(): p for p in hf.parameters() if p.numel() * 2 > WEIGHT_BYTES}
    assert sum(op.get_byte_size() for op in weights) == sum(p.numel() * 2 for p in params.values())
    # ...and in the torch tensors' own memory, not a copy of them
    assert {op.data.ctypes.data for op in weights} == set(params)


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_compressed_ir_is_the_float32_loads(weights, models):
    from kiln.engine.openvino_export import export

    got, want = export(models[0], weights, 32), export(models[1], weights, 32)
    assert _compressed(got) == _compressed(want)
    kinds = {t for t, _, _ in _compressed(got)}
    assert "<Type: 'uint8_t'>" in kinds and (weights == "int8" or "<Type: 'uint4_t'>" in kinds)
    np.testing.assert_allclose(_logits(got), _logits(want), rtol=0, atol=1e-5)


def test_fp32_option_builds_the_exact_float32_ir(models, bf16_dir, tmp_path):
    import openvino as ov

    from kiln.engine.base import BACKENDS
    from kiln.engine.openvino import IR, OpenVINOConfig
    from kiln.engine.openvino_export import export

    fields = BACKENDS.create(OpenVINOConfig(weights="fp32")).build(bf16_dir, tmp_path)
    built = ov.Core().read_model(tmp_path / IR)
    assert {str(op.get_element_type()) for op in _weights(built)} == {"<Type: 'float32'>"}
    assert np.array_equal(_logits(built), _logits(export(models[1], "fp32", 32)))
    assert fields["max_positions"] == json.loads((bf16_dir / "config.json").read_text())["max_position_embeddings"]


def test_build_leaves_no_torch_weights_behind(bf16_dir, tmp_path):
    """torch.jit keeps the traced Linear layers for good: the build must free their weights itself."""
    import gc

    import torch

    from kiln.engine.base import BACKENDS
    from kiln.engine.openvino import OpenVINOConfig

    def linears() -> list:
        return [o for o in gc.get_objects() if isinstance(o, torch.nn.Linear)]

    gc.collect()
    before = {id(o) for o in linears()}
    BACKENDS.create(OpenVINOConfig(weights="int8")).build(bf16_dir, tmp_path)
    gc.collect()
    assert [o for o in linears() if id(o) not in before and o.weight.device.type != "meta"] == []


def test_the_checkpoint_torch_maps_is_dropped_behind_only_while_unwritten(bf16_dir):
    """torch maps a safetensors checkpoint copy-on-write (rw-p): `release` leaves such a mapping alone
    unless `unwritten` lists it, and `unwritten` lists it only while no page was written. Dropped, the
    weights read back the same; written, the mapping keeps its own pages."""
    import torch

    from kiln.engine.mapped_pages import release, resident, unwritten
    from kiln.engine.openvino_export import load_hf_llama

    [shard] = sorted(bf16_dir.glob("*.safetensors"))
    hf = load_hf_llama(bf16_dir)
    weights = {k: v.clone() for k, v in hf.state_dict().items()}
    assert resident(shard) > 0  # torch mapped it: no copy
    release(shard)
    assert resident(shard) > 0  # a writable mapping is not dropped by default
    clean = unwritten(shard)
    assert clean
    release(shard, unwritten=clean)
    assert resident(shard) == 0
    assert all(torch.equal(v, weights[k]) for k, v in hf.state_dict().items())  # read back from the file
    with torch.no_grad():
        hf.model.norm.weight.mul_(2)  # a page of its mapping is now the process's own
    assert len(unwritten(shard)) == len(clean) - 1  # that mapping (transformers maps the file more than once)
    release(shard, unwritten=unwritten(shard))
    assert torch.equal(hf.model.norm.weight, weights["model.norm.weight"] * 2)


def test_the_build_drops_the_checkpoint_behind_and_writes_the_same_ir(bf16_dir, tmp_path, monkeypatch):
    """OpenVINO's build reads the checkpoint's mapped weights once as it traces and compresses them, under
    drop_behind (1B int8: peak 4.15 -> 3.39 GiB, 3B 9.76 -> 4.81 above a run's imports, the same IR): the
    IR is the one built without it, and the mapping is released during the build."""
    import kiln.engine.mapped_pages as mapped_pages
    from kiln.engine.base import BACKENDS
    from kiln.engine.openvino import OpenVINOConfig

    def ir(out):
        BACKENDS.create(OpenVINOConfig(weights="int8")).build(bf16_dir, out)
        return hashlib.sha256((out / "openvino_model.bin").read_bytes()).hexdigest()

    dropped = []
    real = mapped_pages.release
    monkeypatch.setattr(mapped_pages, "release", lambda *paths, unwritten=(): dropped.append(len(unwritten)) or
                        real(*paths, unwritten=unwritten))
    with_drop = ir(tmp_path / "a")
    assert dropped and min(dropped) >= 1  # the shard's copy-on-write mappings, released
    monkeypatch.setattr(mapped_pages, "unwritten", lambda *paths: frozenset())  # as before: nothing dropped
    assert ir(tmp_path / "b") == with_drop


def _traced_type(hf):
    """The TorchScript type the trace of hf's graph registers in torch's global compilation unit."""
    import torch

    return torch.jit._state._python_cu.get_class("__torch__.kiln.engine.openvino_export.Graph")


def test_the_export_leaves_no_torchscript_behind(bf16_dir):
    """torch.jit.trace compiles the traced graph into torch's global compilation unit, which keeps it for
    the life of the process (70 MiB at 135M, through every later stage): `tracing` clears it after."""
    from kiln.engine.openvino_export import load_hf_llama, trace, tracing

    with tracing(load_hf_llama(bf16_dir)) as hf:
        model = trace(hf)
        assert _traced_type(hf) is not None  # the name this test looks for is the one the trace registers
        del model
    assert _traced_type(hf) is None


def test_the_export_leaves_torchscript_in_use_alone(bf16_dir):
    """A script module alive in the process before the export: the compilation unit is left as it is (the
    trace's type stays), and the module still runs. Not shown here: that a clear would break it; torch's
    own tests clear the unit only between tests, and kiln does not clear what it cannot see is unused."""
    import torch

    from kiln.engine.openvino_export import load_hf_llama, trace, tracing

    linear = torch.nn.Linear(4, 2)
    scripted = torch.jit.script(linear)
    with tracing(load_hf_llama(bf16_dir)) as hf:
        trace(hf)
    assert _traced_type(hf) is not None
    x = torch.ones(1, 4)
    assert torch.equal(scripted(x), linear(x))  # its compiled forward still runs
