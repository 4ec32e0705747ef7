"""The engine stage's parity smoke check holds one model at a time: the reference answers and is
freed before the built engine loads, and it holds a bf16 checkpoint as bf16 unless the build must be
exact (issue 35: the float32 reference beside the engine made the stage 3x the checkpoint)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from rich.console import Console

from kiln.engine.cache import build_engine
from kiln.engine.hf_torch import TorchEngine, TorchEngineConfig
from kiln.optimize.base import ModelArtifact
from kiln.pipeline.stages import optimize as stage_optimize


@pytest.fixture(scope="module")
def bf16_model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path_factory.mktemp("tiny-bf16")
    AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(out)
    return out


@pytest.fixture
def live(monkeypatch):
    """Torch engines alive now, and the most alive at once, with the dtype each loaded."""
    seen = {"now": 0, "most": 0, "dtypes": []}
    init, close = TorchEngine.__init__, TorchEngine.close

    def counted_init(self, checkpoint, config):
        init(self, checkpoint, config)
        seen["now"] += 1
        seen["most"] = max(seen["most"], seen["now"])
        seen["dtypes"].append(config.dtype)

    def counted_close(self):
        close(self)
        seen["now"] -= 1

    monkeypatch.setattr(TorchEngine, "__init__", counted_init)
    monkeypatch.setattr(TorchEngine, "close", counted_close)
    return seen


def _smoke(checkpoint: Path, engine: TorchEngineConfig, cache: Path, demo_data) -> dict:
    ctx = SimpleNamespace(recipe=SimpleNamespace(evaluate=SimpleNamespace(
        benchmark=SimpleNamespace(prompts="demo", num_prompts=3)), engine=SimpleNamespace(threads=1)),
        outcomes={}, console=Console(quiet=True))
    engine_dir = build_engine(engine, checkpoint, f"sha-{checkpoint.name}", cache)
    return stage_optimize._parity_smoke(ctx, engine_dir, ModelArtifact(path=checkpoint, manifest={"method": "none"}))


def test_a_bf16_checkpoint_is_checked_against_a_bf16_reference_loaded_first(bf16_model_dir, tmp_path, live, demo_data):
    figures = _smoke(bf16_model_dir, TorchEngineConfig(dtype="float16", threads=1), tmp_path, demo_data)
    assert live["most"] == 1, live  # the reference was freed before the engine loaded
    assert live["dtypes"] == ["bfloat16", "float16"] and live["now"] == 0
    assert figures["reference"].startswith("torch bfloat16") and not figures["exact_required"]
    assert figures["prompts"] >= 4 and figures["max_abs_logprob"] is not None


def test_an_exact_build_gets_a_float32_reference(bf16_model_dir, tmp_path, live, demo_data):
    # torch float32 on a bf16 checkpoint must be exact, so its reference is float32: itself.
    figures = _smoke(bf16_model_dir, TorchEngineConfig(dtype="float32", threads=1), tmp_path, demo_data)
    assert live["dtypes"] == ["float32"] and live["most"] == 1
    assert figures["exact_required"] and figures["defects"] == 0
    assert figures["reference"] == "this engine, one request at a time"


def test_a_bf16_engine_on_a_bf16_checkpoint_is_its_own_reference(bf16_model_dir, tmp_path, live, demo_data):
    figures = _smoke(bf16_model_dir, TorchEngineConfig(dtype="bfloat16", threads=1), tmp_path, demo_data)
    assert live["dtypes"] == ["bfloat16"]
    assert figures["reference"] == "this engine, one request at a time" and figures["defects"] == 0
