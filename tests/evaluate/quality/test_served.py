"""The served-text check: greedy continuations from a real `kiln serve` under concurrent load of
mixed prompt lengths, against the baseline one request at a time, judged by the gate's policy.

A correct engine passes; an engine that writes wrong tokens only while more than one request is
in flight (what CTranslate2's cohorts did, issue #18), or only beside a one-token prompt (issue 39),
fails, though it is exact one at a time."""

from __future__ import annotations

import pytest

from kiln.engine.hf_torch import TorchEngine, TorchEngineConfig
from kiln.evaluate.quality.served import (
    ServedConfig,
    mixed_order,
    one_at_a_time,
    served_text,
)
from kiln.core.gate.base import Evidence, Verdict
from kiln.core.gate.policy import GateSection, judge
from tests.evaluate.broken_engine import BatchBrokenEngine, ShortPromptBrokenEngine

CONFIG = ServedConfig(num_prompts=8, max_new_tokens=8, concurrency=4)
POLICY = GateSection.model_validate({"checks": [
    {"kind": "agreement", "metric": "served_prefix", "min": 0.9},
    {"kind": "agreement", "metric": "served_match", "min": 0.8}]})


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    engine = TorchEngine(tiny_model_dir, TorchEngineConfig(threads=1))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def prompts(reference):
    """Mixed lengths, 2 to 23 words."""
    words = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "bright",
             "stars", "shine", "above", "quiet", "hills"] * 2
    return [reference.tokenizer(" ".join(words[: 2 + 3 * i]))["input_ids"] for i in range(CONFIG.num_prompts)]


def _gate(result):
    candidate = Evidence("candidate", samples={k: result.column(k) for k in ("served_prefix", "served_match")})
    return judge(POLICY, candidate, Evidence("baseline"))


def test_mixed_order_alternates_short_and_long():
    lengths = [[0] * n for n in (5, 1, 4, 2, 3)]
    assert [len(lengths[i]) for i in mixed_order(lengths)] == [1, 5, 2, 4, 3]


def test_a_correct_server_passes(reference, tiny_model_dir, prompts):
    result = served_text(reference, lambda: TorchEngine(tiny_model_dir, TorchEngineConfig(threads=1)),
                         tiny_model_dir, prompts, CONFIG)
    assert len({r["prompt_tokens"] for r in result.records}) == len(prompts) + 1  # mixed lengths, and one token
    assert result.records[-1]["prompt_tokens"] == 1
    assert result.metrics["served_prefix"] >= 0.9, result.records
    outcome = _gate(result)
    assert outcome.verdict is Verdict.SUCCESSFUL, outcome.to_dict()
    rec = result.records[0]
    assert rec["baseline"] == rec["candidate"] and len(rec["baseline"]) == CONFIG.max_new_tokens
    assert rec["baseline_text"] == reference.tokenizer.decode(rec["baseline"])


def test_an_engine_wrong_only_when_batched_fails_the_gate(reference, tiny_model_dir, prompts):
    broken = {}

    def load():
        broken["engine"] = BatchBrokenEngine(tiny_model_dir, TorchEngineConfig(threads=1))
        return broken["engine"]

    alone = BatchBrokenEngine(tiny_model_dir, TorchEngineConfig(threads=1))
    assert one_at_a_time(alone, prompts[:3], 8) == one_at_a_time(reference, prompts[:3], 8)  # exact alone
    alone.close()
    result = served_text(reference, load, tiny_model_dir, prompts, CONFIG)
    assert broken["engine"].crowded_steps > 0  # the server did batch the requests
    assert result.metrics["served_prefix"] < 0.5, result.metrics
    outcome = _gate(result)
    assert outcome.verdict is Verdict.FAILED, outcome.to_dict()
    assert all(r.verdict is Verdict.FAILED for r in outcome.results)


def test_an_engine_wrong_beside_a_one_token_prompt_fails(reference, tiny_model_dir, prompts):
    """The recipe's prompts have two words or more: the one-token prompt the check adds is what
    puts the engine's defect in front of the gate."""
    result = served_text(reference, lambda: ShortPromptBrokenEngine(tiny_model_dir, TorchEngineConfig(threads=1)),
                         tiny_model_dir, prompts, CONFIG)
    wrong = [r for r in result.records if not r["served_match"]]
    assert wrong and all(r["prompt_tokens"] > 1 for r in wrong), result.records
    outcome = _gate(result)  # two of ten prompts wrong: below the policy's 0.8 bound, not proven below it
    assert outcome.verdict is not Verdict.SUCCESSFUL and outcome.exit_code != 0, outcome.to_dict()
