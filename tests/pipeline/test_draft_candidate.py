"""A draft model given as another candidate's artifact (issue 53, point 1): `speculative: {type: draft,
draft_model: {candidate: NAME}}` names a gguf candidate of the same recipe. The recipe refuses a name that
cannot draft; each arm learns how the draft is made (Recipe.arms); the engine stage makes it once, under
the named candidate's own optimize key, links it into the engine folder as draft.gguf with its hash, keys
the engine by the draft's bytes, and llama-server drafts with it."""

from __future__ import annotations

import filecmp
import json
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from rich.console import Console

from kiln.core.errors import BadInput, ExitCode
from kiln.engine.cache import engine_key
from kiln.engine.llama_cpp.config import DRAFT_GGUF, LlamaCppConfig
from kiln.engine.llama_cpp.server import server_command
from kiln.pipeline.recipe.schema import Recipe, load_recipe
from tests.llama_cpp_build import require_llama_cpp

ENGINE = {"backend": "llama_cpp", "threads": 1, "parallel": 1, "ctx_per_slot": 256}
DRAFTING = {**ENGINE, "speculative": {"type": "draft", "draft_model": {"candidate": "q4"}, "draft_max": 4}}
CANDIDATES = [{"name": "q4", "optimize": {"method": "gguf", "type": "q4_0", "threads": 1}, "engine": ENGINE},
              {"name": "q8", "optimize": {"method": "gguf", "type": "q8_0", "threads": 1}, "engine": DRAFTING}]
RAW = {"name": "drafts", "candidates": CANDIDATES, "baseline": {"engine": {"backend": "torch", "threads": 1}},
       "evaluate": {"quality": {"perplexity": {"text": "demo", "max_documents": 2, "seq_len": 64}, "agreement": False},
                    "benchmark": {"prompts": "demo", "num_prompts": 2, "max_new_tokens": 4, "repeats": 1}},
       "gate": {"checks": [{"kind": "lossless"}]}}
WHERE = "candidates.1.engine.speculative.draft_model"


def _draft_of(engine) -> dict:
    return engine.model_dump(mode="json")["speculative"]["draft_model"]


# ----- the recipe -----------------------------------------------------------------------------------

def test_each_arm_learns_how_its_draft_is_made():
    recipe = Recipe.model_validate(RAW)
    arms = dict(recipe.arms())
    assert _draft_of(arms["q8"].engine) == {"candidate": "q4", "optimize": CANDIDATES[0]["optimize"]}
    assert arms["q4"].engine.speculative is None
    # The recipe as written (run_dir/recipe.yaml) keeps the name alone, and reloads as it was.
    assert _draft_of(recipe.candidates[1].engine) == {"candidate": "q4"}
    assert Recipe.model_validate(recipe.model_dump(mode="json")) == recipe
    # An arm is a recipe of its own: it validates without the candidate it names.
    assert Recipe.model_validate(arms["q8"].model_dump(mode="json")).engine == arms["q8"].engine


def _with(q8_draft: object, *, q4: dict | None = None) -> dict:
    raw = yaml.safe_load(yaml.safe_dump(RAW))
    raw["candidates"][1]["engine"]["speculative"]["draft_model"] = q8_draft
    if q4 is not None:
        raw["candidates"][0] = q4
    return raw


@pytest.mark.parametrize(("raw", "words"), [
    (_with({"candidate": "q5"}), "no candidate is named 'q5'. Did you mean 'q4'?"),
    (_with({"candidate": "q8"}), "candidate 'q8' names itself"),
    (_with({"candidate": "q4"}, q4={"name": "q4", "optimize": {"method": "int8_weight_only"},
                                    "engine": {"backend": "torch"}}),
     "'q4' (optimize.method int8_weight_only) makes a safetensors artifact, and llama-server drafts with a GGUF"),
    (_with({"candidate": "q4"}, q4={"name": "q4", "champion": True}), "'q4' is the registry's champion"),
], ids=["unknown", "itself", "not-gguf", "champion"])
def test_a_candidate_that_cannot_draft_is_refused_naming_the_field(tmp_path, raw, words):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(BadInput) as e:
        load_recipe(path)
    assert e.value.exit_code == ExitCode.BAD_INPUT
    said = str(e.value)
    assert f"{WHERE}: " in said and words in said and "optimize.method is gguf" in said.lower(), said


def test_a_recipe_without_candidates_has_none_to_draft_with(tmp_path):
    path = tmp_path / "r.yaml"
    raw = {**{k: v for k, v in RAW.items() if k not in ("candidates", "baseline")},
           "optimize": CANDIDATES[1]["optimize"], "engine": DRAFTING}
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(BadInput) as e:
        load_recipe(path)
    said = str(e.value)
    assert "engine.speculative.draft_model: {candidate: q4} names another candidate" in said, said


# ----- keys and the command ------------------------------------------------------------------------------

def test_the_engine_key_follows_the_drafts_bytes_not_its_name(tmp_path):
    """A candidate's draft is keyed by its artifact's hash; a draft given as a path by the file's bytes
    (the engine stage hashes it), so a .gguf rewritten at the same path builds and measures anew."""
    from kiln.pipeline.stages.optimize import _draft_named

    drafting = dict(Recipe.model_validate(RAW).arms())["q8"].engine
    keys = {engine_key(drafting.draft_resolved(sha * 64), "target", {}, None) for sha in "ab"}
    assert len(keys) == 2
    draft = tmp_path / "d.gguf"
    draft.write_bytes(b"GGUF one")
    by_path = LlamaCppConfig(speculative={"type": "draft", "draft_model": str(draft)})
    (tmp_path / "cache").mkdir()
    no_ctx = SimpleNamespace(cache=tmp_path / "cache")  # a path draft needs no stage of the run, only the hash cache
    first = _draft_named(no_ctx, by_path)
    draft.write_bytes(b"GGUF two")
    second = _draft_named(no_ctx, by_path)
    assert first.speculative.draft_model == second.speculative.draft_model == str(draft)
    assert len({engine_key(c, "target", {}, None) for c in (by_path, first, second)}) == 3
    assert _draft_named(no_ctx, LlamaCppConfig()) == LlamaCppConfig()


def test_server_command_drafts_with_the_engine_folders_draft_gguf(tmp_path):
    drafting = dict(Recipe.model_validate(RAW).arms())["q8"].engine
    cmd = server_command("llama-server", tmp_path / "model.gguf", 1, drafting)
    assert cmd[cmd.index("--spec-draft-model") + 1] == str(tmp_path / DRAFT_GGUF)
    assert cmd[cmd.index("--spec-type") + 1] == "draft-simple"


# ----- the stages, on the tiny Llama ------------------------------------------------------------------

class _Untracked:
    """No MLflow: the stages' runs are not what these tests read (a tracking server costs seconds to start)."""

    def start(self, *args, **kwargs) -> str:
        return "run"

    def log(self, *args, **kwargs) -> None:
        pass

    log_artifacts = end = log

    def find_stage(self, key: str) -> None:
        return None


@pytest.fixture(scope="module")
def drafted(tmp_path_factory, tiny_model_dir):
    """q8's engine stage (which makes q4's artifact as its draft), then q4's own optimize stage."""
    from kiln.pipeline.stages import optimize as stage_optimize
    from kiln.pipeline.recipe.model_source import resolve_model
    from kiln.pipeline.stages.base import RunContext

    require_llama_cpp()
    work = tmp_path_factory.mktemp("drafts")
    arms = dict(Recipe.model_validate({**RAW, "model": {"path": str(tiny_model_dir)}}).arms())
    tracker = _Untracked()
    contexts = {}
    for name in ("q8", "q4"):
        (work / name / "stages").mkdir(parents=True)
        contexts[name] = RunContext(recipe=arms[name], recipe_path=work / "r.yaml", run_dir=work / name,
                                    cache=work / "cache", tracker=tracker, parent_run=tracker.start(name, {}),
                                    console=Console(quiet=True), arm=name)
    model = resolve_model(str(tiny_model_dir), work / "cache")
    q8 = contexts["q8"]
    target = stage_optimize.quantize(q8, "candidate", arms["q8"].optimize, model)
    engine_dir = stage_optimize.engine(q8, "candidate", target)
    q4 = stage_optimize.quantize(contexts["q4"], "candidate", arms["q4"].optimize, model)
    return SimpleNamespace(engine_dir=engine_dir, q8=q8.outcomes, q4=contexts["q4"].outcomes, q4_art=q4)


def test_the_draft_is_the_named_candidates_artifact_made_once(drafted):
    draft, q4 = drafted.q8["optimize:draft"], drafted.q4["optimize:candidate"]
    assert draft.key == q4.key and not draft.reused and q4.reused  # one quantization, two roles
    manifest = json.loads((drafted.engine_dir / "kiln-engine.json").read_text())
    sha = drafted.q4_art.manifest["sha256"]
    assert manifest["build"]["draft"] == {"file": DRAFT_GGUF, "candidate": "q4",
                                          "source": {"path": str(draft.path / "model"), "sha256": sha}}
    assert manifest["config"]["speculative"]["draft_sha256"] == sha
    assert filecmp.cmp(drafted.engine_dir / DRAFT_GGUF, drafted.q4_art.path / "model.gguf", shallow=False)


def test_llama_server_drafts_with_the_other_candidates_gguf(drafted):
    """Read back from the running server: its command line (/proc) names the folder's draft.gguf, its slot
    runs draft-simple, and a greedy completion drafts tokens (timings.draft_n)."""
    from kiln.engine.loader import load_engine

    engine = load_engine(drafted.engine_dir)
    try:
        argv = Path(f"/proc/{engine.process.pid}/cmdline").read_bytes().decode().split("\0")
        body = {"prompt": list(range(5, 40)), "n_predict": 24, "return_tokens": True, "samplers": ["top_k"],
                "top_k": 1}
        request = urllib.request.Request(engine.server_url + "/completion", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as r:
            timings = json.loads(r.read())["timings"]
        with urllib.request.urlopen(engine.server_url + "/slots", timeout=30) as r:
            slot = json.loads(r.read())[0]
    finally:
        engine.close()
    assert argv[argv.index("--spec-draft-model") + 1] == str(drafted.engine_dir / DRAFT_GGUF)
    assert slot["speculative"] is True and "draft-simple" in slot["params"]["speculative.types"], slot
    assert timings["draft_n"] > 0, timings


def test_an_engine_folder_missing_its_draft_is_refused(drafted, tmp_path):
    import shutil

    from kiln.engine.loader import load_engine

    copy = tmp_path / "engine"
    shutil.copytree(drafted.engine_dir, copy)
    (copy / DRAFT_GGUF).unlink()
    with pytest.raises(BadInput, match=f"{DRAFT_GGUF} is missing"):
        load_engine(copy)
