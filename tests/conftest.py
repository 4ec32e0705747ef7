"""Shared test fixtures: the demo model and data, and a tiny random Llama with the demo tokenizer.

Environment is set at import time, before any test module imports transformers or MLflow:
tests never reach a model hub. What is built or fetched once per machine (llama.cpp, the demo model
and data, lm-eval's files, MLflow's empty store) comes from kiln's one cache ($KILN_CACHE, else
~/.cache/kiln), shared with `make` and every `kiln` command. Stages and engines do not: KILN_CACHE is
set to a cache of this session's own (`_session_cache`), so no test passes on what an older kiln, or
a user, left in the machine's cache, and a CI machine whose cache was edited by hand runs as a new
one does. The session's xdist workers share it; the controller deletes it at the end.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from kiln.core.llama_cpp_build import kiln_cache

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"
# Two test workers, each running torch (libgomp) with 2 threads, on 2 cores: OpenMP's default lets an
# idle thread spin for its next parallel region, on a CPU the other worker's process is waiting for.
# Sleeping instead took 16-23% of the CPU off test_search.py and test_concurrent_runs.py at -n 2 (A B A B
# on the 2-vCPU AMD EPYC VM: 289/271 s against 223/228 s of user CPU, 196/186 s against 165/169 s of
# wall). The tests' speed checks are relative and guarded; none measures OpenMP's wake-up latency.
# setdefault: a user who set it keeps theirs.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# The parts of the machine's cache a session links to: each is keyed by what built it, written
# atomically under its own lock, and not what a test checks.
MACHINE_PARTS = ("llama.cpp", "models", "data", "debs", "hf", "mlflow")
SESSION_CACHE = "KILN_TEST_SESSION_CACHE"


def _session_cache() -> tuple[Path, bool]:
    """This session's cache and whether this process made it (an xdist worker inherits its
    controller's through the environment)."""
    if given := os.environ.get(SESSION_CACHE):
        return Path(given), False
    machine = kiln_cache()
    path = Path(tempfile.mkdtemp(prefix="kiln-test-cache-"))
    for part in MACHINE_PARTS:
        (machine / part).mkdir(parents=True, exist_ok=True)
        (path / part).symlink_to(machine / part, target_is_directory=True)
    os.environ[SESSION_CACHE] = str(path)
    return path, True


_CACHE, _MADE_HERE = _session_cache()
os.environ["KILN_CACHE"] = str(_CACHE)
# kiln's home (runs, the default MLflow store and its artifacts: kiln.core.home) is never the user's:
# this session's own folder for what runs before any test (session fixtures), then each test's own.
os.environ["KILN_HOME"] = str(_CACHE / "home")


def pytest_sessionfinish(session: pytest.Session) -> None:
    if _MADE_HERE and not hasattr(session.config, "workerinput"):
        shutil.rmtree(_CACHE, ignore_errors=True)


@pytest.fixture(autouse=True)
def kiln_home(tmp_path, monkeypatch) -> Path:
    """Each test's kiln home is its own tmp_path: what a test runs in-process or starts with the
    environment it inherits writes runs/, mlflow.db and mlruns/ there, never into ~/.local/share/kiln."""
    monkeypatch.setenv("KILN_HOME", str(tmp_path))
    return tmp_path


def build_tiny_llama(tokenizer_dir: Path, out: Path) -> Path:
    """A 2-layer random Llama (every dimension divisible by 128) with the tokenizer of `tokenizer_dir`."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=len(tok),
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        dtype="float32",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def demo_model() -> Path:
    """The SmolLM2-135M-Instruct fp32 checkpoint folder (converted on first use, then cached)."""
    from kiln.pipeline.demo import demo_model_dir

    return demo_model_dir()


@pytest.fixture(scope="session")
def demo_data():
    """`DemoData`: held-out and calibration Austen text, GSM8K prompts, word-swap task."""
    from kiln.pipeline.demo import prepare_demo_data

    return prepare_demo_data()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, demo_model) -> Path:
    # The tokenizer comes from the cached demo checkout: after the one-time conversion that is
    # instant, while building it from the GGUF costs ~17 s of CPU in every session.
    return build_tiny_llama(demo_model, tmp_path_factory.mktemp("tiny-llama"))
