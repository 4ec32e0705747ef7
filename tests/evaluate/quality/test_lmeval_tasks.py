"""kiln's shipped task templates: rendered with real paths, loaded offline, fingerprinted by content."""

from __future__ import annotations

import json
import os

import pytest
from pydantic import ValidationError

from kiln.evaluate.quality.lmeval import LmEvalConfig, prepare_tasks, task_fingerprint, task_manager
from kiln.evaluate.tasks import GSM8K_DOCS, HELDOUT_DOC_CHARS, SHIPPED, heldout_documents, render_shipped
from kiln.core.errors import BadInput
from tests.evaluate.quality.lmeval_data import write_data


def test_shipped_tasks_render_and_load_offline_without_the_builtin_index(data, tmp_path):
    out = render_shipped(list(SHIPPED), data, tmp_path / "tasks")
    text = (out / "word_swap.yaml").read_text()
    assert str(data.word_swap.resolve()) in text and "${" not in text
    manager = task_manager([out])
    assert os.environ["HF_HUB_OFFLINE"] == "1" and os.environ["HF_DATASETS_OFFLINE"] == "1"
    assert sorted(manager.all_subtasks) == sorted(SHIPPED)  # no built-in lm-eval task was indexed
    tasks = manager.load(list(SHIPPED))["tasks"]
    docs = {name: list(task.test_docs()) for name, task in tasks.items()}
    assert len(docs["word_swap"]) == 10 and docs["word_swap"][0]["choices"]
    assert len(docs["gsm8k_answer"]) == min(12, GSM8K_DOCS)
    assert docs["heldout"] == [{"id": f"heldout-{i:03d}", "text": t}
                               for i, t in enumerate(heldout_documents(data.eval_text.read_text()))]
    for task in tasks.values():  # every metric declares its direction and aggregation
        assert all({"aggregation", "higher_is_better"} <= set(m) for m in task.config.metric_list)


def test_heldout_documents_are_whole_paragraphs_without_headings():
    paras = ["Chapter 1"] + [f"Paragraph {i} " + "word " * 60 for i in range(40)]
    docs = heldout_documents("\n\n".join(paras))
    assert docs and all(len(d) >= HELDOUT_DOC_CHARS for d in docs)
    assert not any("Chapter 1" in d for d in docs)
    assert docs[0].startswith("Paragraph 0 ") and "\n\nParagraph 1 " in docs[0]


def test_fingerprint_follows_content_not_paths(data, tmp_path):
    a = prepare_tasks(["word_swap", "heldout"], tmp_path / "a", data)
    b = prepare_tasks(["word_swap", "heldout"], tmp_path / "b", data)
    assert a.include_paths != b.include_paths
    assert a.fingerprints() == b.fingerprints()
    changed = write_data(tmp_path / "other", swaps=11)
    c = prepare_tasks(["word_swap", "heldout"], tmp_path / "c", changed)
    assert c.fingerprints()["word_swap"] != a.fingerprints()["word_swap"]
    assert c.fingerprints()["heldout"] == a.fingerprints()["heldout"]  # same text, same documents


def test_user_task_by_path(data, tmp_path):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "my_swap.yaml").write_text(
        (render_shipped(["word_swap"], data, tmp_path / "r") / "word_swap.yaml").read_text()
        .replace("task: word_swap", "task: my_swap"))
    tasks = prepare_tasks(["heldout", str(folder / "my_swap.yaml")], tmp_path / "w", data)
    assert tasks.names == ["heldout", "my_swap"]
    assert folder.resolve() in tasks.include_paths
    assert len(task_fingerprint("my_swap", tasks.include_paths)) == 64
    with pytest.raises(BadInput, match="not found"):
        prepare_tasks([str(folder / "absent.yaml")], tmp_path / "w", data)
    (folder / "group.yaml").write_text("group: g\ntask:\n  - my_swap\n")
    with pytest.raises(BadInput, match="no `task:` name"):
        prepare_tasks([str(folder / "group.yaml")], tmp_path / "w", data)


def test_missing_demo_data_is_a_clear_error(data, tmp_path):
    broken = type(data)(**{**vars(data), "word_swap": tmp_path / "absent.jsonl"})
    with pytest.raises(BadInput, match="word_swap.*not found.*kiln prepare-demo"):
        render_shipped(["word_swap"], broken, tmp_path / "t")


def test_config_rejects_unknown_tasks_and_fields():
    assert LmEvalConfig().tasks == list(SHIPPED)
    with pytest.raises(ValidationError, match="Did you mean 'word_swap'"):
        LmEvalConfig(tasks=["word_swp"])
    with pytest.raises(ValidationError, match="extra"):
        LmEvalConfig(limits=3)
    with pytest.raises(ValidationError, match="twice"):
        LmEvalConfig(tasks=["heldout", "heldout"])
    assert LmEvalConfig(tasks=["my/task.yaml"], limit=5, batch_size=8).limit == 5
    assert json.loads(LmEvalConfig().model_dump_json())["batch_size"] >= 1


def test_config_module_imports_no_heavy_library():
    """`kiln validate` reads LmEvalConfig: it must not pay for lm-eval, torch or datasets."""
    import subprocess
    import sys

    code = ("import sys, kiln.evaluate.quality.lmeval; "
            "print([m for m in ('lm_eval', 'torch', 'datasets', 'transformers') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
