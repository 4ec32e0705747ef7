"""Fixtures for the lm-eval tests: one torch engine over the shared tiny Llama (`tiny_model_dir`
from tests/conftest.py, demo tokenizer) and a small stand-in for the demo data set."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.evaluate.quality.lmeval_data import write_data


@pytest.fixture(scope="session")
def engine(tiny_model_dir):
    from kiln.engine.hf_torch import TorchEngine, TorchEngineConfig

    e = TorchEngine(tiny_model_dir, TorchEngineConfig(threads=1))
    yield e
    e.close()


@pytest.fixture(scope="session")
def data(tmp_path_factory) -> SimpleNamespace:
    return write_data(tmp_path_factory.mktemp("demo-data"))
