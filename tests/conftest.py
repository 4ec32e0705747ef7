"""Shared test fixtures: the demo model and data, and a tiny random Llama with the demo tokenizer;
and the order the test files go out to `make test`'s workers in (slowest first).

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
from collections import Counter
from pathlib import Path

import pytest

from kiln.core.home import kiln_cache

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


# The files that take longest, longest first (seconds of wall on one test worker in a fresh-clone `make
# test` on the 2-core VM, 2026-12-07). `make test` hands whole files to two workers in collection order
# (--dist loadfile --no-loadscope-reorder): these go first so the last minutes are the many short files,
# not one worker running a 6-minute file while the other has nothing left. xdist's own order (most tests
# first) put most of them last, since a long end-to-end file holds few tests.
SLOWEST_FILES = (
    "tests/pipeline/test_search_ray.py",  # 366 s
    "tests/pipeline/test_tracking_servers.py",  # 235 s
    "tests/ci/test_action_runner.py",  # 232 s
    "tests/pipeline/test_search.py",  # 103 s
    "tests/pipeline/test_forged_evidence.py",  # 85 s
    "tests/pipeline/test_disk_once.py",  # 69 s
    "tests/optimize/test_gguf.py",  # 67 s
    "tests/pipeline/test_search_goodput.py",  # 60 s
    "tests/engine/test_llama_cpp_run.py",  # 52 s
    "tests/pipeline/test_run_e2e.py",  # 48 s
    "tests/pipeline/test_ui_browser.py",  # 46 s
)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """SLOWEST_FILES first, in that order; then the others by number of tests, most first, as xdist
    orders them by default. A stable sort: each file's own order (fixture grouping) is kept."""
    counts = Counter(item.nodeid.split("::")[0] for item in items)

    def rank(item: pytest.Item) -> tuple[int, int]:
        path = item.nodeid.split("::")[0]
        slow = SLOWEST_FILES.index(path) if path in SLOWEST_FILES else len(SLOWEST_FILES)
        return slow, -counts[path]

    items.sort(key=rank)


def pytest_configure(config: pytest.Config) -> None:
    from tests import cpu_report  # CPU seconds by file at the end of the run: what spends the suite's budget

    config.pluginmanager.register(cpu_report, "kiln-cpu-report")


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
    from kiln.pipeline.demo.prepare import demo_model_dir

    return demo_model_dir()


@pytest.fixture(scope="session")
def demo_data():
    """`DemoData`: held-out and calibration Austen text, GSM8K prompts, word-swap task."""
    from kiln.pipeline.demo.prepare import prepare_demo_data

    return prepare_demo_data()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, demo_model) -> Path:
    # The tokenizer comes from the cached demo checkout: after the one-time conversion that is
    # instant, while building it from the GGUF costs ~17 s of CPU in every session.
    return build_tiny_llama(demo_model, tmp_path_factory.mktemp("tiny-llama"))
