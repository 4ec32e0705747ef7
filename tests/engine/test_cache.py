"""The engine cache: content-addressed, built once, never reused across hardware."""

from __future__ import annotations

import json

import pytest

import kiln.engine.cache as cache
import kiln.engine.loader as loader
from kiln.engine.base import MANIFEST, GenerationRequest
from kiln.engine.cache import build_engine, hardware_fingerprint
from kiln.engine.hf_torch import TorchEngineConfig
from kiln.engine.loader import load_engine, read_manifest
from kiln.core.errors import BadInput


def test_fingerprint_names_the_cpu():
    fp = hardware_fingerprint()
    assert fp["cpu"]["model"] != "unknown"
    assert isinstance(fp["cpu"]["isa"], list) and isinstance(fp["gpus"], list)


def test_built_once_then_reused(tiny_model_dir, tmp_path, monkeypatch):
    config = TorchEngineConfig(threads=1)
    first = build_engine(config, tiny_model_dir, "sha-a", tmp_path)
    manifest = read_manifest(first)
    assert manifest["backend"] == "torch" and manifest["source"]["sha256"] == "sha-a"
    assert manifest["versions"]["torch"] and manifest["hardware"] == hardware_fingerprint()
    assert first.parent == tmp_path / "engines" and not list(tmp_path.glob("engines/*.partial"))

    def no_rebuild(*a, **k):
        raise AssertionError("a cached engine was rebuilt")

    monkeypatch.setattr(cache, "write_engine", no_rebuild)
    assert build_engine(config, tiny_model_dir, "sha-a", tmp_path) == first


def test_key_changes_with_every_input(tiny_model_dir, tmp_path, monkeypatch):
    base = build_engine(TorchEngineConfig(), tiny_model_dir, "sha-a", tmp_path)
    assert build_engine(TorchEngineConfig(), tiny_model_dir, "sha-b", tmp_path) != base
    assert build_engine(TorchEngineConfig(dtype="bfloat16"), tiny_model_dir, "sha-a", tmp_path) != base
    monkeypatch.setattr(cache, "library_versions", lambda names, **_: {n: "0.0" for n in names})
    assert build_engine(TorchEngineConfig(), tiny_model_dir, "sha-a", tmp_path) != base
    monkeypatch.undo()
    monkeypatch.setattr(cache, "hardware_fingerprint", lambda: {"cpu": {"model": "other", "isa": []}, "gpus": []})
    assert build_engine(TorchEngineConfig(), tiny_model_dir, "sha-a", tmp_path) != base
    monkeypatch.undo()
    # The backend's revision (its adapter's behaviour changed): a new key; the revision it had is the old key.
    from kiln.engine.hf_torch import TorchBackend

    monkeypatch.setattr(TorchBackend, "revision", TorchBackend.revision + 1)
    revised = build_engine(TorchEngineConfig(), tiny_model_dir, "sha-a", tmp_path)
    assert revised != base and read_manifest(revised)["key"] == revised.name
    monkeypatch.undo()
    assert build_engine(TorchEngineConfig(), tiny_model_dir, "sha-a", tmp_path) == base


def test_failed_build_leaves_nothing_behind(tmp_path):
    (tmp_path / "ckpt").mkdir()
    with pytest.raises(BadInput):
        build_engine(TorchEngineConfig(), tmp_path / "ckpt", "sha", tmp_path / "cache")
    assert not list((tmp_path / "cache" / "engines").iterdir())


def test_load_engine_by_manifest(tiny_model_dir, tmp_path, torch_engine):
    engine_dir = build_engine(TorchEngineConfig(threads=1), tiny_model_dir, "sha-a", tmp_path)
    engine = load_engine(engine_dir)
    prompt = torch_engine.tokenizer("Hello there").input_ids
    request = GenerationRequest(prompt, 5, ignore_eos=True)
    assert [e.token_id for e in engine.generate([request])] == [e.token_id for e in torch_engine.generate([request])]
    assert engine.manifest["source"]["sha256"] == "sha-a"


def test_engine_from_other_hardware_is_refused(tiny_model_dir, tmp_path, monkeypatch):
    engine_dir = build_engine(TorchEngineConfig(), tiny_model_dir, "sha-a", tmp_path)
    monkeypatch.setattr(loader, "hardware_fingerprint",
                        lambda: {"cpu": {"model": "Some Other CPU", "isa": ["avx512f"]}, "gpus": []})
    with pytest.raises(BadInput, match="different hardware") as e:
        load_engine(engine_dir)
    assert any("Some Other CPU" in p for p in e.value.problems)


def test_bad_engine_dirs_are_named(tmp_path):
    with pytest.raises(BadInput, match=MANIFEST):
        load_engine(tmp_path)
    (tmp_path / MANIFEST).write_text("{not json")
    with pytest.raises(BadInput, match="not valid JSON"):
        load_engine(tmp_path)
    manifest = {"backend": "onnx", "config": {}, "source": {}, "versions": {}, "hardware": None, "build": {}}
    (tmp_path / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(BadInput, match="Unknown engine backend 'onnx'"):
        load_engine(tmp_path)
    manifest |= {"backend": "torch", "config": {"backend": "torch", "dtpye": "float32"}}
    (tmp_path / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(BadInput, match="invalid engine config") as e:
        load_engine(tmp_path)
    assert any("dtpye" in p for p in e.value.problems)
