"""A search candidate's `grid` (pipeline/recipe/grid.py): expanded at load into ordinary candidates
with readable names, each validated as if written out; a bad path or value is named as written."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kiln.core.errors import BadInput
from kiln.engine.llama_cpp.config import LlamaCppConfig
from kiln.pipeline.recipe.grid import expand_grids
from kiln.pipeline.recipe.schema import load_recipe

RECIPE = """
name: grid
candidates:
  - name: llama-q8_0
    optimize: {method: gguf, type: q8_0}
    engine: {backend: llama_cpp, threads: 2}
    grid:
%s
  - name: torch-int8
    optimize: {method: int8_weight_only}
# A quantized KV cache (k-q8_0) is judged by perplexity at its ctx_per_slot (pipeline/recipe/kv_cache_rule.py).
evaluate: {quality: {perplexity: {seq_len: 2048}}}
gate: {checks: [{kind: size, max_ratio: 1}, {kind: quality, metric: perplexity, margin: 0.05, relative: true}]}
"""


def _load(tmp_path, grid: str, overrides=()):
    path = tmp_path / "r.yaml"
    path.write_text(RECIPE % "\n".join(f"      {line}" for line in grid.strip().splitlines()))
    return load_recipe(path, list(overrides))


def test_a_grid_expands_into_named_candidates_in_order(tmp_path):
    r = _load(tmp_path, """
engine.cache_type_k: [f16, q8_0]
engine.cache_reuse: [0, 256]
engine.parallel: [1]
""")
    names = [c.name for c in r.candidates]
    assert names == ["llama-q8_0.k-f16.reuse-0.parallel-1", "llama-q8_0.k-f16.reuse-256.parallel-1",
                     "llama-q8_0.k-q8_0.reuse-0.parallel-1", "llama-q8_0.k-q8_0.reuse-256.parallel-1", "torch-int8"]
    grid = {c.name: c for c in r.candidates[:4]}
    assert grid["llama-q8_0.k-q8_0.reuse-256.parallel-1"].engine.cache_type_k == "q8_0"
    assert grid["llama-q8_0.k-q8_0.reuse-256.parallel-1"].engine.cache_reuse == 256
    assert all(c.engine.threads == 2 and c.engine.parallel == 1 and c.optimize.type == "q8_0" for c in grid.values())
    assert all(c.grid is None for c in r.candidates)
    # As if written out: the resolved recipe lists the four, and reloads to the same digest.
    written = tmp_path / "resolved.yaml"
    import yaml

    written.write_text(yaml.safe_dump(r.model_dump(mode="json")))
    again = load_recipe(written)
    assert [c.name for c in again.candidates] == names and again.digest() == r.digest()


# Speculative candidates need a lossless gate check in a whole recipe; these read the expansion itself.
LLAMA = {"name": "llama-q8_0", "optimize": {"method": "gguf", "type": "q8_0"}, "engine": {"backend": "llama_cpp"}}


def _expanded(grid: dict) -> list[dict]:
    return expand_grids({"candidates": [{**LLAMA, "grid": grid}]})["candidates"]


def test_mapping_values_are_named_by_their_type_and_by_their_fields_when_that_repeats():
    got = _expanded({"engine.runtime": ["server"], "engine.speculative": [
        None, {"type": "ngram-simple", "ngram_n": 3, "ngram_m": 8}, {"type": "ngram-mod"}]})
    assert [c["name"] for c in got] == ["llama-q8_0.runtime-server.spec-none",
                                        "llama-q8_0.runtime-server.spec-ngram-simple",
                                        "llama-q8_0.runtime-server.spec-ngram-mod"]
    assert got[1]["engine"] == {"backend": "llama_cpp", "runtime": "server",
                                "speculative": {"type": "ngram-simple", "ngram_n": 3, "ngram_m": 8}}
    assert LlamaCppConfig.model_validate(got[1]["engine"]).plain_twin() == LlamaCppConfig.model_validate(
        got[0]["engine"])
    two = [{"type": "ngram-simple", "ngram_n": 2}, {"type": "ngram-simple", "ngram_n": 4}]
    assert [c["name"] for c in _expanded({"engine.speculative": two})] == [
        "llama-q8_0.spec-ngram-simple-ngram_n2", "llama-q8_0.spec-ngram-simple-ngram_n4"]


def test_optimize_options_and_deeper_paths():
    got = _expanded({"optimize.type": ["q8_0", "q4_0"], "engine.speculative.type": ["ngram-simple"]})
    assert [c["name"] for c in got] == ["llama-q8_0.type-q8_0.type-ngram-simple",
                                        "llama-q8_0.type-q4_0.type-ngram-simple"]
    assert got[1]["optimize"]["type"] == "q4_0" and got[1]["engine"]["speculative"] == {"type": "ngram-simple"}


@pytest.mark.parametrize(("grid", "words"), [
    ("engine.cache_typ_k: [q8_0]", "candidates.0.grid.engine.cache_typ_k: 'cache_typ_k' is not an option of this "
                                   "candidate's engine (LlamaCppConfig). Did you mean 'cache_type_k'?"),
    ("model.path: [demo]", "candidates.0.grid.model.path: a grid path is engine.<option> or optimize.<option>"),
    ("engine.cache_type_k: q8_0", "candidates.0.grid.engine.cache_type_k: a list of the values to try"),
    ("engine.cache_type_k: [f16, q9_0]", "candidates.0.grid.engine.cache_type_k: value 'q9_0': cache_type_k: Input "
                                         "should be"),
    ("engine.speculative: [{type: ngram-simple, draft_max: 4}]", "candidates.0.grid.engine.speculative: value "
     "{'type': 'ngram-simple', 'draft_max': 4}: speculative: draft_model and draft_max belong to type draft"),
    ("engine.cache_type_v: [q8_0]\nengine.flash_attn: [auto, 'off']", "candidates.0.grid: "
     "llama-q8_0.v-q8_0.flash_attn-off: cache_type_v: a quantized V cache (q8_0"),
    ("engine.threads: [2, 2]", "candidates.0.grid.engine.threads: values repeat (2)"),
])
def test_a_bad_grid_is_named_as_written(tmp_path, grid, words):
    with pytest.raises(BadInput) as e:
        _load(tmp_path, grid)
    assert any(words in line for line in e.value.problems), e.value.problems


def test_a_grid_on_the_default_engine_and_a_name_that_repeats(tmp_path):
    """A candidate without an engine section is served on torch (CandidateSection's default): its grid
    options are torch's. A grid's name that repeats a listed candidate's is refused as any repeat is."""
    r = _load(tmp_path, "engine.threads: [1]", ["candidates.1.grid={engine.threads: [1, 2]}"])
    assert [(c.name, c.engine.backend, c.engine.threads) for c in r.candidates[1:]] == [
        ("torch-int8.threads-1", "torch", 1), ("torch-int8.threads-2", "torch", 2)]
    with pytest.raises(BadInput, match="llama-q8_0.threads-1 appears more than once"):
        _load(tmp_path, "engine.threads: [1]", ["candidates.1.grid={engine.threads: [1]}",
                                                 "candidates.1.name=llama-q8_0"])


def test_kiln_validate_json_lists_the_expanded_candidates(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(RECIPE % "      engine.cache_type_k: [f16, q8_0]")
    out = subprocess.run([sys.executable, "-m", "kiln.pipeline", "validate", str(path), "--json"],
                         capture_output=True, text=True, check=False)
    arms = [a["name"] for a in json.loads(out.stdout)["arms"]]
    assert arms == ["llama-q8_0.k-f16", "llama-q8_0.k-q8_0", "torch-int8"], out.stderr
