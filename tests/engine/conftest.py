"""Engine test fixtures: one loaded torch engine over the shared tiny random Llama
(`tiny_model_dir` from tests/conftest.py), and the naive reference decoders it is checked against.
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def torch_engine(tiny_model_dir):
    """One loaded torch engine shared by the tests that leave it idle when they finish."""
    from kiln.engine.hf_torch import TorchEngine, TorchEngineConfig

    engine = TorchEngine(tiny_model_dir, TorchEngineConfig(threads=1))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def served_engine(tiny_model_dir):
    """A second engine for a test server to own. An engine is not thread-safe and the server's
    scheduler thread may still be stepping (a sequence cut short by a stop string is cancelled
    asynchronously), so expected values come from `torch_engine`, never from the served one."""
    from kiln.engine.hf_torch import TorchEngine, TorchEngineConfig

    engine = TorchEngine(tiny_model_dir, TorchEngineConfig(threads=1))
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def tiny_gguf(tiny_model_dir, tmp_path_factory):
    """The tiny random Llama as an f32 GGUF engine folder (model.gguf beside its tokenizer), read only."""
    from kiln.engine.cache import write_engine
    from kiln.engine.llama_cpp.config import LlamaCppConfig
    from tests.llama_cpp_build import require_llama_cpp

    require_llama_cpp()
    out = tmp_path_factory.mktemp("tiny-gguf")
    write_engine(LlamaCppConfig(), tiny_model_dir, "tiny", out)
    return out


@pytest.fixture(scope="session")
def naive_greedy():
    return _naive_greedy


@pytest.fixture(scope="session")
def naive_score():
    return _naive_score


def _naive_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Reference decoder: full recompute of the whole sequence for every token, argmax."""
    import torch

    ids, out = list(prompt), []
    with torch.inference_mode():
        for _ in range(n):
            token = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            out.append(token)
            ids.append(token)
    return out


def _naive_score(model, context: list[int], continuation: list[int]) -> float:
    """Reference scorer: one full forward, summed log-softmax of the continuation tokens."""
    import torch

    with torch.inference_mode():
        logits = model(torch.tensor([context + continuation])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return sum(float(logprobs[len(context) - 1 + k, t]) for k, t in enumerate(continuation))
