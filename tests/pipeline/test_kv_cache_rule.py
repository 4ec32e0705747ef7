"""The recipe rule for a quantized KV cache (pipeline/recipe/kv_cache_rule.py): a candidate whose cache is
quantized is refused (exit 2) unless a gated perplexity check scores documents at least as long as the
rule's floor and the context its engine serves, against a baseline whose cache is not quantized; an
OpenVINO u8 cache is refused outright. Each branch through the recipe loader, written-out and
grid-expanded candidates, `kiln validate` (with its document count at the new length) and a pinned
policy (`--policy-from`)."""

from __future__ import annotations

import pytest
import yaml

from kiln.core.errors import BadInput, ExitCode
from kiln.engine.llama_cpp.config import LlamaCppConfig
from kiln.engine.openvino import OpenVINOConfig
from kiln.engine.tensorrt_llm import TensorRTLLMConfig
from kiln.pipeline.recipe.kv_cache_rule import CHECK_LINE, quantized_kv, served_length
from kiln.pipeline.recipe.schema import load_recipe
from tests.pipeline.conftest import kiln

PERPLEXITY = {"kind": "quality", "metric": "perplexity", "margin": 0.05, "relative": True}
SIZE = {"kind": "size", "max_ratio": 1}
Q8 = {"name": "q8", "optimize": {"method": "gguf", "type": "q8_0"}}


def _search(engine: dict, seq_len: int = 2048, checks: tuple = (SIZE, PERPLEXITY), **more) -> dict:
    """A search over one llama_cpp candidate (baseline: torch), perplexity at `seq_len`."""
    return {"name": "kv", "candidates": [{**Q8, "engine": {"backend": "llama_cpp", **engine}}],
            "evaluate": {"quality": {"perplexity": {"seq_len": seq_len}}}, "gate": {"checks": list(checks)}, **more}


def _load(tmp_path, recipe: dict):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return load_recipe(path)


def _refusal(tmp_path, recipe: dict) -> str:
    with pytest.raises(BadInput) as e:
        _load(tmp_path, recipe)
    assert e.value.exit_code == ExitCode.BAD_INPUT
    return "\n".join(e.value.problems)


@pytest.mark.parametrize(("engine", "kinds"), [
    (LlamaCppConfig(), []),
    (LlamaCppConfig(cache_type="f32", cache_type_k="bf16"), []),
    (LlamaCppConfig(cache_type_k="q8_0"), ["cache_type_k q8_0"]),
    (LlamaCppConfig(cache_type="q4_0"), ["cache_type q4_0"]),  # the shorthand quantizes both: named once
    (LlamaCppConfig(cache_type="q8_0", cache_type_k="f16"), ["cache_type q8_0"]),
    (LlamaCppConfig(cache_type_k="iq4_nl", cache_type_v="q5_1"), ["cache_type_k iq4_nl", "cache_type_v q5_1"]),
    (OpenVINOConfig(kv_cache_precision="f16"), []),
    (OpenVINOConfig(kv_cache_precision="u8"), ["kv_cache_precision u8"]),
    (TensorRTLLMConfig(kv_cache_dtype="fp8"), ["kv_cache_dtype fp8"]),
])
def test_which_caches_are_quantized(engine, kinds):
    assert quantized_kv(engine) == kinds


def test_the_longest_sequence_an_engine_serves():
    assert served_length(LlamaCppConfig()) == (2048, "ctx_per_slot")
    assert served_length(TensorRTLLMConfig(max_seq_len=4096)) == (4096, "max_seq_len")
    assert served_length(TensorRTLLMConfig()) is None and served_length(OpenVINOConfig()) is None


def test_a_quantized_cache_without_a_perplexity_check_is_refused(tmp_path):
    got = _refusal(tmp_path, _search({"cache_type_v": "q8_0"}, checks=(SIZE,)))
    assert "candidate q8 (engine.cache_type_v q8_0): a quantized KV cache is judged by a perplexity check" in got
    assert f"gate.checks has no perplexity check: add `{CHECK_LINE}` to gate.checks" in got, got


def test_documents_shorter_than_the_floor_are_refused(tmp_path):
    got = _refusal(tmp_path, _search({"cache_type_k": "q8_0", "ctx_per_slot": 512}, seq_len=512))
    assert ("evaluate.quality.perplexity.seq_len is 512, below 1024: set evaluate.quality.perplexity.seq_len: "
            "1024 (") in got, got


def test_documents_shorter_than_the_served_context_are_refused_naming_the_grid_candidate(tmp_path):
    """Grid candidates are expanded before the rule: the refusal names the one whose cache is quantized,
    by the name the grid gave it; its f16 sibling needs nothing."""
    recipe = _search({}, seq_len=1024)
    recipe["candidates"][0]["grid"] = {"engine.cache_type_k": ["f16", "q8_0"]}
    got = _refusal(tmp_path, recipe)
    assert "candidate q8.k-q8_0 (engine.cache_type_k q8_0)" in got and "q8.k-f16" not in got, got
    assert ("seq_len is 1024, and candidate q8.k-q8_0 serves sequences of up to 2048 tokens (engine.ctx_per_slot): "
            "set evaluate.quality.perplexity.seq_len: 2048, or lower engine.ctx_per_slot") in got, got
    recipe["evaluate"]["quality"]["perplexity"]["seq_len"] = 2048
    assert [c.name for c in _load(tmp_path, recipe).candidates] == ["q8.k-f16", "q8.k-q8_0"]


def test_a_baseline_with_the_same_quantized_cache_is_refused(tmp_path):
    """Unset, a one-candidate recipe's baseline is served on the candidate's engine, cache types and all:
    the refusal gives the baseline line that serves it without them, and that line is accepted."""
    engine = {"backend": "llama_cpp", "threads": 2, "ctx_per_slot": 1024, "cache_type": "q8_0"}
    recipe = {"name": "kv", "optimize": {"method": "gguf", "type": "q8_0"}, "engine": engine,
              "evaluate": {"quality": {"perplexity": {"seq_len": 1024}}}, "gate": {"checks": [PERPLEXITY]}}
    got = _refusal(tmp_path, recipe)
    line = "baseline: {engine: {backend: llama_cpp, threads: 2, ctx_per_slot: 1024}}"
    assert ("the recipe's engine (engine.cache_type q8_0)" in got and "baseline.engine is unset" in got
            and f"add `{line}`" in got), got
    fixed = _load(tmp_path, {**recipe, **yaml.safe_load(line)})
    assert fixed.engine_for("baseline").kv_types() == ("f16", "f16")
    # A search's baseline set to a quantized cache is refused too; left unset (torch) it is not.
    search = _search({"cache_type": "q8_0"}, baseline={"engine": {"backend": "llama_cpp", "cache_type_v": "q4_0"}})
    assert "baseline.engine quantizes its KV cache too (cache_type_v q4_0)" in _refusal(tmp_path, search)
    del search["baseline"]
    assert _load(tmp_path, search).candidates[0].engine.kv_types() == ("q8_0", "q8_0")


def test_an_openvino_u8_cache_is_refused_and_float_caches_need_nothing(tmp_path):
    recipe = _search({}, checks=(SIZE,))
    recipe["candidates"][0] = {"name": "ov", "optimize": {"method": "none"},
                               "engine": {"backend": "openvino", "kv_cache_precision": "u8"}}
    got = _refusal(tmp_path, recipe)
    assert "candidate ov: engine.kv_cache_precision u8 quantizes the KV cache, and the openvino engine scores " \
           "perplexity without it" in got and "set engine.kv_cache_precision to f16 or f32" in got, got
    recipe["candidates"][0]["engine"]["kv_cache_precision"] = "f16"
    recipe["candidates"].append({**Q8, "engine": {"backend": "llama_cpp", "cache_type": "f32", "cache_type_k": "bf16"}})
    recipe["evaluate"]["quality"]["perplexity"]["seq_len"] = 128
    assert [c.name for c in _load(tmp_path, recipe).candidates] == ["ov", "q8"]


def test_kiln_validate_refuses_then_counts_the_documents_at_the_new_length(tmp_path, tiny_model_dir):
    """Exit 2 with every problem on stderr; once fixed, valid; and the text's documents are counted at
    the new seq_len (the demo text under the demo tokenizer holds 102 of 1024 tokens)."""
    recipe = {"name": "kv", "model": {"path": str(tiny_model_dir)}, "optimize": {"method": "none"},
              "engine": {"backend": "llama_cpp", "ctx_per_slot": 1024, "cache_type_v": "q8_0"},
              "evaluate": {"quality": {"perplexity": {"text": "demo", "seq_len": 256}}}, "gate": {"checks": [SIZE]}}
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    refused = kiln("validate", str(path), cwd=tmp_path)
    assert refused.returncode == ExitCode.BAD_INPUT, refused.stdout + refused.stderr
    said = " ".join(refused.stderr.split())
    assert all(p in said for p in ("gate.checks has no perplexity check", "seq_len is 256, below 1024",
                                   "baseline.engine is unset")), said
    fixed = kiln("validate", str(path), "--set", "gate.checks=[{kind: quality, metric: perplexity, margin: 0.05}]",
                 "--set", "evaluate.quality.perplexity.seq_len=1024",
                 "--set", "baseline.engine={backend: llama_cpp, ctx_per_slot: 1024}", cwd=tmp_path)
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    too_many = kiln("validate", str(path), "--set", "gate.checks=[{kind: quality, metric: perplexity, margin: 0.05}]",
                    "--set", "evaluate.quality.perplexity.seq_len=1024", "--set",
                    "evaluate.quality.perplexity.max_documents=120",
                    "--set", "baseline.engine={backend: llama_cpp, ctx_per_slot: 1024}", cwd=tmp_path)
    assert too_many.returncode == ExitCode.BAD_INPUT
    assert "yields 102 documents of 1024 tokens (seq_len)" in " ".join(too_many.stderr.split()), too_many.stderr


def test_a_pinned_policy_must_judge_the_recipes_quantized_cache(tmp_path):
    """`--policy-from`: the recipe passes the rule under its own policy; judged under one whose gate has no
    perplexity check and whose documents are short, it is refused, naming the policy's file."""
    from kiln.pipeline.cli.policy import judged_recipe

    recipe, policy = tmp_path / "recipe.yaml", tmp_path / "policy.yaml"
    recipe.write_text(yaml.safe_dump(_search({"cache_type_k": "q8_0"}), sort_keys=False))
    policy.write_text(yaml.safe_dump(_search({}, seq_len=256, checks=(SIZE,)), sort_keys=False))
    assert judged_recipe(recipe, [], None).candidates[0].engine.cache_type_k == "q8_0"
    with pytest.raises(BadInput) as e:
        judged_recipe(recipe, [], policy)
    said = str(e.value)
    assert said.startswith(f"{recipe} judged under the policy of {policy}: candidate q8 (engine.cache_type_k q8_0)")
    assert "gate.checks has no perplexity check" in said and "seq_len is 256" in said and said.endswith(
        f"(in {policy})"), said
