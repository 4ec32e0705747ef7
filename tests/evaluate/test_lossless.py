"""The lossless check: a candidate that speculates against its plain twin, greedy, token for token.

A speculating test engine over the tiny Llama (tests/evaluate/speculating_engine.py) whose drafter is
wrong at one position passes when its acceptance rule is strict and fails, naming the prompt, the
position and the two tokens, when the rule accepts a non-argmax draft; on both the benchmark's
prompts (one at a time) and the served-text prompts (through its own `kiln serve`, under load). The
near-tie rule, the check's verdicts (not applicable, nothing recorded) and the recipe's refusal of a
speculative candidate without the check are tested on their own.
"""

from __future__ import annotations

import numpy as np
import pytest

from kiln.core.gate.base import Evidence, Verdict
from kiln.core.gate.lossless import APPLIES, DIVERGENCE, MATCH, NOT_APPLICABLE
from kiln.core.gate.policy import GateSection, judge
from kiln.evaluate.parity import TIE_TOLERANCE, with_shortest
from kiln.evaluate.quality.lossless import PromptSet, candidate_answers, exactness, record
from tests.evaluate.speculating_engine import SpeculatingEngine

POLICY = GateSection.model_validate({"checks": [{"kind": "lossless"}]})
NEW_TOKENS = 6
WRONG_AT = 2  # the drafter proposes the runner-up at this generated position


@pytest.fixture(scope="module")
def twin(tiny_model_dir):
    from kiln.engine.hf_torch import TorchEngine, TorchEngineConfig

    engine = TorchEngine(tiny_model_dir, TorchEngineConfig(threads=1))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def sets(twin):
    words = "the quick brown fox jumps over a lazy dog while seven bright stars shine above quiet hills".split()
    prompts = [twin.tokenizer(" ".join(words[: 2 + 4 * i]))["input_ids"] for i in range(4)]
    return [PromptSet("benchmark", prompts, NEW_TOKENS),
            PromptSet("served", with_shortest(prompts, twin.tokenizer), NEW_TOKENS, concurrency=3)]


def _evidence(result) -> Evidence:
    return Evidence("candidate", metrics=result.metrics,
                    samples={k: result.column(k) for k in (MATCH, DIVERGENCE)})


@pytest.mark.parametrize("strict", [True, False], ids=["strict-acceptance", "accepts-non-argmax"])
def test_a_speculating_candidate_is_judged_against_its_plain_twin(twin, sets, tiny_model_dir, strict):
    from kiln.engine.hf_torch import TorchEngine, TorchEngineConfig

    order = []  # the candidate's engine goes before its server loads another: one model at a time

    def serve() -> SpeculatingEngine:
        order.append("served")
        return SpeculatingEngine(TorchEngine(tiny_model_dir, TorchEngineConfig(threads=1)), strict, WRONG_AT,
                                 owns_model=True)

    candidate = SpeculatingEngine(twin, strict, WRONG_AT)
    got = candidate_answers(candidate, serve, tiny_model_dir, sets, lambda: order.append("closed"))
    assert order == ["closed", "served"]
    assert candidate.drafts_rejected == (len(sets[0].prompts) if strict else 0)  # every wrong draft was tried
    result = exactness(twin, sets, got)
    outcome = judge(POLICY, _evidence(result), Evidence("baseline"))
    check = outcome.results[0]
    answers = sum(len(s.prompts) for s in sets)
    if strict:
        assert outcome.verdict is Verdict.SUCCESSFUL and check.observed == 1.0, check
        assert check.reason == f"all {answers} answers equal the plain twin's", check.reason
        return
    assert outcome.verdict is Verdict.FAILED and outcome.exit_code == 1, check
    # Every answer took the wrong draft; the one-token prompt's runner-up is a near-tie (gap 8e-4) on the tiny Llama.
    assert all(r[MATCH] == (r["tie_gap"] <= TIE_TOLERANCE) for r in result.records), result.records
    changed = sum(not r[MATCH] for r in result.records)
    assert changed >= answers - 2 and check.observed == pytest.approx(1 - changed / answers), result.records
    first = result.records[0]
    want, wrote = first["twin"][WRONG_AT], first["candidate"][WRONG_AT]
    decode = twin.tokenizer.decode
    excerpt = repr(decode(sets[0].prompts[0]))
    assert check.reason.startswith(
        f"{changed} of {answers} answers changed from the plain twin's: benchmark prompt 0 ({excerpt}) at generated "
        f"token {WRONG_AT}: twin {decode([want])!r} (id {want}), candidate {decode([wrote])!r} (id {wrote}); the "
        "twin's log-prob gap "), check.reason
    served = [r for r in result.records if r["doc_id"].startswith("served")]
    assert len(served) == len(sets[1].prompts) and all(r["matched_tokens"] == WRONG_AT for r in served), served
    assert f"served prompt 5 ('a') at generated token {WRONG_AT}" in served[5][DIVERGENCE]  # the shortest prompt too


class _Row:
    """A twin whose next-token log-probs are one fixed row: the gap between two tokens is what the test sets."""

    tokenizer = None

    def __init__(self, gap: float | None):
        self.gap = gap

    def next_token_logprobs(self, ids):
        if self.gap is None:
            raise NotImplementedError("generates only")
        row = np.full((len(ids[0]), 8), -9.0)
        row[-1, 5], row[-1, 6] = -1.0, -1.0 - self.gap
        return [row]


@pytest.mark.parametrize(("gap", "same"), [(TIE_TOLERANCE / 2, True), (0.5, False), (None, False)])
def test_a_split_is_a_change_unless_the_twin_calls_it_a_near_tie(gap, same):
    r = record(_Row(gap), "benchmark", 3, [1, 2, 3], [4, 5, 7], [4, 6, 6], None)
    assert (r[MATCH], r["matched_tokens"], r["tie_gap"]) == (float(same), 1, pytest.approx(gap)), r
    if same:
        assert r[DIVERGENCE] == ""
    else:
        why = "the twin's log-prob gap 0.5 > tolerance 0.001" if gap else "the twin cannot score"
        assert r[DIVERGENCE].startswith(
            f"benchmark prompt 3 ('1 2 3') at generated token 1: twin id 5, candidate id 6; {why}"), r[DIVERGENCE]


def test_an_answer_cut_short_is_a_change():
    r = record(_Row(0.0), "served", 0, [1], [4, 5], [4], None)
    assert r[MATCH] == 0.0 and r[DIVERGENCE].endswith("twin id 5, candidate (ended); 1 tokens where the twin wrote 2")


def test_the_check_without_a_twin_is_not_applicable_and_without_a_record_blocks():
    shown = judge(POLICY, Evidence("candidate", metrics={APPLIES: 0.0}), Evidence("baseline"))
    check = shown.results[0]
    assert (shown.verdict, check.observed, check.method) == (Verdict.SUCCESSFUL, None, NOT_APPLICABLE), check
    assert check.reason.startswith(f"{NOT_APPLICABLE}: ")
    missing = judge(POLICY, Evidence("candidate"), Evidence("baseline"))
    assert missing.verdict is Verdict.INCONCLUSIVE and missing.results[0].insufficient
    assert judge(POLICY.model_copy(update={"on_inconclusive": "pass"}), Evidence("candidate"),
                 Evidence("baseline")).exit_code == 3  # never waived: nothing was measured


def test_a_near_tie_passes_and_is_counted():
    evidence = Evidence("candidate", metrics={APPLIES: 1.0, "lossless_near_ties": 1.0},
                        samples={MATCH: {"benchmark 0": 1.0, "benchmark 1": 1.0}, DIVERGENCE: {}})
    check = judge(POLICY, evidence, Evidence("baseline")).results[0]
    assert check.verdict is Verdict.SUCCESSFUL
    assert check.reason == "all 2 answers equal the plain twin's, 1 split from it only at a near-tie"


def test_a_recipe_with_speculation_and_no_lossless_check_is_refused(tmp_path):
    from kiln.core.errors import BadInput, ExitCode
    from kiln.pipeline.recipe.schema import load_recipe

    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: x\ncandidates:\n"
                      "  - {name: plain, optimize: {method: none}, engine: {backend: llama_cpp}}\n"
                      "  - {name: spec, optimize: {method: none}, engine: {backend: llama_cpp, speculative: "
                      "{type: ngram-simple}}}\n"
                      "gate: {checks: [{kind: size, max_ratio: 1}]}\n")
    with pytest.raises(BadInput) as e:
        load_recipe(recipe)
    assert e.value.exit_code == ExitCode.BAD_INPUT
    assert "candidates.1.engine: speculative decoding" in str(e.value), str(e.value)
    assert "add `- {kind: lossless}` to gate.checks" in str(e.value), str(e.value)
    recipe.write_text(recipe.read_text().replace("max_ratio: 1}", "max_ratio: 1}, {kind: lossless}"))
    assert [c.kind for c in load_recipe(recipe).gate.checks] == ["size", "lossless"]


def test_the_twin_is_loaded_without_the_lever():
    """A speculative engine's folder loaded with its twin's options: the manifest's `speculative`, which
    the twin's dump leaves out at its default, must be overridden, not kept."""
    from kiln.engine.llama_cpp.config import LlamaCppConfig
    from kiln.pipeline.stages.lossless import twin_options

    built = LlamaCppConfig(speculative={"type": "ngram-simple"}, cache_reuse=4).model_dump(mode="json")
    twin = LlamaCppConfig.model_validate(built).plain_twin()
    loaded = LlamaCppConfig.model_validate({**built, **twin_options(twin, built)})  # as EngineBackend.load merges
    assert loaded == twin and loaded.speculative is None and loaded.cache_reuse == 4
