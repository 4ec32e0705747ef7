"""The build parity smoke check: greedy tokens of a built engine, batched, against the float32 torch
reference one request at a time; an unquantized build that is not exact is refused."""

from __future__ import annotations

import pytest

from kiln.engine.hf_torch import TorchEngine, TorchEngineConfig
from kiln.evaluate.parity import (
    ParityRefused,
    check_build,
    reference_engine,
    unquantized,
    with_shortest,
)
from kiln.core.errors import BadInput, ExitCode
from tests.evaluate.broken_engine import BatchBrokenEngine, ShortPromptBrokenEngine


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    engine = reference_engine(tiny_model_dir, threads=1)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def prompts(reference):
    return [reference.tokenizer(t)["input_ids"] for t in
            ("the quick brown fox", "seven bright stars shine above the quiet hills tonight", "every engine")]


def test_an_exact_build_passes_with_its_figures(reference, tiny_model_dir, prompts):
    engine = TorchEngine(tiny_model_dir, TorchEngineConfig(threads=1, max_batch_size=4))
    figures = check_build(engine, reference, prompts, exact=True, label="torch float32")
    engine.close()
    assert figures["defects"] == 0 and figures["exact_required"]
    assert figures["max_abs_logprob"] < 1e-3, figures
    checked = with_shortest(prompts, reference.tokenizer)
    assert [r["prompt_tokens"] for r in figures["per_prompt"]] == [len(p) for p in checked]
    assert min(len(p) for p in checked) == 1 and min(len(p) for p in prompts) > 1


def test_an_unquantized_build_wrong_when_batched_is_refused(reference, tiny_model_dir, prompts):
    engine = BatchBrokenEngine(tiny_model_dir, TorchEngineConfig(threads=1))
    with pytest.raises(ParityRefused, match="Engine build refused: broken fp32 is unquantized") as err:
        check_build(engine, reference, prompts, exact=True, label="broken fp32")
    assert err.value.exit_code == ExitCode.INTERNAL_ERROR
    assert "generated token 0" in str(err.value)
    # A quantized build is not refused: the same figures are recorded for the gate to judge.
    figures = check_build(engine, reference, prompts, exact=False, label="broken int8")
    engine.close()
    assert figures["defects"] == figures["prompts"] and figures["identical"] == 0
    assert all(r["engine"] != r["reference"] for r in figures["per_prompt"])


def test_a_build_wrong_beside_a_one_token_prompt_is_refused(reference, tiny_model_dir, prompts):
    """Issue 39: CTranslate2 decoded every prompt of two tokens or more exactly, and streamed their
    prompts' tails as "generated" when a one-token prompt shared the batch. The check adds one."""
    engine = ShortPromptBrokenEngine(tiny_model_dir, TorchEngineConfig(threads=1))
    with pytest.raises(ParityRefused, match="generated token 0"):
        check_build(engine, reference, prompts, exact=True, label="ctranslate2 float32")
    engine.close()


def test_the_shortest_prompts_join_once(reference):
    tok = reference.tokenizer
    assert tok("a")["input_ids"] == [81] and tok("")["input_ids"] == []  # the demo tokenizer adds no BOS
    assert with_shortest([[5, 6], [81, 7]], tok) == [[5, 6], [81, 7], [5], [81]]
    assert with_shortest([[81], [5, 6]], tok) == [[81], [5, 6]]

    class WithBos:
        def __call__(self, text):
            return {"input_ids": [1] + [81] * len(text)}

    assert with_shortest([[1, 5, 6]], WithBos()) == [[1, 5, 6], [1]]  # the BOS alone is one token
    assert with_shortest([[5, 6]], None) == [[5, 6], [5]]  # no tokenizer: the one-token prompt only


@pytest.mark.parametrize(("backend", "config", "quantized", "exact"), [
    ("torch", {"dtype": "float32"}, False, True),
    ("torch", {"dtype": "float32"}, True, False),  # an int8 checkpoint on the torch engine
    ("torch", {"dtype": "bfloat16"}, False, False),
    ("ctranslate2", {"quantization": "float32"}, False, True),
    ("ctranslate2", {"quantization": "int8_float32"}, False, False),
    ("openvino", {"weights": "fp32", "activations": "f32", "kv_cache_precision": "f32"}, False, True),
    ("openvino", {"weights": "fp32", "activations": "bf16", "kv_cache_precision": "f32"}, False, False),
    ("tensorrt_llm", {"dtype": "float32"}, False, False),  # no rule: figures only
])
def test_which_builds_must_be_exact(backend, config, quantized, exact):
    assert unquantized({"backend": backend, "config": config}, quantized) is exact


def test_the_reference_loads_safetensors_or_the_source(tmp_path, tiny_model_dir):
    from kiln.evaluate.parity import reference_checkpoint

    assert reference_checkpoint(tiny_model_dir, "/elsewhere") == tiny_model_dir
    gguf = tmp_path / "gguf"
    gguf.mkdir()
    (gguf / "config.json").write_text("{}")  # a GGUF artifact: config and tokenizer, no safetensors
    assert reference_checkpoint(gguf, str(tiny_model_dir)) == tiny_model_dir
    # A cached artifact outlives the folder it was made from: the run's own copy is named first,
    # a vanished source is passed over, and with none left the refusal names what was tried.
    gone = tmp_path / "deleted-since"
    assert reference_checkpoint(gguf, gone, str(tiny_model_dir)) == tiny_model_dir
    assert reference_checkpoint(gguf, tiny_model_dir, gone) == tiny_model_dir
    with pytest.raises(BadInput, match="deleted-since"):
        reference_checkpoint(gguf, None, gone)


class _TokensOnly(TorchEngine):
    def score(self, pairs):
        raise NotImplementedError


def test_an_engine_that_cannot_score_is_checked_on_tokens(reference, tiny_model_dir, prompts):
    engine = _TokensOnly(tiny_model_dir, TorchEngineConfig(threads=1))
    figures = check_build(engine, reference, prompts, exact=True, label="tokens only")
    engine.close()
    assert figures["defects"] == 0 and figures["max_abs_logprob"] is None
