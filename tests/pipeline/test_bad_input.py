"""Bad input to the pipeline gets exit 2 naming the file or field and the fix — before any stage
runs where the input is known up front — and never a traceback (exit 4) or a hang."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kiln.core.errors import BadInput
from kiln.pipeline.recipe.schema import load_recipe
from tests.pipeline.conftest import TINY_RECIPE, fresh_cache, kiln, write_recipe

BASE = yaml.safe_dump({**TINY_RECIPE, "model": {"path": "demo"}})


def _bytes_case(name: str) -> bytes:
    return {
        "latin-1": ("description: café\n" + BASE).encode("latin-1"),
        "utf-16": BASE.encode("utf-16"),
        "nested": b"x: " + b"[" * 100_000,
        "long-int": (BASE + "\ndescription: " + "9" * 5000 + "\n").encode(),
        "aliases": (BASE + "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
            f"{c}: &{c} [{', '.join([f'*{p}'] * 10)}]\n" for p, c in zip("abcdefghijkl", "bcdefghijklm", strict=True))).encode(),
        "huge": (BASE + "#" + "x" * 6_000_000 + "\n").encode(),
        "nul": (BASE + "description: a\x00b\n").encode(),
    }[name]


@pytest.mark.parametrize("case, needle", [
    ("latin-1", "not UTF-8"), ("utf-16", "UTF-16"), ("nested", "nested"), ("long-int", "4300 digits"),
    ("aliases", "aliases"), ("huge", "too large"), ("nul", "NUL"),
])
def test_recipe_bytes(tmp_path, case, needle):
    path = tmp_path / "r.yaml"
    path.write_bytes(_bytes_case(case))
    with pytest.raises(BadInput, match=needle) as e:
        load_recipe(path)
    assert str(path) in str(e.value)


@pytest.mark.parametrize("sets, needle", [
    (["name=["], "--set name: not valid YAML"), (["name={a"], "--set name: not valid YAML"),
    (["name.x=1"], "--set name.x: name is a str"), (["model=1", "model.path=x"], "--set model.path: model is a int"),
    (["optimize.method=!!python/object/apply:os.system [true]"], "--set optimize.method"),
    (["name=a\x00b"], "NUL"), (["name=a\udcffb"], "surrogate"), (["a..b=1"], "KEY=VALUE"), (["=1"], "KEY=VALUE"),
    (["gate.checks.99.margin=1"], "not an index"),
    (["engine={backend: ctranslate2}"], "cannot take optimize.method 'int8_weight_only'"),
    (["engine={backend: openvino}"], "cannot take optimize.method"),
    (["optimize.method=none", "engine={backend: openvino, activations: bf16}"], "kv_cache_precision f16 or u8"),
    (["model.dtype=float16"], "engine.dtype"), (["model.trust_remote_code=true"], "engine.trust_remote_code"),
])
def test_set_values(tmp_path, sets, needle):
    path = tmp_path / "r.yaml"
    path.write_text(BASE)
    with pytest.raises(BadInput, match=needle):
        load_recipe(path, sets)


@settings(max_examples=150, deadline=5000, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.one_of(st.binary(max_size=2000),
                      st.text(max_size=500).map(lambda t: t.encode("utf-8", "surrogatepass")),
                      st.sampled_from(["x: [", "{", "!!binary AA", "a: *b", "- - - [", "---\n...\n"]).map(str.encode)),
       sets=st.lists(st.text(max_size=40), max_size=3))
def test_any_bytes_are_a_recipe_or_bad_input(tmp_path, data, sets):
    path = tmp_path / "fuzz.yaml"
    path.write_bytes(data)
    try:
        load_recipe(path, sets)
    except BadInput:
        pass


def test_exit_codes_from_the_cli(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_bytes(_bytes_case("latin-1"))
    proc = kiln("validate", str(path), cwd=tmp_path)
    assert proc.returncode == 2 and "not UTF-8" in " ".join(proc.stderr.split()) and "Traceback" not in proc.stderr
    path.write_text(BASE)
    proc = kiln("run", str(path), "--set", "name.x=1", cwd=tmp_path)
    assert proc.returncode == 2 and "--set name.x" in " ".join(proc.stderr.split()) and "Traceback" not in proc.stderr


def _corrupt(model: Path, case: str) -> None:
    weights = model / "model.safetensors"
    if case == "config-json":
        (model / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], ')
    elif case == "truncated":
        data = weights.read_bytes()
        weights.write_bytes(data[: len(data) // 2])
    elif case == "huge-header":
        weights.write_bytes(struct.pack("<Q", 10**15) + b"{}" * 8)
    elif case == "no-tokenizer":
        for name in ("tokenizer.json", "tokenizer.model", "vocab.json"):
            (model / name).unlink(missing_ok=True)
    elif case == "encoder":
        config = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps({**config, "architectures": ["BertModel"]}))


@pytest.mark.parametrize("case, needle", [
    ("config-json", "config.json is not valid JSON"), ("truncated", "is truncated"),
    ("huge-header", "not a valid safetensors file"), ("no-tokenizer", "has no tokenizer"),
    ("encoder", "not a causal language model"), ("prompts", "line 1 is not JSON"), ("cache", "KILN_CACHE"),
])
def test_pipeline_inputs_are_refused_before_any_stage(tmp_path, tiny_model_dir, case, needle):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    _corrupt(model, case)
    changes = {}
    if case == "prompts":
        (tmp_path / "prompts.jsonl").write_text("What is 2 + 2?\nAnd 3 + 3?\n")
        changes["evaluate__benchmark"] = {"prompts": str(tmp_path / "prompts.jsonl"), "num_prompts": 2}
    recipe = write_recipe(tmp_path / "r.yaml", model, **changes)
    cache = fresh_cache(tmp_path / "cache")
    env = {"KILN_CACHE": str(cache)}
    if case == "cache":
        (tmp_path / "a-file").write_text("")
        env["KILN_CACHE"] = str(tmp_path / "a-file" / "cache")  # cannot be created, even by root
    proc = kiln("run", str(recipe), cwd=tmp_path, env=env)
    said = " ".join(proc.stderr.split())  # rich wraps long lines
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert needle in said and "Traceback" not in said, proc.stderr[-3000:]
    assert not (cache / "stages").exists(), "a stage ran before the up-front checks"
