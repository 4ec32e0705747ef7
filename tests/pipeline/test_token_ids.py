"""The stage keys' token ids are kept in the cache: a run whose stages are all reused does not load
transformers' tokenizer to rebuild them, and what it reads back is what the tokenizer makes."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

from transformers import AutoTokenizer

from kiln.engine.base import MANIFEST
from kiln.evaluate.quality.base import documents
from kiln.pipeline.stages.inputs import _tokenizer_files_hash, token_ids

TEXT = "It is a truth universally acknowledged, that a single man in possession of a good fortune. " * 20


def _engine_dir(tmp_path: Path, source: Path) -> Path:
    engine = tmp_path / "engine"
    engine.mkdir()
    (engine / MANIFEST).write_text(json.dumps({"backend": "torch", "config": {}, "source": {"path": str(source)},
                                               "versions": {}, "hardware": {}, "build": {}}))
    return engine


def test_token_ids_are_the_tokenizers_and_read_back_without_it(tmp_path, tiny_model_dir):
    ctx = SimpleNamespace(cache=tmp_path / "cache")
    engine = _engine_dir(tmp_path, tiny_model_dir)
    calls = []

    def cut(tok):
        calls.append(1)
        return documents(tok, TEXT, 16, 4)

    what = {"documents": "t1", "seq_len": 16, "max_documents": 4}
    first = token_ids(ctx, engine, what, cut)
    assert first == documents(AutoTokenizer.from_pretrained(tiny_model_dir), TEXT, 16, 4) and len(first) == 4
    assert token_ids(ctx, engine, what, cut) == first and len(calls) == 1  # the second time from the cache
    token_ids(ctx, engine, {**what, "seq_len": 8}, lambda tok: documents(tok, TEXT, 8, 4))
    assert len(list((ctx.cache / "tokenized").iterdir())) == 2  # another cut is another entry


def test_another_tokenizer_is_another_key(tmp_path, tiny_model_dir):
    copy = tmp_path / "copy"
    shutil.copytree(tiny_model_dir, copy, ignore=shutil.ignore_patterns("*.safetensors"))
    assert _tokenizer_files_hash(str(copy)) == _tokenizer_files_hash(str(tiny_model_dir))
    config = json.loads((copy / "tokenizer_config.json").read_text())
    (copy / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 17}))
    assert _tokenizer_files_hash.__wrapped__(str(copy)) != _tokenizer_files_hash(str(tiny_model_dir))


def test_a_reused_run_does_not_import_transformers(tmp_path, tiny_model_dir):
    """The cached stage keys, in a process of its own: no tokenizer is loaded a second time."""
    ctx_code = f"""
import sys, json
from pathlib import Path
from types import SimpleNamespace
from kiln.pipeline.stages.inputs import token_ids
ctx = SimpleNamespace(cache=Path({str(tmp_path / 'cache')!r}))
ids = token_ids(ctx, Path({str(tmp_path / 'engine')!r}), {{"prompts": "p"}},
                lambda tok: [tok(t, add_special_tokens=False)["input_ids"] for t in ["one", "two words"]])
print(json.dumps({{"ids": ids, "transformers": "transformers" in sys.modules}}))
"""
    _engine_dir(tmp_path, tiny_model_dir)
    runs = [json.loads(subprocess.run([sys.executable, "-c", ctx_code], capture_output=True, text=True,
                                      check=True).stdout) for _ in range(2)]
    assert runs[0]["transformers"] and not runs[1]["transformers"]
    assert runs[0]["ids"] == runs[1]["ids"] and all(runs[0]["ids"])
